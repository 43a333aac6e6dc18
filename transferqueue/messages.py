"""Every message kind of the TransferQueue protocol, declared once.

A message kind is one typed struct (``msgspec.Struct``): its fields and their bounds are the
request's schema, its base class names the server that answers it and the type of the reply.
From this one declaration come

- the wire form (:mod:`transferqueue.wire` encodes the struct; a server decodes straight into
  it, so a request that does not match its schema is a typed error before anything acts on
  it),
- the server's dispatch (:func:`handlers`: the handler method named after the kind),
- the client's call (``await link.call(GetMeta(...))`` returns the declared reply type).

Bounds come from :mod:`transferqueue.limits`; checks msgspec cannot express (integer arrays,
column values) are :class:`Check` objects in the field's ``Annotated`` metadata, applied in
``__post_init__`` (after decoding, and when a client builds the message).

| server     | kinds                                                                          |
|------------|--------------------------------------------------------------------------------|
| controller | hello, ping, register_unit**, lost, register_fields, get_specs, allocate,      |
|            | discard, commit, get_meta, ack, release, renew, declare_tasks, finish, clear*, |
|            | stats, reset*, status, reset_consumption, set_custom_meta, get_custom_meta,    |
|            | lost_rows, retire_groups, kv_rows, kv_delete, kv_list, export_state,           |
|            | hold_export, import_rows, import_tasks                                         |
| unit       | write, read, free, ping, clear*, stats, reset*, shm_attach, shm_detach,        |
|            | inventory*, copy_rows**                                                        |

``*``: needs an admin key when the service has one (see :mod:`transferqueue.auth`);
``**``: the service's own key (its servers).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, get_args, get_origin
from typing import get_type_hints as _hints

import msgspec
import numpy as np
from msgspec import Meta

from transferqueue.checks import Check, Columns, Ints, KeyList, MetaMaps, encode_meta
from transferqueue.errors import DeniedError
from transferqueue.keys import KeyListing, KeyRows
from transferqueue.limits import (
    MAX_INDEX,
    MAX_KEY_CHARS,
    MAX_KEYS,
    MAX_META_BYTES,
    MAX_NAME_CHARS,
    MAX_NAMES,
    MAX_OPTIONS,
    MAX_ROWS,
    MAX_WAIT_S,
)
from transferqueue.meta import BatchMeta
from transferqueue.retire import LostRows, Retired
from transferqueue.schema import FieldSpec
from transferqueue.snapshot import StoreExport, TaskImports
from transferqueue.status import PartitionStatus

__all__ = [
    "KINDS",
    "TRUSTED",
    "Caller",
    "ControllerRequest",
    "Request",
    "UnitRequest",
    "encode_meta",
    "handlers",
]

R = TypeVar("R")
Server = Literal["controller", "unit"]
Role = Literal["client", "admin", "service"]
_RANK = {"client": 0, "admin": 1, "service": 2}


@dataclass(frozen=True)
class Caller:
    """Who sent a request. ``identity``: the client's CURVE public key (z85), None when the
    service runs without keys. ``role``: ``client`` < ``admin`` < ``service`` (the servers of
    the service itself); without keys every caller is trusted as ``service``."""

    identity: str | None = None
    role: Role = "service"

    def may(self, needs: Role) -> bool:
        return _RANK[self.role] >= _RANK[needs]


TRUSTED = Caller()
"""The caller of an embedded deployment, and of a service without keys."""


# -- field types ---------------------------------------------------------------------------------
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
Names = Annotated[list[Name], Meta(max_length=MAX_NAMES)]
Specs = Annotated[dict[Name, FieldSpec], Meta(max_length=MAX_NAMES)]
Count = Annotated[int, Meta(ge=0, le=MAX_ROWS)]
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
LeaseId = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Bytes = Annotated[int, Meta(ge=0, le=MAX_INDEX)]
WaitS = Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)]  # (NaN fails every bound)
LeaseS = Annotated[float, Meta(gt=0.0, le=MAX_WAIT_S)]
Rows = Annotated[np.ndarray, Ints(1)]
PerRow = Annotated[np.ndarray, Ints(0, 1)]  # one value per row, or one for all rows
Options = Annotated[
    dict[Annotated[str, Meta(max_length=64)], int | float | str | bool | None],
    Meta(max_length=MAX_OPTIONS),
]
ArenaName = Annotated[str, Meta(max_length=64)]
Grant = Annotated[bytes, Meta(max_length=64)]
Key = Annotated[str, Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Keys = Annotated[list[Key], Meta(min_length=1, max_length=MAX_KEYS), KeyList()]
ColumnMap = Annotated[dict[Name, Any], Meta(max_length=MAX_NAMES), Columns()]
MetaList = Annotated[
    list[Annotated[bytes, Meta(max_length=MAX_META_BYTES)]], Meta(max_length=MAX_ROWS), MetaMaps()
]


# -- the base of every kind ----------------------------------------------------------------------
class Request(msgspec.Struct, Generic[R], array_like=True, forbid_unknown_fields=True):
    """Base of every message kind. A kind sets ``kind`` (its name on the wire, and the name of
    its handler method) and subclasses :class:`ControllerRequest` or :class:`UnitRequest`
    parametrized with its reply type."""

    kind: ClassVar[str]
    server: ClassVar[Server]
    needs: ClassVar[Role] = "client"
    """The least role that may send it (see :class:`Caller`)."""
    waits: ClassVar[bool] = False
    """Whether the server may hold it up to its ``timeout_s`` field. A client sends such a
    request in slices (``partial=False`` and a short ``timeout_s``: at the end of a slice the
    server answers None), so a server that dies is noticed within a slice."""
    reply: ClassVar[Any]
    """The type the reply decodes into (set from the class's ``Request[...]`` parameter)."""
    wire_reply: ClassVar[Any]
    """``reply``, or ``reply | None`` for a kind that ``waits`` (a slice that ran out)."""
    _checks: ClassVar[tuple[tuple[str, Check], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return  # an intermediate base
        table = KINDS[cls.server]
        if kind in table:
            raise TypeError(f"message kind {kind!r} of the {cls.server} is declared twice")
        table[kind] = cls
        cls.reply = _reply_type(cls)
        cls.wire_reply = cls.reply | None if cls.waits and cls.reply is not None else cls.reply
        cls._checks = _Pending  # resolved on first use (annotations are strings until then)

    def __post_init__(self) -> None:
        checks = type(self)._checks
        if checks is _Pending:
            checks = type(self)._checks = _collect_checks(type(self))
        for name, check in checks:
            setattr(self, name, check(getattr(self, name), name))


_Pending: Any = object()
KINDS: dict[str, dict[str, type[Request[Any]]]] = {"controller": {}, "unit": {}}
"""Every declared kind, per server: ``KINDS["controller"]["get_meta"] is GetMeta``."""


def _reply_type(cls: type) -> Any:
    for base in getattr(cls, "__orig_bases__", ()):
        origin = get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Request):
            (reply,) = get_args(base)
            return None if reply is type(None) else reply
    raise TypeError(f"{cls.__name__} must subclass ControllerRequest[R] or UnitRequest[R]")


def _collect_checks(cls: type) -> tuple[tuple[str, Check], ...]:
    out = []
    for name, hint in _hints(cls, include_extras=True).items():
        for part in (hint, *get_args(hint)):  # (X | None) wraps the Annotated
            if get_origin(part) is Annotated:
                out += [(name, m) for m in part.__metadata__ if isinstance(m, Check)]
    return tuple(out)


class ControllerRequest(Request[R]):
    server = "controller"


class UnitRequest(Request[R]):
    server = "unit"


# -- controller ----------------------------------------------------------------------------------
class HelloReply(msgspec.Struct, array_like=True):
    protocol: int
    units: Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=4096)]


class Hello(ControllerRequest[HelloReply]):
    """A client connecting: the protocol version and the storage units' addresses."""

    kind = "hello"


class Ping(ControllerRequest[str]):
    """Are you alive? The answer is the server's incarnation (see
    :mod:`transferqueue.liveness`); answered inline, never queued behind other work."""

    kind = "ping"


class RegisterUnit(ControllerRequest[None]):
    """A storage unit process that (re)started: where it listens and its incarnation. The
    controller places new rows on it again (a unit of this service: its key, if any)."""

    kind = "register_unit"
    needs = "service"
    unit_id: Annotated[int, Meta(ge=0, le=4095)]
    address: Annotated[str, Meta(max_length=1024)]
    incarnation: Annotated[str, Meta(max_length=64)]


class Lost(ControllerRequest[np.ndarray]):
    """Which of these rows were lost with a storage unit that died (a reader whose read
    failed asks). ``units``: the units whose read failed; the controller asks each for its
    incarnation first, so that a unit restarted faster than its heartbeat missed a beat is
    known as restarted (its rows lost) before the answer."""

    kind = "lost"
    indexes: Rows
    units: Annotated[list[Annotated[int, Meta(ge=0, le=4095)]], Meta(max_length=4096)] = []


class RegisterFields(ControllerRequest[dict[str, FieldSpec]]):
    """A producer's first put of these fields: their specs (a disagreeing spec is an error)."""

    kind = "register_fields"
    specs: Specs


class GetSpecs(ControllerRequest[dict[str, FieldSpec]]):
    """Every registered field's spec (a reader meeting a field it has not seen)."""

    kind = "get_specs"


class Allocate(ControllerRequest[BatchMeta]):
    """New rows for a put: indexes, units, headers, and the grants to create them on the
    units. Waits up to ``timeout_s`` for capacity (None: without bound)."""

    kind = "allocate"
    waits = True
    n: Count
    partition: Name
    groups: PerRow | None = None
    versions: PerRow | None = None
    lengths: PerRow | None = None
    nbytes: Bytes | None = None
    producer: Annotated[str, Meta(max_length=64)] | None = None
    timeout_s: WaitS | None = None
    partial: bool = True


class Discard(ControllerRequest[None]):
    """Undo an allocate whose payload never arrived (a put that failed half way)."""

    kind = "discard"
    indexes: Rows


class Commit(ControllerRequest[None]):
    """Fields of these rows are stored: consumers may now see them; acks ``lease_id``.
    ``dropped`` (two copies of each row): units the writer could not write its copies to
    (gone, as it saw them; each row got its other copy): the controller forgets the rows'
    copies there and frees them there, in case the write landed after all. ``copies``: the
    second unit of each row the writer wrote (its meta's ``replica_units``; -1: none): a
    second copy the controller made since the writer took its meta is forgotten (it lacks
    these fields) and made again (see :mod:`transferqueue.rereplicate`)."""

    kind = "commit"
    indexes: Rows
    fields: Names
    versions: PerRow | None = None
    lengths: PerRow | None = None
    lease_id: LeaseId | None = None
    dropped: Annotated[list[Annotated[int, Meta(ge=0, le=4095)]], Meta(max_length=4096)] = []
    copies: PerRow | None = None


class GetMeta(ControllerRequest[BatchMeta]):
    """Lease up to ``batch_size`` rows ready for ``task`` (see ``AsyncClient.get_meta``)."""

    kind = "get_meta"
    waits = True
    task: Name
    partition: Name
    fields: Names | None
    batch_size: Annotated[int, Meta(ge=1, le=MAX_ROWS)]
    lease_s: LeaseS = 60.0
    sampler: Annotated[str, Meta(max_length=64)] = "fifo"
    sampler_options: Options = {}
    min_version: Int64 | None = None
    max_group: Int64 | None = None
    timeout_s: WaitS | None = None
    partial: bool = True


class Ack(ControllerRequest[None]):
    """Consume a lease's rows (all, or ``indexes`` of them)."""

    kind = "ack"
    lease_id: LeaseId
    indexes: Rows | None = None


class Release(ControllerRequest[None]):
    """Give a lease's rows back unconsumed."""

    kind = "release"
    lease_id: LeaseId
    indexes: Rows | None = None


class Renew(ControllerRequest[None]):
    """Extend a lease by ``lease_s`` from now (a producer about to write its results)."""

    kind = "renew"
    lease_id: LeaseId
    lease_s: LeaseS
    indexes: Rows | None = None


class DeclareTasks(ControllerRequest[None]):
    """Every consumer task of a partition: rows are freed once all have acknowledged them."""

    kind = "declare_tasks"
    partition: Name
    tasks: Names


class Finish(ControllerRequest[None]):
    """No more rows will be put into the partition."""

    kind = "finish"
    partition: Name


class Clear(ControllerRequest[None]):
    """Drop every row of the partition (all partitions if None)."""

    kind = "clear"
    needs = "admin"
    partition: Name | None = None


class Stats(ControllerRequest[dict[str, Any]]):
    """Rows, tasks, leases and fields, as plain data."""

    kind = "stats"


class Reset(ControllerRequest[None]):
    """Forget everything, on the controller and every unit."""

    kind = "reset"
    needs = "admin"


class Status(ControllerRequest[PartitionStatus]):
    """The live rows of a partition, which of ``fields`` they have, ``task``'s state of each
    (see :mod:`transferqueue.status`)."""

    kind = "status"
    partition: Name
    fields: Names | None = None
    task: Name | None = None


class ResetConsumption(ControllerRequest[int]):
    """Give every live row of the partition that ``task`` leased or consumed back to its
    queue; the task's open leases there close. Replies with the number of rows given back."""

    kind = "reset_consumption"
    partition: Name
    task: Name


class SetCustomMeta(ControllerRequest[None]):
    """Attach custom metadata (one msgpack map per row; empty: none) to live rows."""

    kind = "set_custom_meta"
    indexes: Rows
    metas: MetaList


class GetCustomMeta(ControllerRequest[list[bytes]]):
    """The custom metadata of live rows, one msgpack map per row."""

    kind = "get_custom_meta"
    indexes: Rows


class GetLostRows(ControllerRequest[LostRows]):
    """Rows of the partition lost before ``task`` consumed them, logged after cursor
    ``after``, with their group ids (see :mod:`transferqueue.retire`)."""

    kind = "lost_rows"
    partition: Name
    task: Name
    after: Annotated[int, Meta(ge=0, le=2**62)] = 0
    limit: Annotated[int, Meta(ge=1, le=MAX_ROWS)] = 1 << 16


class RetireGroups(ControllerRequest[Retired]):
    """Free every live row of these groups before putting them again; groups a row of
    which ``unless_leased_by`` holds leased are left alone and named busy."""

    kind = "retire_groups"
    partition: Name
    groups: Rows
    unless_leased_by: Name | None = None


class KvRows(ControllerRequest[KeyRows]):
    """The rows of ``keys`` in ``partition``, in the keys' order (an unknown key is an
    ``UnknownKeyError``). A read names ``fields`` (every row must have them written), or
    None (the reply names the fields every row has). ``create``: keys without a row get new
    rows (a key-value put; the reply says which, their grants come with the meta), waiting
    up to ``timeout_s`` for capacity; ``groups`` (one per key, or one for all) are the new
    rows' groups, ``nbytes`` the payload of all keys (see :mod:`transferqueue.keys`)."""

    kind = "kv_rows"
    waits = True
    partition: Name
    keys: Keys
    create: bool = False
    fields: Names | None = None
    groups: PerRow | None = None
    nbytes: Bytes | None = None
    producer: Annotated[str, Meta(max_length=64)] | None = None
    timeout_s: WaitS | None = None
    partial: bool = True


class KvDelete(ControllerRequest[None]):
    """Delete the rows of ``keys`` (None: every key of the partition), all or nothing: a
    row a task holds leased refuses the call with ``KeyLeasedError``. Their payload is
    freed on the units before the reply."""

    kind = "kv_delete"
    partition: Name
    keys: Keys | None = None


class KvList(ControllerRequest[KeyListing]):
    """The keys of ``partition`` in row order; per field of ``fields`` (every field some
    key's row has, with ``all_fields``) which keys' rows have it."""

    kind = "kv_list"
    partition: Name
    fields: Names | None = None
    all_fields: bool = False


class ExportState(ControllerRequest[StoreExport]):
    """A snapshot of partitions (all if None) at this instant, as plain data (see
    :mod:`transferqueue.snapshot`); their rows' payload stays on the units for ``hold_s``
    (renewed by ``hold_export``) so that the saver can read it."""

    kind = "export_state"
    partitions: Names | None = None
    hold_s: LeaseS = 600.0


class HoldExport(ControllerRequest[None]):
    """Keep a snapshot's rows ``hold_s`` longer; ``hold_s=0`` ends the hold."""

    kind = "hold_export"
    snapshot_id: LeaseId
    hold_s: WaitS


class ImportRows(ControllerRequest[BatchMeta]):
    """Rows of a partition being loaded, with their headers and no field ready (``first``:
    the partition must be new). Replies with the rows and the grants to write them."""

    kind = "import_rows"
    partition: Name
    groups: Rows
    versions: Rows
    lengths: Rows
    first: bool = True
    keys: Annotated[list[Key], Meta(max_length=MAX_ROWS)] = []
    """String keys of some of these rows (see the key-value calls), for rows ``key_rows``."""
    key_rows: Rows | None = None  # positions among these rows


class ImportTasks(ControllerRequest[None]):
    """The end of a partition's load: its tasks (consumed rows, queue order), declared task
    names and finished flag; the partition opens to consumers."""

    kind = "import_tasks"
    partition: Name
    tasks: TaskImports
    declared: Names | None = None
    finished: bool = False


# -- dispatch ------------------------------------------------------------------------------------
Handler = Callable[[Any, Caller], Any]


def handlers(server: Server, *objects: object) -> dict[type[Request[Any]], Handler]:
    """Each declared kind of ``server`` -> the method named after it on the first of
    ``objects`` that has one: ``method(message, caller)`` returns the reply, or an awaitable
    of it. A kind without a handler is an error here, when the server is built."""
    table: dict[type[Request[Any]], Handler] = {}
    for kind, cls in KINDS[server].items():
        for obj in objects:
            method = getattr(obj, kind, None)
            if callable(method):
                table[cls] = method
                break
        else:
            raise TypeError(f"no handler for the {server} message kind {kind!r}")
    return table


async def dispatch(table: dict[type[Request[Any]], Handler], msg: Request[R], caller: Caller) -> R:
    """Run ``msg``'s handler in this process (the embedded deployment's link)."""
    if not caller.may(msg.needs):
        raise DeniedError(f"{msg.kind!r} needs the {msg.needs} key")
    result = table[type(msg)](msg, caller)
    if inspect.isawaitable(result):
        result = await result
    return result


# The storage unit's kinds live in their own module (this one is long enough); imported here,
# once every name they use exists, so that ``messages.Write`` & co. are where callers look.
from transferqueue.unit_messages import (  # noqa: E402
    ClearUnit,
    CopyRows,
    Free,
    Read,
    ResetUnit,
    ShmAttach,
    ShmDetach,
    UnitInventory,
    UnitPing,
    UnitStats,
    Write,
)

__all__ += [
    "ClearUnit",
    "CopyRows",
    "Free",
    "Read",
    "ResetUnit",
    "ShmAttach",
    "ShmDetach",
    "UnitInventory",
    "UnitPing",
    "UnitStats",
    "Write",
]
