"""``Copier``: the controller server's background task that re-replicates rows.

With ``replicas=2``, rows left with one copy (a unit died; see
:mod:`transferqueue.controller.health`) get a second copy again: while ``rows_one_copy > 0`` and two
units are alive, the copier asks the core for a plan
(:meth:`~transferqueue.controller.rereplicate.Copies.plan_copies`: a bounded batch of rows on
one source unit), has it carried out (``send``: the controller's server sends the source unit a
:class:`~transferqueue.wire.messages.CopyRows`; the source reads the rows and writes them to the
target as a client's put would, under a grant the controller signed for the target), and records the
outcome (:meth:`~transferqueue.controller.rereplicate.Copies.copies_made`), whose frees (rows
refused on the target) go out before the next plan.

One copy at a time, each bounded (rows, bytes, ``timeout_s``), so that neither the units'
loops nor the controller's are held long. A copy that fails (a unit died or stalled) leaves
its rows with one copy, and the rows are planned again. Before it records the failure (which
frees the rows on the target) the copier waits until the grant the target's write was
signed with has expired, plus ``CLOCK_SLACK_S``, and at least its ``backoff`` (doubling up to
``MAX_BACKOFF_S``): a write still on its way to the target when the copy was given up is
then refused there (an expired grant creates no row) instead of landing after the free, and
nothing the controller does not know of stays on the target. The grant expires
``timeout_s`` after the copy starts, so a copy that timed out waits ``CLOCK_SLACK_S`` more;
one that failed at once, up to ``timeout_s``. The controller's and the units' wall clocks
must agree within ``CLOCK_SLACK_S`` (the same host, or NTP). The task never ends on an
error (it logs it); the server cancels it when it closes.

Measured (``python -m bench.failover``): see ``docs/transferqueue/reliability.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from transferqueue.aio import within
from transferqueue.controller.rereplicate import COPY_BYTES, COPY_ROWS, CopyPlan
from transferqueue.controller.service import ControllerService

__all__ = ["COPY_TIMEOUT_S", "Copier"]

log = logging.getLogger(__name__)

COPY_TIMEOUT_S = 10.0
"""How long one copy may take, source and target included (it is at most ``COPY_BYTES``:
0.1 s at 0.15 GB/s); its grant on the target expires then."""
CLOCK_SLACK_S = 1.0
"""How far the controller's and the units' wall clocks may disagree (grant expiry)."""
IDLE_S = 0.5
"""How often the copier looks for rows with one copy when it found none."""
MAX_BACKOFF_S = 10.0

Send = Callable[[CopyPlan, float], Awaitable[int]]
"""Carries out a plan by a wall-clock time (``time.time()``), when the grant of the
target's write expires; returns the rows copied."""


class Copier:
    """Re-replicates the rows of ``service``'s controller through ``send`` (see module)."""

    def __init__(
        self,
        service: ControllerService,
        send: Send,
        *,
        timeout_s: float = COPY_TIMEOUT_S,
        max_rows: int = COPY_ROWS,
        max_bytes: int = COPY_BYTES,
    ) -> None:
        self.service = service
        self._send = send
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.backoff_s = 0.0
        self.copies_failed = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.service.controller.placement.replicas > 1:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                busy = await self.step()
            except Exception:  # (the copier goes on whatever one step meets)
                log.exception("re-replication: a step failed")
                busy = False
            if not busy:
                await asyncio.sleep(IDLE_S)

    async def step(self) -> bool:
        """Make one copy if one is due; False when there was nothing to copy."""
        ctl = self.service.controller
        plan = ctl.copies.plan_copies(self.max_rows, self.max_bytes)
        if plan is None:
            return False
        ok = False
        expires = time.time() + self.timeout_s
        try:
            await within(self._send(plan, expires), self.timeout_s + 5.0)
            ok = True
            self.backoff_s = 0.0
        except Exception as e:
            self.copies_failed += 1
            self.backoff_s = min(max(self.backoff_s * 2, 0.5), MAX_BACKOFF_S)
            # (a write still on its way is refused once its grant expired: the free is last)
            wait_s = max(self.backoff_s, expires + CLOCK_SLACK_S - time.time())
            log.warning(
                "re-replication: copying %d rows from unit %d to unit %d failed (%r); "
                "again in %.1f s",
                plan.indexes.size,
                plan.source,
                plan.target,
                e,
                wait_s,
            )
            await asyncio.sleep(wait_s)
        if self.service.controller is not ctl:
            return True  # (a reset: the new core knows nothing of the plan; units cleared)
        changes = ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, ok)
        frees = self.service.apply(changes)
        if frees:  # (before a later copy may write the same rows to that unit again)
            await asyncio.gather(*frees, return_exceptions=True)
        return True
