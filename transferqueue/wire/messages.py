"""Every message kind of the TransferQueue protocol, declared once.

A message kind is one typed struct (``msgspec.Struct``): its fields and their bounds are the
request's schema, its base class names the server that answers it and the type of the reply.
From this one declaration come

- the wire form (:mod:`transferqueue.wire.codec` encodes the struct; a server decodes straight into
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
|            | discard, commit, get_meta, ack, release, renew, alive, holder_gone,            |
|            | declare_tasks, finish, clear*,                                                 |
|            | stats, reset*, status, reset_consumption, set_custom_meta, get_custom_meta,    |
|            | lost_rows, retire_groups, kv_rows, kv_delete, kv_list, claim, export_state,    |
|            | hold_export, import_rows, import_tasks                                         |
| unit       | write, read, free, ping, clear*, stats, reset*, shm_attach, shm_detach,        |
|            | inventory*, copy_rows**                                                        |

``*``: needs an admin key when the service has one (see :mod:`transferqueue.wire.auth`);
``**``: the service's own key (its servers).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from transferqueue.limits import MAX_HOLDERS_PER_BEAT, MAX_NAMES, MAX_ROWS
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.wire.protocol import (
    ArenaName,
    Bytes,
    ColumnMap,
    ControllerRequest,
    Count,
    Grant,
    Int64,
    Key,
    Keys,
    LeaseId,
    LeaseS,
    MetaList,
    Name,
    Names,
    Options,
    PerRow,
    Rows,
    Specs,
    UnitRequest,
    WaitS,
)
from transferqueue.wire.replies import (
    KeyListing,
    KeyRows,
    LostRows,
    PartitionStatus,
    Retired,
    StoreExport,
    TaskImports,
)

HolderName = Annotated[str, Meta(min_length=1, max_length=96)]
"""The name part of a holder id (a host and process, a stage host's name)."""
HolderId = Annotated[str, Meta(min_length=1, max_length=128)]
"""A lease holder: ``name/token``, the token drawn by each handle (see
:mod:`transferqueue.controller.holders`)."""


# -- controller ----------------------------------------------------------------------------------
class HelloReply(msgspec.Struct, array_like=True):
    protocol: int
    units: Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=4096)]


class Hello(ControllerRequest[HelloReply]):
    """A client connecting: the protocol version and the storage units' addresses."""

    kind = "hello"


class Ping(ControllerRequest[str]):
    """Are you alive? The answer is the server's incarnation (see
    :mod:`transferqueue.wire.liveness`); answered inline, never queued behind other work."""

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
    """A producer's first put of these fields to ``partition``: their specs (one that
    disagrees with the partition's is an error, unless the partition holds no rows)."""

    kind = "register_fields"
    specs: Specs
    partition: Name = "default"


class GetSpecs(ControllerRequest[dict[str, FieldSpec]]):
    """The specs of ``partition``'s fields (a reader meeting a field it has not seen)."""

    kind = "get_specs"
    partition: Name = "default"


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
    these fields) and made again (see :mod:`transferqueue.controller.rereplicate`).
    ``specs``: those the fields were written with; they must be the rows' partition's."""

    kind = "commit"
    indexes: Rows
    fields: Names
    versions: PerRow | None = None
    lengths: PerRow | None = None
    lease_id: LeaseId | None = None
    dropped: Annotated[list[Annotated[int, Meta(ge=0, le=4095)]], Meta(max_length=4096)] = []
    copies: PerRow | None = None
    specs: Specs | None = None


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
    holder: HolderId | None = None
    consume: bool = False
    """At most once: a full batch is acknowledged as it is handed out (one round trip; the
    reply says ``acked``). A short batch stays leased, for the caller to release or ack."""
    request_id: LeaseId | None = None
    """Drawn by the client once per call and kept by every sending of it (a call sent again
    through a controller restart): a sending that finds the lease an earlier one took still
    active gets that lease's batch again, not new rows (see ``Queues.poll``)."""


class Alive(ControllerRequest[None]):
    """Holders' heartbeat (see :mod:`transferqueue.controller.holders`): the clients that
    take leases under ``holder`` and each of ``holders`` are alive. Sent every
    ``HOLDER_BEAT_S`` for a connected handle from its first ``get_meta`` on, the first
    before that ``get_meta``; the holders of one process beat in one message
    (:mod:`transferqueue.client.beats`)."""

    kind = "alive"
    holder: HolderId
    holders: Annotated[list[HolderId], Meta(max_length=MAX_HOLDERS_PER_BEAT)] = []


class HolderGone(ControllerRequest[int]):
    """Holders that will never acknowledge their leases: ``holder`` (a handle closing), or
    every holder named ``name`` except ``keep`` (a restarted stage host announcing that it
    replaces the earlier ones of its name). Their leases' rows go back to their tasks'
    queues now; the reply is how many rows went back."""

    kind = "holder_gone"
    holder: HolderId | None = None
    name: HolderName | None = None
    keep: HolderId | None = None


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
    (see :mod:`transferqueue.controller.status`). ``meta``: the reply also carries the rows
    as a ``BatchMeta`` without a lease (to read them whatever their state)."""

    kind = "status"
    partition: Name
    fields: Names | None = None
    task: Name | None = None
    meta: bool = False


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
    ``after``, with their group ids (see :mod:`transferqueue.controller.retire`)."""

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
    rows' groups, ``nbytes`` the payload of all keys (see :mod:`transferqueue.controller.keys`)."""

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


class Claim(ControllerRequest[BatchMeta]):
    """Bind ``name`` in ``partition`` to the rows ``indexes`` unless it is bound already;
    replies with the rows it is bound to (an empty batch: unbound, looked up without
    ``indexes``). See :mod:`transferqueue.controller.claims`."""

    kind = "claim"
    partition: Name
    name: Key
    indexes: Rows | None = None


class ExportState(ControllerRequest[StoreExport]):
    """A snapshot of partitions (all if None) at this instant, as plain data (see
    :mod:`transferqueue.controller.snapshot`); their rows' payload stays on the units for ``hold_s``
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


# -- storage unit --------------------------------------------------------------------------------
class Write(UnitRequest[None]):
    """Store columns of rows. ``create``: new rows (under the controller's ``grant``).
    ``shm``: buffers lie in the writer's arena; ``keep``: in its write arena ``keep``."""

    kind = "write"
    indexes: Rows
    columns: ColumnMap
    specs: Specs
    create: bool = False
    grant: Grant | None = None
    shm: bool = False
    keep: ArenaName | None = None


class Read(UnitRequest[dict[str, Any]]):
    """Gather ``fields`` of rows, in order: one buffer per field. ``shm``: into the reader's
    arena; ``mine``: its write arenas, where rows it wrote may be named instead of copied."""

    kind = "read"
    indexes: Rows
    fields: Names
    shm: ArenaName | None = None
    mine: Annotated[list[ArenaName], Meta(max_length=MAX_NAMES)] = []


class Free(UnitRequest[None]):
    """Drop rows (the controller, once consumed; a writer, under its grant, after a failed
    put)."""

    kind = "free"
    indexes: Rows
    grant: Grant | None = None


class UnitPing(UnitRequest[str]):
    """Are you alive? The answer is the unit's incarnation (see :class:`Ping`)."""

    kind = "ping"


class ClearUnit(UnitRequest[None]):
    """Drop every row of the unit."""

    kind = "clear"
    needs = "admin"


class UnitStats(UnitRequest[dict[str, Any]]):
    """Rows, bytes and fields the unit holds."""

    kind = "stats"


class UnitInventory(UnitRequest[np.ndarray]):
    """The indexes of every row the unit holds (a restarted controller reconciles them)."""

    kind = "inventory"
    needs = "admin"


class ResetUnit(UnitRequest[None]):
    """Forget every row and field of the unit."""

    kind = "reset"
    needs = "admin"


class ShmAttach(UnitRequest[int]):
    """Map the client's shared-memory arena ``name`` (``keep``: a write arena); its size."""

    kind = "shm_attach"
    name: ArenaName
    keep: bool = False
    pid: Annotated[int, Meta(ge=0, le=2**31)] | None = None
    """The client's process id: the unit drops the client's arenas once it is gone."""


class ShmDetach(UnitRequest[None]):
    """Drop the mapping of arena ``name``."""

    kind = "shm_detach"
    name: ArenaName


class CopyRows(UnitRequest[int]):
    """Write a copy of rows ``indexes`` (their ``fields``, of ``specs``) to unit ``target``
    at ``address``, creating them there under the controller's ``grant`` for that unit,
    within ``timeout_s``; the answer is the rows copied (the controller re-replicating rows
    left with one copy, see :mod:`transferqueue.controller.recopy`; the service's own key)."""

    kind = "copy_rows"
    needs = "service"
    indexes: Rows
    fields: Names
    specs: Specs
    target: Annotated[int, Meta(ge=0, le=4095)]
    address: Annotated[str, Meta(min_length=1, max_length=1024)]
    grant: Grant
    timeout_s: WaitS = 30.0
