"""Every control message of the cross-process weight transports, declared once.

Declared and sent like TransferQueue's own (:mod:`transferqueue.wire.protocol`): each kind is
one typed struct whose fields carry their bounds, decoded and checked before any handler runs,
over TransferQueue's request/reply layer (:mod:`transferqueue.wire.rpc`). Weights never travel
here (shared memory or a process group moves them); only these small messages do.

The sender of a transport is a server of the ``weights`` role; receivers send it requests:

| kind   | fields                         | reply         | meaning                             |
|--------|--------------------------------|---------------|-------------------------------------|
| join   | member, pid, host              | None          | a receiver (re)joins                |
| poll   | member, timeout_s              | list of events| the events queued for it, the poll  |
|        |                                |               | held up to ``timeout_s`` while none;|
|        |                                |               | also the receiver's heartbeat       |
| have   | member, version, link, bucket  | None          | it holds ``version`` (or one of its |
|        |                                |               | buckets)                            |
| failed | member, version, reason, link, | None          | it could not get ``version`` (or    |
|        | bucket                         |               | one of its buckets)                 |
| relay  | member, to, event              | None          | (ipc) an event for another receiver |
|        |                                |               | (a holder's image for a newcomer)   |
| leave  | member                         | None          | it closes                           |
| ping   |                                | str           | liveness (the sender's incarnation) |

The sender reaches a receiver through *events*, the replies of its polls, in the order sent:

| event      | fields                                 | meaning                                   |
|------------|----------------------------------------|-------------------------------------------|
| ticket     | version, path, layout                  | (shm) a version in a file: map it         |
| link       | link, prefix, store_port, backend,     | (broadcast) build the pair link           |
|            | timeout_s                              |                                           |
| publish    | version, link, image                   | receive a version on the link             |
| commit     | version, link                          | every range went out intact: keep it      |
| serve      | version, prefix, ranges, to            | send a held version to a newcomer         |
| fetch      | version, link, prefix, image           | receive a version from a holder           |
| rejoin     | reason                                 | unknown here or dropped: join again       |
| ipc_share  | version, names, handles, retire        | (ipc) the sender's tensors by handle:     |
|            |                                        | map them (``retire``: exported for this   |
|            |                                        | receiver alone, which retires them)       |
| ipc_begin  | version, layout, offsets, nbytes       | (ipc) a version comes in buckets          |
| ipc_bucket | version, bucket, slots, handles        | (ipc) copy these tensors into the image   |
| ipc_seal   | version                                | (ipc) every bucket went out: keep it      |
| ipc_lend   | version, to                            | (ipc) export the held image for ``to``    |
| ipc_image  | version, layout, handle                | (ipc) a holder's image (relayed): copy it |

``layout`` is :func:`engines.weights_io.plan_state`'s (name, dtype, shape, byte offset per
tensor); ``ranges`` are ``(start, end)`` byte ranges of the packed image (:mod:`.links`).
A *handle* is :mod:`transferqueue.device.sharing`'s (a CUDA IPC handle of a tensor, or a
shared file's name): ``names`` map each tensor name to a handle's index (tied names share
one), ``slots`` map each shared tensor to its spec's index in ``ipc_begin``'s layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from transferqueue.wire.protocol import Name, Request, WaitS

__all__ = [
    "EVENTS",
    "Commit",
    "Event",
    "Failed",
    "Fetch",
    "Have",
    "Image",
    "IpcBegin",
    "IpcBucket",
    "IpcImage",
    "IpcLend",
    "IpcSeal",
    "IpcShare",
    "Join",
    "Leave",
    "Link",
    "Ping",
    "Poll",
    "Publish",
    "Rejoin",
    "Relay",
    "Serve",
    "Ticket",
    "WeightsRequest",
    "layout",
]

R = TypeVar("R")
ROLE = "weights"
MAX_TENSORS = 1 << 20
"""Tensors in one state dict (a large mixture-of-experts model has tens of thousands)."""
MAX_RANGES = 1 << 24
MAX_EVENTS = 1024
"""Events in one poll's reply (more wait for the next poll)."""

Version = Annotated[int, Meta(ge=0, le=2**63 - 1)]
LinkId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Nbytes = Annotated[int, Meta(ge=0, le=2**62)]
Text = Annotated[str, Meta(max_length=4096)]
FilePath = Annotated[str, Meta(min_length=1, max_length=4096)]
Prefix = Annotated[str, Meta(min_length=1, max_length=256)]
Entry = tuple[
    Annotated[str, Meta(max_length=1024)],  # name
    Annotated[str, Meta(max_length=32)],  # dtype, as torch names it without "torch."
    Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=32)],  # shape
    Nbytes,  # offset in the image
]
Layout = Annotated[list[Entry], Meta(max_length=MAX_TENSORS)]


def layout(entries: Sequence[Sequence[Any]]) -> list[Entry]:
    """``plan_state``'s layout (a list per tensor) as the messages carry it."""
    return [(str(n), str(d), [int(x) for x in shape], int(o)) for n, d, shape, o in entries]


Ranges = Annotated[list[tuple[Nbytes, Nbytes]], Meta(max_length=MAX_RANGES)]
Index = Annotated[int, Meta(ge=0, le=MAX_TENSORS)]
BucketId = Annotated[int, Meta(ge=0, le=2**62)]
Handle = Annotated[dict[Annotated[str, Meta(max_length=64)], Any], Meta(max_length=32)]
"""A tensor shared by handle (:mod:`transferqueue.device.sharing`): a few hundred bytes."""
Handles = Annotated[list[Handle], Meta(max_length=MAX_TENSORS)]


# -- events (sender -> receiver, the replies of its polls) ---------------------------------------
class _Event(msgspec.Struct, array_like=True, forbid_unknown_fields=True, tag=True):
    """Base of the events; the tag (first array element) names the kind."""


class Image(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A packed version as it travels on a link: its size, its layout, its ranges."""

    nbytes: Nbytes
    layout: Layout
    ranges: Ranges


class Ticket(_Event, tag="ticket"):
    version: Version
    path: FilePath
    layout: Layout


class Link(_Event, tag="link"):
    link: LinkId
    prefix: Prefix
    store_port: Port
    backend: Annotated[str, Meta(max_length=16)]
    timeout_s: WaitS


class Publish(_Event, tag="publish"):
    version: Version
    link: LinkId
    image: Image


class Commit(_Event, tag="commit"):
    version: Version
    link: LinkId


class Serve(_Event, tag="serve"):
    version: Version
    prefix: Prefix
    ranges: Ranges
    to: Name


class Fetch(_Event, tag="fetch"):
    version: Version
    link: LinkId
    prefix: Prefix
    image: Image


class Rejoin(_Event, tag="rejoin"):
    reason: Text


class IpcShare(_Event, tag="ipc_share"):
    version: Version
    names: Annotated[
        list[tuple[Annotated[str, Meta(max_length=1024)], Index]], Meta(max_length=MAX_TENSORS)
    ]
    handles: Handles
    retire: bool = False


class IpcBegin(_Event, tag="ipc_begin"):
    version: Version
    layout: Layout
    offsets: Annotated[list[Nbytes], Meta(max_length=MAX_TENSORS)]
    nbytes: Nbytes


class IpcBucket(_Event, tag="ipc_bucket"):
    version: Version
    bucket: BucketId
    slots: Annotated[list[tuple[Index, Index]], Meta(max_length=MAX_TENSORS)]
    handles: Handles


class IpcSeal(_Event, tag="ipc_seal"):
    version: Version


class IpcLend(_Event, tag="ipc_lend"):
    version: Version
    to: Name


class IpcImage(_Event, tag="ipc_image"):
    version: Version
    layout: Layout
    handle: Handle


Event = (
    Ticket
    | Link
    | Publish
    | Commit
    | Serve
    | Fetch
    | Rejoin
    | IpcShare
    | IpcBegin
    | IpcBucket
    | IpcSeal
    | IpcLend
    | IpcImage
)
EVENTS = (
    Ticket,
    Link,
    Publish,
    Commit,
    Serve,
    Fetch,
    Rejoin,
    IpcShare,
    IpcBegin,
    IpcBucket,
    IpcSeal,
    IpcLend,
    IpcImage,
)
Events = Annotated[list[Event], Meta(max_length=MAX_EVENTS)]


class WeightsRequest(Request[R]):
    """Base of the requests a weight sender answers (the ``weights`` server role)."""

    server = ROLE


# -- requests (receiver -> sender) ---------------------------------------------------------------
class Join(WeightsRequest[None]):
    member: Name
    pid: Annotated[int, Meta(ge=0)]
    host: Annotated[str, Meta(max_length=256)]
    kind = "join"


class Poll(WeightsRequest[Events]):
    member: Name
    timeout_s: WaitS
    kind = "poll"
    waits = True


class Have(WeightsRequest[None]):
    member: Name
    version: Version
    link: LinkId | None = None
    bucket: BucketId | None = None
    kind = "have"


class Failed(WeightsRequest[None]):
    member: Name
    version: Version
    reason: Text
    link: LinkId | None = None
    bucket: BucketId | None = None
    kind = "failed"


class Relay(WeightsRequest[None]):
    """An event for receiver ``to``, passed on by the sender (ipc: a holder's image)."""

    member: Name
    to: Name
    event: IpcImage
    kind = "relay"


class Leave(WeightsRequest[None]):
    member: Name
    kind = "leave"


class Ping(WeightsRequest[str]):
    kind = "ping"
