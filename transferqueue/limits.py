"""The bounds every request is checked against before anything is sized or stored.

A server sizes no buffer and changes no state from a message until the message has passed
its declared schema (:mod:`transferqueue.wire.messages`) and these bounds, so one request costs a
bounded amount of memory whatever its bytes say. They are deliberately generous for real
workloads (an RL batch is thousands of rows) and far below what would hurt a server.

| bound              | value         | checked on                                                 |
|--------------------|---------------|------------------------------------------------------------|
| MAX_NAME_CHARS     | 256           | field, task, partition, sampler and producer names          |
| MAX_NAMES          | 1,024         | names in one request (fields, tasks, columns, specs)        |
| MAX_ROWS           | 4,194,304     | rows in one request (allocate ``n``, index arrays, batches) |
| MAX_INDEX          | 2**62         | a row index; versions, groups, lengths fit int64            |
| MAX_DIMS           | 8             | dimensions of a tensor or array on the wire, of a field     |
| MAX_DIM            | 2**40         | one dimension                                               |
| MAX_ROW_BYTES      | 16 GiB        | one dense row, one ragged element (a field's spec)          |
| MAX_OBJECT_DEPTH   | 32            | nesting of an object field's values                         |
| MAX_OPTIONS        | 16            | sampler options of a get_meta                               |
| MAX_WAIT_S         | 10,000,000    | a ``timeout_s`` sent to a server (clients wait in slices)   |
| MAX_LEASE_S        | 86,400        | default ``max_lease_s`` of a controller (1 day)             |
| MAX_TASKS          | 1,024         | consumer tasks a controller keeps (all partitions)          |
| MAX_FIELDS         | 1,024         | fields a controller keeps track of                          |
| MAX_FRAME_BYTES    | 1 GiB         | one ZeroMQ frame a server accepts (larger: disconnected)    |
| MAX_META_BYTES     | 4,096         | one row's custom metadata, msgpack-encoded                  |
| MAX_META_REQUEST_BYTES | 64 MiB    | custom metadata set or returned by one request              |
| MAX_KEY_CHARS      | 512           | one key of the key-value calls (a non-empty string)         |
| MAX_KEYS           | 65,536        | keys in one key-value request (put, get, delete)            |
| MAX_CLAIMS         | 65,536        | claimed names a partition keeps (the oldest dropped first)  |
| CONNECTION_FD_RESERVE | 256        | descriptors a server keeps for itself: its default          |
|                    |               | ``max_connections`` is the open-file limit less these       |
|                    |               | (at least half the limit; :mod:`transferqueue.wire.peers`)  |

Times must be finite: NaN, infinity and negatives are refused where a time is expected.
Storage units accept new rows only under a grant the controller signed for them (see
:mod:`transferqueue.wire.grants`), so a unit holds no more rows than the controller allocated.
"""

from __future__ import annotations

__all__ = [
    "CONNECTION_FD_RESERVE",
    "MAX_CLAIMS",
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_FIELDS",
    "MAX_FRAME_BYTES",
    "MAX_INDEX",
    "MAX_KEYS",
    "MAX_KEY_CHARS",
    "MAX_LEASE_S",
    "MAX_META_BYTES",
    "MAX_META_REQUEST_BYTES",
    "MAX_NAMES",
    "MAX_NAME_CHARS",
    "MAX_OBJECT_DEPTH",
    "MAX_OPTIONS",
    "MAX_ROWS",
    "MAX_ROW_BYTES",
    "MAX_TASKS",
    "MAX_WAIT_S",
]

MAX_NAME_CHARS = 256
MAX_NAMES = 1024
MAX_ROWS = 1 << 22
MAX_INDEX = 1 << 62
MAX_DIMS = 8
MAX_DIM = 1 << 40
MAX_ROW_BYTES = 16 << 30
MAX_OBJECT_DEPTH = 32
MAX_OPTIONS = 16
MAX_WAIT_S = 1e7
MAX_LEASE_S = 86400.0
MAX_TASKS = 1024
MAX_FIELDS = 1024
MAX_FRAME_BYTES = 1 << 30
MAX_META_BYTES = 4096
MAX_META_REQUEST_BYTES = 64 << 20
MAX_KEY_CHARS = 512
MAX_KEYS = 1 << 16
MAX_CLAIMS = 1 << 16
CONNECTION_FD_RESERVE = 256
MAX_HOLDERS_PER_BEAT = 4096  # holders named by one alive (a process with more sends several)
