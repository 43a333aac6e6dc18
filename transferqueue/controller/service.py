"""``ControllerService``: the asyncio shell around :class:`Controller`.

The controller core answers instantly and never waits. This shell, running on one event loop,
adds what needs time:

- ``get_meta`` blocks (as a coroutine: other requests keep being served) until a full batch
  is ready, the stream ends, or ``timeout_s`` passes;
- ``allocate`` waits for capacity (back-pressure) up to ``timeout_s``;
- a timer returns the rows of expired leases to their tasks, and discards the rows of
  allocations no commit touched before their deadline (a producer that died mid-put);
- a storage unit that died (its server tells :meth:`lose_unit`) loses its rows at once;
- rows freed by the controller are dropped from the storage units through ``free_rows``;
- new rows get grants (:mod:`transferqueue.wire.grants`) for the units they are placed on.

Its handlers are the controller's message kinds (:mod:`transferqueue.wire.messages`): one method
per kind, named after it, taking ``(message, caller)`` and returning the reply, or an
awaitable of it when the request must wait. The embedded client calls them in-process
(:func:`~transferqueue.wire.messages.dispatch`), the ZeroMQ server dispatches decoded messages to
them; a server answers the non-awaitable ones inline, without a task per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from transferqueue.aio import wait_event
from transferqueue.controller.core import Changes, Controller
from transferqueue.controller.journaled import JournaledController, call_function
from transferqueue.controller.leases import TaskKey
from transferqueue.controller.snapshot import ExportHolds, check_not_loading, export_partition
from transferqueue.errors import BadRequestError, CapacityError, ClosedError
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.codec import PROTOCOL_VERSION
from transferqueue.wire.grants import Grants
from transferqueue.wire.liveness import new_incarnation
from transferqueue.wire.protocol import Caller
from transferqueue.wire.replies import (
    KeyListing,
    KeyRows,
    LostRows,
    PartitionStatus,
    Retired,
    StoreExport,
)

T = TypeVar("T")

__all__ = ["ControllerService", "FreeRows"]

log = logging.getLogger(__name__)

FreeRows = Callable[[int, np.ndarray], Awaitable[None]]
"""Drops freed rows (indexes) from one storage unit (unit id). A server sends the request
before returning (the awaitable is its reply), so that the free reaches the unit before any
write a client sends after the reply to the ack that freed the rows: the unit reuses them."""

_MAX_TIMER_SLEEP_S = 0.5


class ControllerService:
    """Blocking get_meta, lease expiry and capacity waits on top of a Controller."""

    def __init__(
        self, controller: Controller, free_rows: FreeRows, *, grants: Grants | None = None
    ) -> None:
        self.controller = controller
        self._free_rows = free_rows
        self._grants = grants  # None: units in this process, nothing to sign
        self._waiters: dict[TaskKey, set[asyncio.Future[None]]] = {}
        self._space_waiters: set[asyncio.Future[None]] = set()
        self._timer: asyncio.Future[None] | None = None
        self._poke = asyncio.Event()
        self._wake_at = 0.0  # loop time the lease timer wakes at next (unless poked)
        self._pending_frees: set[asyncio.Future[None]] = set()
        self.incarnation = new_incarnation()
        self._holds = ExportHolds(controller.clock)

    async def start(self) -> None:
        """Start the lease timer on the running loop."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
        """Stop the timer and waiters; a journaled controller writes a last snapshot."""
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
            self._timer = None
        for fut in [f for ws in self._waiters.values() for f in ws] + list(self._space_waiters):
            if not fut.done():
                fut.cancel()
        if self._pending_frees:
            await asyncio.gather(*self._pending_frees, return_exceptions=True)
        ctl = self.controller
        if isinstance(ctl, JournaledController) and ctl.journal is not None:
            ctl.journal.snapshot(ctl)  # (a clean stop: the next start replays nothing)
            ctl.journal.close()
            ctl.journal = None

    # -- plumbing ----------------------------------------------------------------------------
    def _apply(self, changes: Changes) -> list[asyncio.Future[None]]:
        for key in changes.woken:
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)
        if changes.space:
            for fut in self._space_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._space_waiters.clear()
        if not changes.freed:
            return []
        # (rows a save is reading stay on their units until its snapshot's hold ends)
        freed = self._holds.hold(np.concatenate(changes.freed), np.concatenate(changes.freed_units))
        return self._send_frees([freed])

    def _send_frees(self, freed: list[tuple[np.ndarray, np.ndarray]]) -> list[asyncio.Future[None]]:
        """Drop rows (indexes, units) from their units, one request per unit."""
        tasks: list[asyncio.Future[None]] = []
        loop = asyncio.get_running_loop()
        for indexes, units in freed:
            for u in np.unique(units).tolist():
                task = asyncio.ensure_future(
                    self._free_rows(int(u), indexes[units == u]), loop=loop
                )
                self._pending_frees.add(task)
                task.add_done_callback(self._free_done)
                tasks.append(task)
        return tasks

    def _free_done(self, task: asyncio.Future[None]) -> None:
        """A unit failed to free rows: their memory stays held there until a clear or reset;
        say so (the controller has already forgotten the rows, so nothing is lost)."""
        self._pending_frees.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a storage unit failed to free rows (its memory stays held): %r", exc)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply(self.controller.expire())
            self._apply(self.controller.reclaim())
            self._send_frees(self._holds.expire())
            if isinstance(self.controller, JournaledController):
                try:
                    self.controller.journal_tick()  # (fsync, snapshot when due: between calls)
                except Exception:  # (the timer goes on: leases must still expire)
                    log.exception("the controller's journal tick failed")
            deadline = self.controller.next_deadline()
            wait = _MAX_TIMER_SLEEP_S if deadline is None else deadline - loop.time()
            wait = max(0.0, min(wait, _MAX_TIMER_SLEEP_S))
            self._poke.clear()
            self._wake_at = loop.time() + wait
            await wait_event(self._poke, wait)

    def _leased(self, lease_s: float) -> None:
        """A lease was handed out: wake the timer if it ends before the timer wakes anyway
        (most leases outlast the timer's longest sleep: no wake-up per batch)."""
        if asyncio.get_running_loop().time() + lease_s < self._wake_at:
            self._poke.set()

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return deadline - asyncio.get_running_loop().time()

    # -- storage units that die and come back (told by the server that watches them) -------
    def lose_unit(self, unit: int) -> None:
        """Unit ``unit`` died: its rows are lost (see :mod:`transferqueue.controller.health`);
        waiters of the tasks that held them re-check (a drained task may now end)."""
        changes = self.controller.lose_unit(unit)
        log.warning(
            "storage unit %d is gone; rows lost so far: %d", unit, self.controller.rows_lost
        )
        self._apply(changes)

    def lose_rows(self, unit: int, indexes: np.ndarray) -> None:
        """Rows ``indexes`` are missing from unit ``unit`` (a restarted controller found
        them gone from its inventory): lost, as with :meth:`lose_unit`."""
        self._apply(self.controller.lose_rows(unit, indexes))

    def unit_back(self, unit: int) -> None:
        """Unit ``unit`` serves again (empty): new rows may be placed on it."""
        self.controller.unit_back(unit)
        log.warning("storage unit %d is back and takes new rows", unit)
        self._apply(Changes(space=True))

    # -- message handlers: (message, caller) -> reply, or an awaitable of it -----------------
    def hello(self, msg: m.Hello, caller: Caller) -> m.HelloReply:
        """(The ZeroMQ server answers with its units' addresses; in-process there are none.)"""
        return m.HelloReply(PROTOCOL_VERSION, [])

    def ping(self, msg: m.Ping, caller: Caller) -> str:
        return self.incarnation

    def register_unit(self, msg: m.RegisterUnit, caller: Caller) -> None:
        """(The ZeroMQ server takes it; in-process units never restart.)"""
        raise BadRequestError("register_unit: this controller has no storage unit servers")

    def lost(self, msg: m.Lost, caller: Caller) -> np.ndarray:
        return self.controller.lost(msg.indexes)

    def register_fields(self, msg: m.RegisterFields, caller: Caller) -> dict[str, FieldSpec]:
        return self.controller.register_fields(msg.specs)

    def get_specs(self, msg: m.GetSpecs, caller: Caller) -> dict[str, FieldSpec]:
        return self.controller.specs

    def allocate(self, msg: m.Allocate, caller: Caller) -> BatchMeta | Awaitable[BatchMeta | None]:
        """New rows, at once when capacity allows; else wait for consumers to free some."""
        self.controller.check_allocate(msg.n, msg.partition)
        self._not_loading(msg.partition)
        if self.controller.can_allocate(msg.n):
            return self._allocated(msg)

        def need(ctl: Controller) -> int:
            ctl.check_allocate(msg.n, msg.partition)
            return msg.n

        return self._when_room(need, msg, lambda: self._allocated(msg))

    def _allocated(self, msg: m.Allocate) -> BatchMeta:
        meta = self.controller.allocate(
            msg.n,
            msg.partition,
            groups=msg.groups,
            versions=msg.versions,
            lengths=msg.lengths,
            nbytes=msg.nbytes,
            producer=msg.producer,
        )
        return self._granted(meta, meta)

    def _granted(self, meta: BatchMeta, new: BatchMeta) -> BatchMeta:
        """``meta`` with grants to create the rows of ``new`` (new rows among meta's)."""
        if self._grants is not None and len(new):
            # (a put's rows on one unit are one contiguous run of indexes; with a second copy
            # of each row, a unit's first and second copies may be two runs: the grant spans
            # both, rows of this one allocation either way)
            meta.grants = {}
            units, copies = new.units, new.replica_units
            for u in np.unique(units if copies is None else np.r_[units, copies]).tolist():
                if u < 0:
                    continue
                on = units == u if copies is None else (units == u) | (copies == u)
                rows = new.indexes[on]
                meta.grants[u] = self._grants.sign(u, int(rows[0]), int(rows[-1]) + 1)
        return meta

    def _not_loading(self, partition: str) -> None:
        check_not_loading(self.controller, partition)

    async def _when_room(
        self,
        need: Callable[[Controller], int],
        msg: m.Allocate | m.KvRows,
        make: Callable[[], T],
    ) -> T | None:
        """``make()`` once the controller has room for ``need(controller)`` more rows (which
        also raises what no wait cures); waits up to ``msg.timeout_s`` for consumers to free
        rows, then raises CapacityError (or, a slice of a longer wait, answers None)."""
        loop = asyncio.get_running_loop()
        deadline = None if msg.timeout_s is None else loop.time() + msg.timeout_s
        while True:
            ctl = self.controller  # re-read: a reset replaces it
            n = need(ctl)
            if ctl.can_allocate(n):
                return make()
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                if not msg.partial:
                    return None  # a slice of a longer wait ran out (see messages.Request)
                raise CapacityError(
                    f"no room for {n} rows within timeout_s={msg.timeout_s}: TransferQueue "
                    f"holds {ctl.stats()['rows_live']} of capacity_rows={ctl.capacity_rows}. "
                    "Consumers must acknowledge rows (of declared tasks) or clear partitions"
                )
            fut = loop.create_future()
            self._space_waiters.add(fut)
            try:
                await asyncio.wait({fut}, timeout=remaining)
            finally:
                self._space_waiters.discard(fut)
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]  # (a reset: ClosedError)

    def discard(self, msg: m.Discard, caller: Caller) -> Awaitable[None] | None:
        return _after(self._apply(self.controller.discard(msg.indexes)))

    def commit(self, msg: m.Commit, caller: Caller) -> None:
        if msg.dropped:  # (two copies of each row: a unit the writer found gone)
            self._apply(self.controller.drop_copies(msg.indexes, msg.dropped))
        self._apply(
            self.controller.commit(
                msg.indexes,
                msg.fields,
                versions=msg.versions,
                lengths=msg.lengths,
                lease_id=msg.lease_id,
                owner=caller.identity,
                copies=msg.copies,
            )
        )

    def get_meta(self, msg: m.GetMeta, caller: Caller) -> BatchMeta | Awaitable[BatchMeta | None]:
        """A batch at once when one is due (most calls); else wait for one (see
        AsyncClient.get_meta). ``partial=False``: at the timeout, answer None instead of a
        short batch (a client waiting in slices)."""
        self._not_loading(msg.partition)
        if msg.timeout_s is None or msg.timeout_s > 0:
            self._apply(self.controller.expire())
            meta = self._poll(msg, caller, short_ok=False)
            if meta is not None:
                return meta
        return self._get_meta_later(msg, caller)

    def _poll(self, msg: m.GetMeta, caller: Caller, *, short_ok: bool) -> BatchMeta | None:
        meta, changes = self.controller.poll(
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
        )
        self._apply(changes)
        if meta is not None and meta.lease_id is not None:
            self._leased(msg.lease_s)
        return meta

    async def _get_meta_later(self, msg: m.GetMeta, caller: Caller) -> BatchMeta | None:
        loop = asyncio.get_running_loop()
        deadline = None if msg.timeout_s is None else loop.time() + msg.timeout_s
        self._apply(self.controller.expire())
        while True:
            key: TaskKey = (self.controller.partition(msg.partition).id, msg.task)
            remaining = self._remaining(deadline)
            timed_out = remaining is not None and remaining <= 0
            if timed_out and not msg.partial:
                return self._poll(msg, caller, short_ok=False)  # a due batch, else None
            meta = self._poll(msg, caller, short_ok=timed_out)
            if meta is not None:
                return meta
            fut = loop.create_future()
            self._waiters.setdefault(key, set()).add(fut)
            try:
                await asyncio.wait({fut}, timeout=remaining)
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]  # (a reset: ClosedError)

    def ack(self, msg: m.Ack, caller: Caller) -> None:
        self._apply(self.controller.ack(msg.lease_id, msg.indexes, caller.identity))

    def release(self, msg: m.Release, caller: Caller) -> None:
        self._apply(self.controller.release(msg.lease_id, msg.indexes, caller.identity))

    def renew(self, msg: m.Renew, caller: Caller) -> None:
        self.controller.renew(msg.lease_id, msg.lease_s, msg.indexes, caller.identity)
        self._poke.set()

    def declare_tasks(self, msg: m.DeclareTasks, caller: Caller) -> None:
        self.controller.declare_tasks(msg.partition, msg.tasks)

    def finish(self, msg: m.Finish, caller: Caller) -> None:
        self._apply(self.controller.finish(msg.partition))

    def clear(self, msg: m.Clear, caller: Caller) -> Awaitable[None] | None:
        changes = self.controller.clear(msg.partition)
        call_function(
            self.controller, "end_loading", msg.partition
        )  # (a load that failed half way)
        return _after(self._apply(changes))

    def stats(self, msg: m.Stats, caller: Caller) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        # Frees already decided are awaited first, so that a caller that reads the units'
        # stats after these sees their payload dropped (not a free still on the wire).
        if self._pending_frees:
            return self._stats_later()
        return self.controller.stats()

    async def _stats_later(self) -> dict[str, Any]:
        await asyncio.gather(*self._pending_frees, return_exceptions=True)
        return self.controller.stats()

    def status(self, msg: m.Status, caller: Caller) -> PartitionStatus:
        return self.controller.status(msg.partition, msg.fields, msg.task)

    def lost_rows(self, msg: m.GetLostRows, caller: Caller) -> LostRows:
        return self.controller.lost_rows(msg.partition, msg.task, msg.after, msg.limit)

    def retire_groups(self, msg: m.RetireGroups, caller: Caller) -> Retired | Awaitable[Retired]:
        """Retire the groups; replies once their payload is freed on the units."""
        retired, changes = self.controller.retire_groups(
            msg.partition, msg.groups, msg.unless_leased_by
        )
        frees = self._apply(changes)
        return _then(frees, retired) if frees else retired

    def reset_consumption(self, msg: m.ResetConsumption, caller: Caller) -> int:
        rows, changes = self.controller.reset_consumption(msg.partition, msg.task)
        self._apply(changes)
        return rows

    def set_custom_meta(self, msg: m.SetCustomMeta, caller: Caller) -> None:
        self.controller.set_custom_meta(msg.indexes, msg.metas)

    def get_custom_meta(self, msg: m.GetCustomMeta, caller: Caller) -> list[bytes]:
        return self.controller.get_custom_meta(msg.indexes)

    # -- keys (see transferqueue.controller.keys)
    # -------------------------------------------------------
    def kv_rows(self, msg: m.KvRows, caller: Caller) -> KeyRows | Awaitable[KeyRows | None]:
        """The rows of keys; with ``create``, new rows for new keys once there is room."""
        if not msg.create:
            return self.controller.key_rows(msg.partition, msg.keys, fields=msg.fields)
        if self.controller.can_allocate(self.controller.new_keys(msg.partition, msg.keys)):
            return self._key_rows(msg)
        return self._when_room(
            lambda ctl: ctl.new_keys(msg.partition, msg.keys), msg, lambda: self._key_rows(msg)
        )

    def _key_rows(self, msg: m.KvRows) -> KeyRows:
        got = self.controller.key_rows(
            msg.partition,
            msg.keys,
            create=True,
            groups=msg.groups,
            nbytes=msg.nbytes,
            producer=msg.producer,
        )
        self._granted(got.meta, got.meta.select(got.created))
        return got

    def kv_delete(self, msg: m.KvDelete, caller: Caller) -> Awaitable[None] | None:
        # (the reply waits for the units' frees: stats read after it see the memory freed)
        return _after(self._apply(self.controller.delete_keys(msg.partition, msg.keys)))

    def kv_list(self, msg: m.KvList, caller: Caller) -> KeyListing:
        return self.controller.list_keys(msg.partition, msg.fields, msg.all_fields)

    # -- snapshots (store checkpoints, see transferqueue.client.checkpoint)
    # -------------------------
    def export_state(self, msg: m.ExportState, caller: Caller) -> StoreExport:
        """Every asked partition at this one instant; their rows held on the units."""
        ctl = self.controller
        names = list(ctl._partitions) if msg.partitions is None else msg.partitions
        parts = [export_partition(ctl, name) for name in dict.fromkeys(names)]
        rows = [p.indexes for p in parts]
        indexes = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
        hold = self._holds.open(indexes, msg.hold_s) if indexes.size else 0
        return StoreExport(hold, ctl.specs, parts)

    def hold_export(self, msg: m.HoldExport, caller: Caller) -> Awaitable[None] | None:
        return _after(self._send_frees(self._holds.renew(msg.snapshot_id, msg.hold_s)))

    def import_rows(self, msg: m.ImportRows, caller: Caller) -> BatchMeta:
        meta = call_function(
            self.controller,
            "import_rows",
            msg.partition,
            msg.groups,
            msg.versions,
            msg.lengths,
            first=msg.first,
            keys=msg.keys,
            key_rows=msg.key_rows,
        )
        return self._granted(meta, meta)

    def import_tasks(self, msg: m.ImportTasks, caller: Caller) -> None:
        changes = call_function(
            self.controller, "import_tasks", msg.partition, msg.tasks, msg.declared, msg.finished
        )
        self._apply(changes)

    async def reset(self, msg: m.Reset, caller: Caller) -> None:
        """Forget everything: rows, tasks, leases and field specs (a fresh TransferQueue).

        Callers blocked in ``get_meta`` or waiting for capacity get :class:`ClosedError`;
        payload is dropped from the storage units by the deployment.
        """
        old = self.controller
        self.controller = type(old)(
            old.num_units,
            capacity_rows=old.capacity_rows,
            clock=getattr(old.clock, "base", old.clock),
            spread_bytes=old.spread_bytes,
            max_lease_s=old.leases.max_lease_s,
            allocation_s=old.allocation_s,
            replicas=old.placement.replicas,
        )
        for unit in np.flatnonzero(~old.placement.alive).tolist():  # (still dead)
            self.controller.placement.set_alive(unit, False)
        for unit, host in enumerate(old.placement.hosts):
            self.controller.placement.set_host(unit, host)
        if isinstance(old, JournaledController) and isinstance(
            self.controller, JournaledController
        ):
            # (the fresh core replaces the old one on disk too: its snapshot, an empty log)
            journal, old.journal = old.journal, None
            self.controller.journal = journal
            if journal is not None:
                journal.snapshot(self.controller)
        gone = ClosedError("TransferQueue was reset while this call waited")
        for fut in [f for ws in self._waiters.values() for f in ws] + list(self._space_waiters):
            if not fut.done():
                fut.set_exception(gone)
        self._waiters.clear()
        self._space_waiters.clear()


async def _then(tasks: list[asyncio.Future[None]], value: T) -> T:
    await asyncio.gather(*tasks)
    return value


def _after(tasks: list[asyncio.Future[None]]) -> Awaitable[None] | None:
    """An awaitable of ``tasks`` (frees sent to units), or None when there are none."""
    return _gather(tasks) if tasks else None


async def _gather(tasks: list[asyncio.Future[None]]) -> None:
    await asyncio.gather(*tasks)
