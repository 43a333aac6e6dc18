"""``ControllerService``: the asyncio shell around :class:`Controller`.

The controller core answers instantly and never waits. This shell, running on one event loop,
adds what needs time:

- ``get_meta`` blocks (as a coroutine: other requests keep being served) until a full batch
  is ready, the stream ends, or ``timeout_s`` passes;
- ``allocate`` waits for capacity (back-pressure) up to ``timeout_s``;
- a timer returns the rows of expired leases to their tasks, and discards the rows of
  allocations no commit touched before their deadline (a producer that died mid-put);
- the same timer returns the leases of holders gone silent (a client that died holding rows,
  :mod:`transferqueue.controller.holders`), and :meth:`return_holders` those of holders known
  gone (a handle closing, a restarted host replacing earlier ones), counted and logged;
- a storage unit that died (its server tells :meth:`lose_unit`) loses its rows at once;
- rows freed by the controller are dropped from the storage units through ``free_rows``;
- new rows get grants (:mod:`transferqueue.wire.grants`) for the units they are placed on.

The controller's message kinds (:mod:`transferqueue.wire.messages`) are answered by the
handler objects of :mod:`transferqueue.controller.handlers` (``handlers(service)``), which
call the core's parts and hand what changed to :meth:`ControllerService.apply`. The embedded
client calls them in-process (:func:`~transferqueue.wire.protocol.dispatch`), the ZeroMQ
server dispatches decoded messages to them; a server answers the non-awaitable ones inline,
without a task per request.
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
from transferqueue.controller.holders import HOLDER_DEAD_AFTER_S, HOLDER_GRACE_S, Holders
from transferqueue.controller.journaled import JournaledController
from transferqueue.controller.leases import TaskKey
from transferqueue.controller.snapshot import ExportHolds
from transferqueue.errors import CapacityError, ClosedError
from transferqueue.meta import BatchMeta
from transferqueue.wire import messages as m
from transferqueue.wire.grants import Grants
from transferqueue.wire.liveness import new_incarnation

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
        self,
        controller: Controller,
        free_rows: FreeRows,
        *,
        grants: Grants | None = None,
        holder_dead_after_s: float = HOLDER_DEAD_AFTER_S,
        holder_grace_s: float = HOLDER_GRACE_S,
    ) -> None:
        """``holder_dead_after_s``: silence after which a client holding leases is gone and
        its rows go back; ``holder_grace_s``: how long, after a restart, holders of restored
        leases have to beat again (see :mod:`transferqueue.controller.holders`)."""
        self.controller = controller
        self.holders = Holders(
            controller.clock, dead_after_s=holder_dead_after_s, grace_s=holder_grace_s
        )
        self._free_rows = free_rows
        self._grants = grants  # None: units in this process, nothing to sign
        self._waiters: dict[TaskKey, set[asyncio.Future[None]]] = {}
        self._space_waiters: set[asyncio.Future[None]] = set()
        self._timer: asyncio.Future[None] | None = None
        self._poke = asyncio.Event()
        self._wake_at = 0.0  # loop time the lease timer wakes at next (unless poked)
        self._pending_frees: set[asyncio.Future[None]] = set()
        self.incarnation = new_incarnation()
        self.holds = ExportHolds(controller.clock)

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
        await self.frees_sent()
        ctl = self.controller
        if isinstance(ctl, JournaledController) and ctl.journal is not None:
            ctl.journal.snapshot(ctl)  # (a clean stop: the next start replays nothing)
            ctl.journal.close()
            ctl.journal = None

    # -- plumbing ----------------------------------------------------------------------------
    def apply(self, changes: Changes) -> list[asyncio.Future[None]]:
        """Act on what a call of the core changed: wake the waiters of the tasks it names
        and of capacity, send the frees of rows freed (returned, as tasks)."""
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
        freed = self.holds.hold(np.concatenate(changes.freed), np.concatenate(changes.freed_units))
        return self.send_frees([freed])

    def send_frees(self, freed: list[tuple[np.ndarray, np.ndarray]]) -> list[asyncio.Future[None]]:
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

    def frees_pending(self) -> bool:
        """Whether frees decided are still on their way to units."""
        return bool(self._pending_frees)

    async def frees_sent(self) -> None:
        """Until every free decided so far has reached its unit (or failed)."""
        if self._pending_frees:
            await asyncio.gather(*self._pending_frees, return_exceptions=True)

    def _free_done(self, task: asyncio.Future[None]) -> None:
        """A unit failed to free rows: their memory stays held there until a clear or reset;
        say so (the controller has already forgotten the rows, so nothing is lost)."""
        self._pending_frees.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a storage unit failed to free rows (its memory stays held): %r", exc)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        looked = loop.time()
        while True:
            ctl = self.controller  # (re-read: a reset replaces it)
            now = loop.time()
            if now - looked > self.holders.dead_after_s / 2:  # (we, not they, were silent)
                self.holders.stalled(now - looked - _MAX_TIMER_SLEEP_S)
            looked = now
            self.apply(ctl.queues.expire())
            silent = self.holders.silent(ctl.leases.holders())
            if silent:
                self.return_holders(silent, "silent past holder_dead_after_s")
            self.apply(ctl.health.reclaim())
            self.send_frees(self.holds.expire())
            if isinstance(ctl, JournaledController):
                try:
                    ctl.journal_tick()  # (fsync, snapshot when due: between calls)
                except Exception:  # (the timer goes on: leases must still expire)
                    log.exception("the controller's journal tick failed")
            deadline = ctl.queues.next_deadline()
            wait = _MAX_TIMER_SLEEP_S if deadline is None else deadline - loop.time()
            wait = max(0.0, min(wait, _MAX_TIMER_SLEEP_S))
            self._poke.clear()
            self._wake_at = loop.time() + wait
            await wait_event(self._poke, wait)

    def return_holders(self, holders: list[str], why: str, owner: str | None = None) -> int:
        """The clients ``holders`` are gone (``why``): their leases' rows go back to their
        queues now (``Queues.return_holders``); logged, counted. Returns the rows returned."""
        leases = self.controller.leases
        before = (leases.returned, leases.rows_returned)
        self.apply(self.controller.queues.return_holders(holders, owner))
        for holder in holders:
            self.holders.gone(holder)
        n, rows = leases.returned - before[0], leases.rows_returned - before[1]
        if n == 0:
            return 0
        self.holders.holders_lost += len(holders)
        log.warning(
            "lease holder(s) %s gone (%s): %d lease(s), %d row(s) returned to their queues",
            ", ".join(holders),
            why,
            n,
            rows,
        )
        return rows

    def stats(self) -> dict[str, Any]:
        """The core's stats, and the holders': beating now, and gone with leases so far."""
        out = self.controller.stats()
        out["holders_beating"] = len(self.holders)
        out["holders_lost"] = self.holders.holders_lost
        out["holder_dead_after_s"] = self.holders.dead_after_s
        return out

    def leased(self, lease_s: float) -> None:
        """A lease was handed out: wake the timer if it ends before the timer wakes anyway
        (most leases outlast the timer's longest sleep: no wake-up per batch)."""
        if asyncio.get_running_loop().time() + lease_s < self._wake_at:
            self._poke.set()

    def poke(self) -> None:
        """Wake the timer now (a lease's deadline moved)."""
        self._poke.set()

    @staticmethod
    def remaining(deadline: float | None) -> float | None:
        """Seconds until ``deadline`` (loop time; None: no bound)."""
        if deadline is None:
            return None
        return deadline - asyncio.get_running_loop().time()

    # -- storage units that die and come back (told by the server that watches them) -------
    def lose_unit(self, unit: int) -> None:
        """Unit ``unit`` died: its rows are lost (see :mod:`transferqueue.controller.health`);
        waiters of the tasks that held them re-check (a drained task may now end)."""
        health = self.controller.health
        changes = health.lose_unit(unit)
        log.warning("storage unit %d is gone; rows lost so far: %d", unit, health.rows_lost)
        self.apply(changes)

    def lose_rows(self, unit: int, indexes: np.ndarray) -> None:
        """Rows ``indexes`` are missing from unit ``unit`` (a restarted controller found
        them gone from its inventory): lost, as with :meth:`lose_unit`."""
        self.apply(self.controller.health.lose_rows(unit, indexes))

    def unit_back(self, unit: int) -> None:
        """Unit ``unit`` serves again (empty): new rows may be placed on it."""
        self.controller.health.unit_back(unit)
        log.warning("storage unit %d is back and takes new rows", unit)
        self.apply(Changes(space=True))

    # -- what the handlers share (transferqueue.controller.handlers) -------------------------
    def granted(self, meta: BatchMeta, new: BatchMeta) -> BatchMeta:
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

    def not_loading(self, partition: str) -> None:
        """Raise when ``partition`` is being loaded from a save (nobody may use it yet)."""
        self.controller.snapshots.check_not_loading(partition)

    async def when_room(
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
            if ctl.writes.can_allocate(n):
                return make()
            remaining = self.remaining(deadline)
            if remaining is not None and remaining <= 0:
                if not msg.partial:
                    return None  # a slice of a longer wait ran out (see messages.Request)
                raise CapacityError(
                    f"no room for {n} rows within timeout_s={msg.timeout_s}: TransferQueue "
                    f"holds {ctl.rows.live} of capacity_rows={ctl.capacity_rows}. "
                    "Consumers must acknowledge rows (of declared tasks) or clear partitions"
                )
            await self._wait(self._space_waiters, remaining)

    async def wait_for_task(self, key: TaskKey, timeout_s: float | None) -> None:
        """Until something changed for task ``key`` (rows ready, its stream may end) or
        ``timeout_s`` passed; a reset meanwhile raises ClosedError."""
        await self._wait(self._waiters.setdefault(key, set()), timeout_s, key)

    async def _wait(
        self, waiters: set[asyncio.Future[None]], timeout_s: float | None, key: Any = None
    ) -> None:
        fut = asyncio.get_running_loop().create_future()
        waiters.add(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            if key is None:
                waiters.discard(fut)
            else:  # (woken waiters of a task were popped: re-read)
                left = self._waiters.get(key)
                if left is not None:
                    left.discard(fut)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]  # (a reset: ClosedError)

    async def reset(self) -> None:
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
