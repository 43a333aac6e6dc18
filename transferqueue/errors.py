"""The error hierarchy of TransferQueue.

Every error has a stable ``code`` so that a server can send it as a typed error reply and the
client can raise the same class on its side. Messages name the field or value at fault, what
was expected, what was received, and what to do.

| class               | code            | raised when                                              |
|---------------------|-----------------|----------------------------------------------------------|
| TQError             | error           | base class; also "internal" errors of a server           |
| SchemaError         | schema          | a write disagrees with a field's spec, or is malformed   |
| UnknownFieldError   | unknown_field   | a read or task names a field nobody has written          |
| UnknownRowError     | unknown_row     | rows are not (or no longer) stored                       |
| UnknownKeyError     | unknown_key     | a key-value call names keys a partition does not hold    |
| KeyLeasedError      | key_leased      | a delete names keys whose rows a task holds leased       |
| RowsLostError       | rows_lost       | rows were lost with a storage unit that died, or their   |
|                     |                 | allocation expired before the put committed them         |
| UnknownLeaseError   | unknown_lease   | an ack/put names a lease the controller never issued     |
| LeaseExpiredError   | lease_expired   | the lease ran out; its rows went back to the task        |
| UnknownTaskError    | unknown_task    | a task was not declared for a partition that has tasks   |
| CapacityError       | capacity        | a write would exceed the configured capacity             |
| TooManyConnectionsError | too_many_connections | a server holds ``max_connections`` client   |
|                     |                 | connections: this one is refused (a CapacityError)       |
| TQTimeoutError      | timeout         | a bounded wait ran out                                   |
| ProtocolError       | protocol        | a message on the wire cannot be decoded                  |
| PeerGoneError       | peer_gone       | a server stopped answering                               |
| ClosedError         | closed          | the client or queue was closed                           |
| BadRequestError     | bad_request     | an argument is invalid (also a ValueError)               |
| FinishedError       | finished        | a put of new rows into a finished partition              |
| DeniedError         | denied          | the caller may not do this (admin key, rows not granted) |
| AuthError           | auth            | keys are missing, unreadable, or needed to listen here   |
| PartitionExistsError| partition_exists| a load names a partition the store already has           |
| CheckpointError     | checkpoint      | a save directory is missing, incomplete or of a newer    |
|                     |                 | format version                                           |
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BadRequestError",
    "CapacityError",
    "CheckpointError",
    "ClosedError",
    "DeniedError",
    "FinishedError",
    "KeyLeasedError",
    "LeaseExpiredError",
    "PartitionExistsError",
    "PeerGoneError",
    "ProtocolError",
    "RowsLostError",
    "SchemaError",
    "TQError",
    "TQTimeoutError",
    "TooManyConnectionsError",
    "UnknownArenaError",
    "UnknownFieldError",
    "UnknownKeyError",
    "UnknownLeaseError",
    "UnknownRowError",
    "UnknownTaskError",
    "error_from_code",
]


class TQError(Exception):
    """Base class of every TransferQueue error."""

    code = "error"


class SchemaError(TQError, ValueError):
    """A write disagrees with the field's spec (dtype, shape, kind) or is malformed."""

    code = "schema"


class UnknownFieldError(TQError, KeyError):
    """A field was named that no producer has written yet."""

    code = "unknown_field"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnknownRowError(TQError, KeyError):
    """Rows are not stored: never written, already freed, or cleared."""

    code = "unknown_row"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownKeyError(TQError, KeyError):
    """Keys that a partition does not hold (never put, deleted, cleared, or freed with their
    row); the message names them and says how to put them."""

    code = "unknown_key"

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class KeyLeasedError(TQError):
    """A delete of keys whose rows a consumer task holds leased: nothing was deleted; delete
    again once the task acknowledges or releases them (or the lease runs out)."""

    code = "key_leased"


class RowsLostError(TQError):
    """Rows are gone for good: the storage unit holding them died (they left every task's
    queue and lease, and ``stats()`` counts them), or a put did not commit them before its
    allocation's deadline. A producer puts them again; a consumer acknowledges the rest of
    its batch (``ack`` skips lost rows). ``indexes``: the lost rows, where known."""

    code = "rows_lost"

    def __init__(self, message: str, indexes: object = None) -> None:
        super().__init__(message)
        self.indexes = indexes


class UnknownLeaseError(TQError):
    """A lease id the controller never issued, or rows that the lease does not hold."""

    code = "unknown_lease"


class LeaseExpiredError(TQError):
    """The lease passed its deadline; its rows were returned to the task's queue."""

    code = "lease_expired"


class UnknownTaskError(TQError):
    """A task not declared for a partition whose consumer tasks were declared."""

    code = "unknown_task"


class CapacityError(TQError):
    """A write would exceed capacity and did not fit before its timeout."""

    code = "capacity"


class TooManyConnectionsError(CapacityError):
    """A server holds as many client connections as its ``max_connections`` allows; this one
    is refused until another closes (see :mod:`transferqueue.wire.peers`)."""

    code = "too_many_connections"


class TQTimeoutError(TQError, TimeoutError):
    """A bounded wait ran out."""

    code = "timeout"


class ProtocolError(TQError):
    """A message could not be decoded, or named an unknown kind."""

    code = "protocol"


class UnknownArenaError(ProtocolError):
    """A request named a shared-memory arena the storage unit has not attached: the unit
    restarted since the client attached it (or dropped it among too many clients). The
    client's unit link then makes new arenas and sends the request again, once."""

    code = "unknown_arena"


class PeerGoneError(TQError, ConnectionError):
    """A server did not answer within the deadline, or its connection closed."""

    code = "peer_gone"


class ClosedError(TQError):
    """The client or the queue was closed."""

    code = "closed"


class BadRequestError(TQError, ValueError):
    """An argument is invalid (a bad batch_size, an unknown sampler, ...)."""

    code = "bad_request"


class FinishedError(TQError):
    """New rows were put into a partition after ``finish``: consumers that got ``end`` would
    never see them."""

    code = "finished"


class DeniedError(TQError, PermissionError):
    """The caller may not do this: ``clear``/``reset`` without the admin key, a write to rows
    the controller did not allocate to the writer, a lease another client took."""

    code = "denied"


class PartitionExistsError(TQError):
    """A load from a save names a partition the store already has."""

    code = "partition_exists"


class CheckpointError(TQError):
    """A save directory is missing, incomplete, of another format version, or does not match
    the store (see :mod:`transferqueue.client.checkpoint`)."""

    code = "checkpoint"


class AuthError(TQError):
    """Keys are missing or unreadable, or a server would listen beyond loopback without
    them."""

    code = "auth"


_BY_CODE: dict[str, type[TQError]] = {
    cls.code: cls
    for cls in (
        TQError,
        SchemaError,
        UnknownFieldError,
        UnknownRowError,
        UnknownKeyError,
        KeyLeasedError,
        RowsLostError,
        UnknownLeaseError,
        LeaseExpiredError,
        UnknownTaskError,
        CapacityError,
        TooManyConnectionsError,
        TQTimeoutError,
        ProtocolError,
        UnknownArenaError,
        PeerGoneError,
        ClosedError,
        BadRequestError,
        FinishedError,
        DeniedError,
        AuthError,
        PartitionExistsError,
        CheckpointError,
    )
}


def error_from_code(code: str, message: str) -> TQError:
    """Rebuild an error sent by a server; unknown codes become a plain :class:`TQError`."""
    return _BY_CODE.get(code, TQError)(message)
