"""The coordinator actor: the run's shared state on Ray.

:class:`Coordinator` is the generator :class:`~asyncflow.registry.Registry` plus the inbox of
step reports and the object-store transport's newest weights. It runs as one async Ray actor
(``ray.remote`` is applied in ``asyncflow.deploy.ray``), because stage hosts on other nodes
must report to and wait on one shared state, and a Ray actor cannot call back into the
driver. The driver stays the single controller: it reads the coordinator (admission control,
step reports) and decides. Callers reach it through
:class:`~asyncflow.deploy.remote.RemoteRegistry`.

This module imports no engine, adapter or tensor library: the actor starts in a fraction of a
second and every other host's start-up waits on it, so it must not pay for torch. Step
reports pass through it as pickled bytes for the same reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncflow.registry import Registry
from transferqueue.aio import wait_event, within
from transferqueue.sched import batch_process

__all__ = ["Coordinator"]


class Coordinator(Registry):
    """The registry as an actor, with the step reports the trainer hands the driver."""

    def __init__(
        self,
        initial_version: int = 0,
        *,
        policy: str = "eager",
        first_group: int | None = None,
        batch_sched: bool = False,
    ) -> None:
        if batch_sched:  # (an actor's process: ``deploy.batch_sched``)
            batch_process()
        super().__init__(initial_version, policy=policy)
        self._reports: asyncio.Queue[bytes] = asyncio.Queue()
        self._last_step = -1  # the last step reported (a replaced rank 0 may report it again)
        # the train stage's position: (step, first group of its window; None: step * B)
        self._position: tuple[int, int | None] = (initial_version, first_group)
        self._weights: tuple[int, list[Any]] = (-1, [])
        self._weights_changed = asyncio.Event()

    async def put_weights(self, version: int, refs: list[Any]) -> None:
        """The object-store weight transport: the newest version's object refs (held here so
        they stay alive; the previous version's are dropped)."""
        if version > self._weights[0]:
            self._weights = (version, refs)
            self._weights_changed.set()

    async def weights_after(self, version: int, timeout_s: float) -> tuple[int, list[Any]]:
        """The newest weights' ``(version, refs)`` once newer than ``version`` (or the current
        ones after ``timeout_s``)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._weights[0] <= version:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            self._weights_changed.clear()
            await wait_event(self._weights_changed, left)
        return self._weights

    async def step_done(self, report: bytes, step: int = -1, next_group: int = -1) -> None:
        """The trainer finished step ``step`` (its weights are already published): its
        :class:`~adapters.StepReport`, pickled (:class:`~asyncflow.deploy.remote.RemoteRegistry`
        pickles and unpickles it), and the first group of the next step's window: where a
        replaced trainer rank 0 goes on (:meth:`train_position`; the step's rows are
        acknowledged only after this). A step reported already is dropped: a replaced rank 0
        reports again the step its predecessor died settling."""
        if step >= 0 and next_group >= 0:
            self._position = (step + 1, next_group)
        if 0 <= step <= self._last_step:
            return
        self._last_step = max(self._last_step, step)
        self._reports.put_nowait(report)

    async def stats(self) -> dict[str, object]:
        """The registry's counters, and ``train_position``: where a replaced trainer rank 0 goes
        on, the step after the last one reported and its window's first group (or the run's
        start)."""
        return {**await super().stats(), "train_position": self._position}

    async def next_report(
        self, timeout_s: float, syncs_after: int
    ) -> tuple[bytes | None, list[Any], int]:
        """The next finished step's pickled report (None after ``timeout_s``), with
        :meth:`weight_syncs` after ``syncs_after``: what the driver reads once per step, in
        one call."""
        try:
            report: bytes | None = await within(self._reports.get(), timeout_s)
        except TimeoutError:
            report = None
        syncs, count = await self.weight_syncs(syncs_after)
        return report, syncs, count

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        """Drop the weights held for the object-store transport."""
        self._weights = (self._weights[0], [])
