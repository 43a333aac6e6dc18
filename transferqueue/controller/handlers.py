"""The controller's message handlers: one method per message kind, named after it.

Each method takes ``(message, caller)`` and returns the reply, or an awaitable of it when the
request must wait (:mod:`transferqueue.wire.messages` declares the kinds). They call the parts
of the service's core (:class:`~transferqueue.controller.core.Controller`) and hand what
changed to :meth:`ControllerService.apply`; the waits are the service's. The kinds are grouped
as the core's parts are::

    AdminHandlers     hello, ping, register_unit, stats, reset
    RowHandlers       register_fields, get_specs, lost, allocate, discard, commit
    QueueHandlers     get_meta, ack, release, renew, declare_tasks, finish, clear,
                      reset_consumption, alive, holder_gone
    StatusHandlers    status, set_custom_meta, get_custom_meta, lost_rows, retire_groups
    KeyHandlers       kv_rows, kv_delete, kv_list, claim
    SnapshotHandlers  export_state, hold_export, import_rows, import_tasks

:func:`handlers` gives all of them for :func:`~transferqueue.wire.protocol.handlers` (a server
puts itself first where it answers a kind itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np

from transferqueue.controller.core import Controller
from transferqueue.controller.leases import TaskKey
from transferqueue.controller.service import ControllerService
from transferqueue.errors import BadRequestError
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.codec import PROTOCOL_VERSION
from transferqueue.wire.protocol import Caller
from transferqueue.wire.replies import (
    KeyListing,
    KeyRows,
    LostRows,
    PartitionStatus,
    Retired,
    StoreExport,
)

__all__ = [
    "AdminHandlers",
    "KeyHandlers",
    "QueueHandlers",
    "RowHandlers",
    "SnapshotHandlers",
    "StatusHandlers",
    "handlers",
]

T = TypeVar("T")


def handlers(service: ControllerService) -> list[object]:
    """Every handler of the controller's message kinds, on ``service``."""
    groups = (
        AdminHandlers,
        RowHandlers,
        QueueHandlers,
        StatusHandlers,
        KeyHandlers,
        SnapshotHandlers,
    )
    return [group(service) for group in groups]


class _Handlers:
    def __init__(self, service: ControllerService) -> None:
        self.service = service

    @property
    def ctl(self) -> Controller:
        return self.service.controller  # (re-read at each call: a reset replaces it)


class AdminHandlers(_Handlers):
    """The service itself: who it is, its stats, a reset."""

    def hello(self, msg: m.Hello, caller: Caller) -> m.HelloReply:
        """(The ZeroMQ server answers with its units' addresses; in-process there are none.)"""
        return m.HelloReply(PROTOCOL_VERSION, [])

    def ping(self, msg: m.Ping, caller: Caller) -> str:
        return self.service.incarnation

    def register_unit(self, msg: m.RegisterUnit, caller: Caller) -> None:
        """(The ZeroMQ server takes it; in-process units never restart.)"""
        raise BadRequestError("register_unit: this controller has no storage unit servers")

    def stats(self, msg: m.Stats, caller: Caller) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        # Frees already decided are awaited first, so that a caller that reads the units'
        # stats after these sees their payload dropped (not a free still on the wire).
        if self.service.frees_pending():
            return self._stats_later()
        return self.service.stats()

    async def _stats_later(self) -> dict[str, Any]:
        await self.service.frees_sent()
        return self.service.stats()

    async def reset(self, msg: m.Reset, caller: Caller) -> None:
        """Forget everything (see :meth:`ControllerService.reset`)."""
        await self.service.reset()


class RowHandlers(_Handlers):
    """Fields, and the rows of puts: allocate, commit, discard."""

    def register_fields(self, msg: m.RegisterFields, caller: Caller) -> dict[str, FieldSpec]:
        return self.ctl.rows.register_fields(msg.specs, msg.partition)

    def get_specs(self, msg: m.GetSpecs, caller: Caller) -> dict[str, FieldSpec]:
        return dict(self.ctl.rows.specs_of(msg.partition))

    def lost(self, msg: m.Lost, caller: Caller) -> np.ndarray:
        return self.ctl.rows.lost(msg.indexes)

    def allocate(self, msg: m.Allocate, caller: Caller) -> BatchMeta | Awaitable[BatchMeta | None]:
        """New rows, at once when capacity allows; else wait for consumers to free some."""
        writes = self.ctl.writes
        writes.check_allocate(msg.n, msg.partition)
        self.service.not_loading(msg.partition)
        if writes.can_allocate(msg.n):
            return self._allocated(msg)

        def need(ctl: Controller) -> int:
            ctl.writes.check_allocate(msg.n, msg.partition)
            return msg.n

        return self.service.when_room(need, msg, lambda: self._allocated(msg))

    def _allocated(self, msg: m.Allocate) -> BatchMeta:
        meta = self.ctl.writes.allocate(
            msg.n,
            msg.partition,
            groups=msg.groups,
            versions=msg.versions,
            lengths=msg.lengths,
            nbytes=msg.nbytes,
            producer=msg.producer,
        )
        return self.service.granted(meta, meta)

    def discard(self, msg: m.Discard, caller: Caller) -> Awaitable[None] | None:
        return _after(self.service.apply(self.ctl.writes.discard(msg.indexes)))

    def commit(self, msg: m.Commit, caller: Caller) -> None:
        ctl = self.ctl
        if msg.specs:
            slots = ctl.rows.lookup(msg.indexes)
            pids = np.unique(ctl.rows.header["partition"][slots[slots >= 0]])
            for pid in pids.tolist():  # (rows not live: the commit itself says why)
                part = ctl.partitions.by_id(pid)
                if part is not None:
                    ctl.rows.confirm_fields(msg.specs, part.name)
        if msg.dropped:  # (two copies of each row: a unit the writer found gone)
            self.service.apply(ctl.copies.drop_copies(msg.indexes, msg.dropped))
        changes = ctl.writes.commit(
            msg.indexes,
            msg.fields,
            versions=msg.versions,
            lengths=msg.lengths,
            lease_id=msg.lease_id,
            owner=caller.identity,
            copies=msg.copies,
        )
        self.service.apply(changes)


class QueueHandlers(_Handlers):
    """Batches for consumer tasks and their leases; declaring, finishing, clearing."""

    def get_meta(self, msg: m.GetMeta, caller: Caller) -> BatchMeta | Awaitable[BatchMeta | None]:
        """A batch at once when one is due (most calls); else wait for one (see
        AsyncClient.get_meta). ``partial=False``: at the timeout, answer None instead of a
        short batch (a client waiting in slices)."""
        self.service.not_loading(msg.partition)
        if msg.holder is not None:
            self.service.holders.seen(msg.holder)
        if msg.timeout_s is None or msg.timeout_s > 0:
            self.service.apply(self.ctl.queues.expire())
            meta = self._poll(msg, caller, short_ok=False)
            if meta is not None:
                return meta
        return self._get_meta_later(msg, caller)

    def _poll(self, msg: m.GetMeta, caller: Caller, *, short_ok: bool) -> BatchMeta | None:
        meta, changes = self.ctl.queues.poll(
            task=msg.task,
            partition=msg.partition,
            fields=msg.fields,
            batch_size=msg.batch_size,
            lease_s=msg.lease_s,
            sampler=msg.sampler,
            sampler_options=msg.sampler_options,
            min_version=msg.min_version,
            max_group=msg.max_group,
            short_ok=short_ok,
            owner=caller.identity,
            holder=msg.holder,
            consume=msg.consume,  # (at most once: a full batch comes back acked, see GetMeta)
            request_id=msg.request_id,  # (a call sent again: the lease it took, if any)
        )
        self.service.apply(changes)
        if meta is not None and meta.lease_id is not None and not meta.acked:
            self.service.leased(msg.lease_s)
        return meta

    async def _get_meta_later(self, msg: m.GetMeta, caller: Caller) -> BatchMeta | None:
        service = self.service
        loop = asyncio.get_running_loop()
        deadline = None if msg.timeout_s is None else loop.time() + msg.timeout_s
        service.apply(self.ctl.queues.expire())
        while True:
            key: TaskKey = (self.ctl.partitions.partition(msg.partition).id, msg.task)
            remaining = service.remaining(deadline)
            timed_out = remaining is not None and remaining <= 0
            if timed_out and not msg.partial:
                return self._poll(msg, caller, short_ok=False)  # a due batch, else None
            meta = self._poll(msg, caller, short_ok=timed_out)
            if meta is not None:
                return meta
            await service.wait_for_task(key, remaining)

    def ack(self, msg: m.Ack, caller: Caller) -> None:
        self.service.apply(self.ctl.queues.ack(msg.lease_id, msg.indexes, caller.identity))

    def release(self, msg: m.Release, caller: Caller) -> None:
        changes = self.ctl.queues.release(msg.lease_id, msg.indexes, caller.identity)
        self.service.apply(changes)

    def renew(self, msg: m.Renew, caller: Caller) -> None:
        self.ctl.queues.renew(msg.lease_id, msg.lease_s, msg.indexes, caller.identity)
        self.service.poke()

    def alive(self, msg: m.Alive, caller: Caller) -> None:
        holders = self.service.holders
        holders.beat(msg.holder)
        for holder in msg.holders:
            holders.beat(holder)

    def holder_gone(self, msg: m.HolderGone, caller: Caller) -> int:
        """Return the leases of ``msg.holder``, or of every holder named ``msg.name`` but
        ``msg.keep`` (see :class:`~transferqueue.wire.messages.HolderGone`)."""
        if (msg.holder is None) == (msg.name is None):
            raise BadRequestError(
                "holder_gone names either holder (one handle) or name (every handle of that "
                f"name but keep), got holder={msg.holder!r}, name={msg.name!r}"
            )
        if msg.holder is not None:
            holders, why = [msg.holder], "closed"
        else:
            assert msg.name is not None
            holders = self.ctl.leases.holders()
            holders, why = self.service.holders.named(holders, msg.name, msg.keep), "replaced"
        if not holders:
            return 0
        return self.service.return_holders(holders, why, caller.identity)

    def declare_tasks(self, msg: m.DeclareTasks, caller: Caller) -> None:
        self.ctl.queues.declare_tasks(msg.partition, msg.tasks)

    def finish(self, msg: m.Finish, caller: Caller) -> None:
        self.service.apply(self.ctl.queues.finish(msg.partition))

    def clear(self, msg: m.Clear, caller: Caller) -> Awaitable[None] | None:
        ctl = self.ctl
        changes = ctl.queues.clear(msg.partition)
        ctl.snapshots.end_loading(msg.partition)  # (a load that failed half way)
        return _after(self.service.apply(changes))

    def reset_consumption(self, msg: m.ResetConsumption, caller: Caller) -> int:
        rows, changes = self.ctl.queues.reset_consumption(msg.partition, msg.task)
        self.service.apply(changes)
        return rows


class StatusHandlers(_Handlers):
    """What rows hold and tasks made of them, custom metadata, loss logs, retiring."""

    def status(self, msg: m.Status, caller: Caller) -> PartitionStatus:
        return self.ctl.status.status(msg.partition, msg.fields, msg.task, msg.meta)

    def set_custom_meta(self, msg: m.SetCustomMeta, caller: Caller) -> None:
        self.ctl.status.set_custom_meta(msg.indexes, msg.metas)

    def get_custom_meta(self, msg: m.GetCustomMeta, caller: Caller) -> list[bytes]:
        return self.ctl.status.get_custom_meta(msg.indexes)

    def lost_rows(self, msg: m.GetLostRows, caller: Caller) -> LostRows:
        return self.ctl.retirement.lost_rows(msg.partition, msg.task, msg.after, msg.limit)

    def retire_groups(self, msg: m.RetireGroups, caller: Caller) -> Retired | Awaitable[Retired]:
        """Retire the groups; replies once their payload is freed on the units."""
        retired, changes = self.ctl.retirement.retire_groups(
            msg.partition, msg.groups, msg.unless_leased_by
        )
        frees = self.service.apply(changes)
        return _then(frees, retired) if frees else retired


class KeyHandlers(_Handlers):
    """The key-value calls (see :mod:`transferqueue.controller.keys`)."""

    def kv_rows(self, msg: m.KvRows, caller: Caller) -> KeyRows | Awaitable[KeyRows | None]:
        """The rows of keys; with ``create``, new rows for new keys once there is room."""
        ctl = self.ctl
        if not msg.create:
            return ctl.keys.key_rows(msg.partition, msg.keys, fields=msg.fields)
        if ctl.writes.can_allocate(ctl.keys.new_keys(msg.partition, msg.keys)):
            return self._key_rows(msg)
        return self.service.when_room(
            lambda c: c.keys.new_keys(msg.partition, msg.keys), msg, lambda: self._key_rows(msg)
        )

    def _key_rows(self, msg: m.KvRows) -> KeyRows:
        got = self.ctl.keys.key_rows(
            msg.partition,
            msg.keys,
            create=True,
            groups=msg.groups,
            nbytes=msg.nbytes,
            producer=msg.producer,
        )
        self.service.granted(got.meta, got.meta.select(got.created))
        return got

    def kv_delete(self, msg: m.KvDelete, caller: Caller) -> Awaitable[None] | None:
        # (the reply waits for the units' frees: stats read after it see the memory freed)
        return _after(self.service.apply(self.ctl.keys.delete_keys(msg.partition, msg.keys)))

    def kv_list(self, msg: m.KvList, caller: Caller) -> KeyListing:
        return self.ctl.keys.list_keys(msg.partition, msg.fields, msg.all_fields)

    def claim(self, msg: m.Claim, caller: Caller) -> BatchMeta:
        """A name bound once to rows (see :mod:`transferqueue.controller.claims`)."""
        return self.ctl.claims.claim(msg.partition, msg.name, msg.indexes)


class SnapshotHandlers(_Handlers):
    """Store checkpoints (see :mod:`transferqueue.client.checkpoint`)."""

    def export_state(self, msg: m.ExportState, caller: Caller) -> StoreExport:
        """Every asked partition at this one instant; their rows held on the units."""
        ctl = self.ctl
        names = ctl.partitions.names() if msg.partitions is None else msg.partitions
        parts = [ctl.snapshots.export_partition(name) for name in dict.fromkeys(names)]
        rows = [p.indexes for p in parts]
        indexes = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        hold = self.service.holds.open(indexes, msg.hold_s) if indexes.size else 0
        specs = {p.name: dict(ctl.rows.specs_of(p.name)) for p in parts}
        return StoreExport(hold, specs, parts)

    def hold_export(self, msg: m.HoldExport, caller: Caller) -> Awaitable[None] | None:
        service = self.service
        return _after(service.send_frees(service.holds.renew(msg.snapshot_id, msg.hold_s)))

    def import_rows(self, msg: m.ImportRows, caller: Caller) -> BatchMeta:
        meta = self.ctl.snapshots.import_rows(
            msg.partition,
            msg.groups,
            msg.versions,
            msg.lengths,
            first=msg.first,
            keys=msg.keys,
            key_rows=msg.key_rows,
        )
        return self.service.granted(meta, meta)

    def import_tasks(self, msg: m.ImportTasks, caller: Caller) -> None:
        changes = self.ctl.snapshots.import_tasks(
            msg.partition, msg.tasks, msg.declared, msg.finished
        )
        self.service.apply(changes)


async def _then(tasks: list[asyncio.Future[None]], value: T) -> T:
    await asyncio.gather(*tasks)
    return value


def _after(tasks: list[asyncio.Future[None]]) -> Awaitable[None] | None:
    """An awaitable of ``tasks`` (frees sent to units), or None when there are none."""
    return _gather(tasks) if tasks else None


async def _gather(tasks: list[asyncio.Future[None]]) -> None:
    await asyncio.gather(*tasks)
