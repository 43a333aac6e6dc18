"""``ControllerService``: the asyncio shell around :class:`Controller`.

The controller core answers instantly and never waits. This shell, running on one event loop,
adds what needs time:

- ``get_meta`` blocks (as a coroutine: other requests keep being served) until a full batch
  is ready, the stream ends, or ``timeout_s`` passes;
- ``allocate`` waits for capacity (back-pressure) up to ``timeout_s``;
- a timer returns the rows of expired leases to their tasks;
- rows freed by the controller are dropped from the storage units through ``free_rows``.

Its async methods are the controller's whole RPC surface: the embedded client awaits them
directly, the ZeroMQ server dispatches messages to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np

from transferqueue.controller import Changes, Controller
from transferqueue.errors import CapacityError, ClosedError
from transferqueue.leases import TaskKey
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec

__all__ = ["ControllerService", "FreeRows"]

log = logging.getLogger(__name__)

FreeRows = Callable[[int, np.ndarray], Coroutine[Any, Any, None]]
"""Drops freed rows (indexes) from one storage unit (unit id)."""

_MAX_TIMER_SLEEP_S = 0.5


class ControllerService:
    """Blocking get_meta, lease expiry and capacity waits on top of a Controller."""

    def __init__(self, controller: Controller, free_rows: FreeRows) -> None:
        self.controller = controller
        self._free_rows = free_rows
        self._waiters: dict[TaskKey, set[asyncio.Future[None]]] = {}
        self._space_waiters: set[asyncio.Future[None]] = set()
        self._timer: asyncio.Task[None] | None = None
        self._poke = asyncio.Event()
        self._wake_at = 0.0  # loop time the lease timer wakes at next (unless poked)
        self._pending_frees: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Start the lease timer on the running loop."""
        if self._timer is None:
            self._timer = asyncio.get_running_loop().create_task(self._expire_loop())

    async def close(self) -> None:
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

    # -- plumbing ----------------------------------------------------------------------------
    def _apply(self, changes: Changes) -> list[asyncio.Task[None]]:
        for key in changes.woken:
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)
        if changes.space:
            for fut in self._space_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._space_waiters.clear()
        tasks = []
        if changes.freed:
            indexes = np.concatenate(changes.freed)
            units = np.concatenate(changes.freed_units)
            loop = asyncio.get_running_loop()
            for u in np.unique(units).tolist():
                task = loop.create_task(self._free_rows(int(u), indexes[units == u]))
                self._pending_frees.add(task)
                task.add_done_callback(self._free_done)
                tasks.append(task)
        return tasks

    def _free_done(self, task: asyncio.Task[None]) -> None:
        """A unit failed to free rows: their memory stays held there until a clear or reset;
        say so (the controller has already forgotten the rows, so nothing is lost)."""
        self._pending_frees.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("a storage unit failed to free rows (its memory stays held): %r", exc)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply(self.controller.expire())
            deadline = self.controller.next_deadline()
            wait = _MAX_TIMER_SLEEP_S if deadline is None else deadline - loop.time()
            wait = max(0.0, min(wait, _MAX_TIMER_SLEEP_S))
            self._poke.clear()
            self._wake_at = loop.time() + wait
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), wait)

    def _leased(self, lease_s: Any) -> None:
        """A lease was handed out: wake the timer if it ends before the timer wakes anyway
        (most leases outlast the timer's longest sleep: no wake-up per batch)."""
        if not isinstance(lease_s, int | float) or (
            asyncio.get_running_loop().time() + lease_s < self._wake_at
        ):
            self._poke.set()

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        return deadline - asyncio.get_running_loop().time()

    # -- RPC surface -------------------------------------------------------------------------
    def call_now(self, kind: str, args: dict[str, Any]) -> tuple[bool, Any]:
        """Answer a request without waiting, if it can be: ``(True, result)``; else
        ``(False, None)`` and the caller awaits the method of that name.

        Most requests never wait (acks, commits, a get_meta whose batch is ready); a server
        answers them inline, without creating a task per request.
        """
        ctl = self.controller
        if kind == "register_fields":
            return True, ctl.register_fields(**args)
        if kind == "get_specs":
            return True, ctl.specs
        if kind == "stats":
            return True, ctl.stats()
        if kind in ("commit", "ack", "release", "finish"):
            self._apply(getattr(ctl, kind)(**args))
            return True, None
        if kind in ("renew", "declare_tasks"):
            getattr(ctl, kind)(**args)
            if kind == "renew":
                self._poke.set()
            return True, None
        if kind == "allocate":
            n = args.get("n")
            if isinstance(n, int) and ctl.can_allocate(n):
                extra = {k: v for k, v in args.items() if k != "timeout_s"}
                return True, ctl.allocate(**extra)
            return False, None
        if kind == "get_meta":
            timeout = args.get("timeout_s")
            if timeout is not None and timeout <= 0:
                return False, None  # the short batch at a timeout is the async path's job
            self._apply(ctl.expire())
            poll_args = {k: v for k, v in args.items() if k not in ("timeout_s", "partial")}
            meta, changes = ctl.poll(**poll_args, short_ok=False)
            self._apply(changes)
            if meta is not None and meta.lease_id is not None:
                self._leased(args.get("lease_s", 60.0))
            return meta is not None, meta
        return False, None

    async def register_fields(self, specs: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
        return self.controller.register_fields(specs)

    async def get_specs(self) -> dict[str, FieldSpec]:
        return self.controller.specs

    async def allocate(
        self,
        n: int,
        partition: str,
        *,
        groups: np.ndarray | int | None = None,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        timeout_s: float | None = None,
        nbytes: int | None = None,
        producer: str | None = None,
    ) -> BatchMeta:
        ctl = self.controller
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not ctl.can_allocate(n) and (ctl.capacity_rows is None or n <= ctl.capacity_rows):
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise CapacityError(
                    f"no room for {n} rows within timeout_s={timeout_s}: TransferQueue holds "
                    f"{ctl.stats()['rows_live']} of capacity_rows={ctl.capacity_rows}. "
                    "Consumers must acknowledge rows (of declared tasks) or clear partitions"
                )
            fut = loop.create_future()
            self._space_waiters.add(fut)
            try:
                await asyncio.wait({fut}, timeout=remaining)
            finally:
                self._space_waiters.discard(fut)
        return ctl.allocate(
            n,
            partition,
            groups=groups,
            versions=versions,
            lengths=lengths,
            nbytes=nbytes,
            producer=producer,
        )

    async def discard(self, indexes: np.ndarray) -> None:
        await _gather(self._apply(self.controller.discard(indexes)))

    async def commit(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        *,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        lease_id: int | None = None,
    ) -> None:
        self._apply(
            self.controller.commit(
                indexes, fields, versions=versions, lengths=lengths, lease_id=lease_id
            )
        )

    async def get_meta(
        self,
        *,
        task: str,
        partition: str,
        fields: Sequence[str] | None,
        batch_size: int,
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        sampler_options: Mapping[str, Any] | None = None,
        min_version: int | None = None,
        max_group: int | None = None,
        partial: bool = True,
    ) -> BatchMeta:
        """Wait for a batch (see AsyncClient.get_meta). ``partial=False``: at the timeout,
        return an empty batch instead of a short one (a client waiting in slices)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + max(0.0, timeout_s)
        self._apply(self.controller.expire())
        while True:
            ctl = self.controller  # re-read: a reset replaces it
            key: TaskKey = (ctl.partition(partition).id, task)
            remaining = self._remaining(deadline)
            timed_out = remaining is not None and remaining <= 0
            if timed_out and not partial:
                return BatchMeta.empty(partition, task=task, reason="timeout")
            meta, changes = ctl.poll(
                task=task,
                partition=partition,
                fields=fields,
                batch_size=batch_size,
                lease_s=lease_s,
                sampler=sampler,
                sampler_options=sampler_options,
                min_version=min_version,
                max_group=max_group,
                short_ok=timed_out,
            )
            self._apply(changes)
            if meta is not None:
                if meta.lease_id is not None:
                    self._leased(lease_s)
                return meta
            fut = loop.create_future()
            self._waiters.setdefault(key, set()).add(fut)
            try:
                await asyncio.wait({fut}, timeout=remaining)
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)

    async def ack(self, lease_id: int, indexes: np.ndarray | None = None) -> None:
        self._apply(self.controller.ack(lease_id, indexes))

    async def release(self, lease_id: int, indexes: np.ndarray | None = None) -> None:
        self._apply(self.controller.release(lease_id, indexes))

    async def renew(self, lease_id: int, lease_s: float, indexes: np.ndarray | None = None) -> None:
        self.controller.renew(lease_id, lease_s, indexes)
        self._poke.set()

    async def declare_tasks(self, partition: str, tasks: Sequence[str]) -> None:
        self.controller.declare_tasks(partition, tasks)

    async def finish(self, partition: str) -> None:
        self._apply(self.controller.finish(partition))

    async def clear(self, partition: str | None = None) -> None:
        await _gather(self._apply(self.controller.clear(partition)))

    async def stats(self) -> dict[str, Any]:
        # Frees already decided are awaited first, so that a caller that reads the units'
        # stats after these sees their payload dropped (not a free still on the wire).
        if self._pending_frees:
            await asyncio.gather(*self._pending_frees, return_exceptions=True)
        return self.controller.stats()

    async def reset(self) -> None:
        """Forget everything: rows, tasks, leases and field specs (a fresh TransferQueue).

        Callers blocked in ``get_meta`` or waiting for capacity get :class:`ClosedError`;
        payload is dropped from the storage units by the deployment.
        """
        old = self.controller
        self.controller = Controller(
            old.num_units,
            capacity_rows=old.capacity_rows,
            clock=old.clock,
            spread_bytes=old.spread_bytes,
        )
        gone = ClosedError("TransferQueue was reset while this call waited")
        for fut in [f for ws in self._waiters.values() for f in ws] + list(self._space_waiters):
            if not fut.done():
                fut.set_exception(gone)
        self._waiters.clear()
        self._space_waiters.clear()


async def _gather(tasks: list[asyncio.Task[None]]) -> None:
    if tasks:
        await asyncio.gather(*tasks)
