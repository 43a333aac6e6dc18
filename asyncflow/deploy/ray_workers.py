"""The reward and reference workers of a ``deploy=ray`` run, and the reward workers' scaling
while it runs (``asyncflow scale DIR reward=M``).

| step | scale up (one new worker)               | scale down (the newest worker leaves)     |
|------|-----------------------------------------|-------------------------------------------|
| 1    | a reward worker actor, placed as at     | its stages take no new batch and finish   |
|      | start (``reward.placement``; outside a  | the ones they hold (at most               |
|      | placement group reserved at start)      | ``deploy.drain_grace_s``; past that they  |
|      |                                         | are cancelled), then its job ends quietly |
| 2    | its ``run``: a driver job as the others | it is stopped (not restarted) and the     |
|      | (restarted by Ray, counted, probed by   | leases it still holds go back to their    |
|      | the stall watch); it leases batches of  | task at once (its holder name is declared |
|      | the ``reward`` task beside the others   | replaced: ``HolderGone``), to be scored   |
|      |                                         | by the workers left                       |

Rows move through TransferQueue only: a worker leases a batch, scores it and writes the scores
onto the same rows, which acknowledges the lease. A batch written before the worker stopped is
done; one it still held comes back whole and is leased again, so each row is scored once.
Workers added are named on from the highest index (``reward/2``, ...; actor
``<run>-reward-2``), never reusing a name. ``reward.colocate=true`` has no reward workers (the
rollout host scores): nothing to scale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncflow.config import PlacementConfig, RunConfig
from asyncflow.control import ControlError
from asyncflow.deploy.ray_hosts import TQAccess
from asyncflow.metrics import Timeline
from asyncflow.supervisor import Job
from transferqueue.aio import within

__all__ = ["WORKER_ROLES", "WorkerScaler"]

log = logging.getLogger(__name__)

WORKER_ROLES = ("reward",)
"""The worker stages a running job scales (a reference worker's engine is a model: not yet)."""

Spawn = Callable[[str, Job], None]
MakeJob = Callable[..., Job]
"""The deployment's supervised job of a host: ``(name, call, restartable=, host=, instance=)``."""
GIVE_BACK_S = 30.0
"""At most this long to hand a stopped worker's leases back (else its silence returns them:
TransferQueue's ``holder_dead_after_s``)."""


class WorkerScaler:
    """A run's reward and reference worker hosts: started with the run (:meth:`start`), their
    jobs (:meth:`jobs`), and the reward workers added and removed one at a time while it runs.

    ``workers`` and ``actors`` are the deployment's own lists (its worker hosts by name, read by
    its probes, ``instances`` and ``collect``; every actor it stops at the end), changed here in
    place; ``make(role, index, actor_options)`` places a worker actor named
    ``<prefix>-<role>-<index>`` (options None: as ``<role>.placement`` says, outside any
    placement group); ``job`` is the deployment's supervised job of a host;
    ``retired`` the names of the instances that left the run (their job ends quietly when their
    actor is stopped), shared with the rollout's scaler.
    """

    def __init__(
        self,
        cfg: RunConfig,
        workers: list[tuple[str, Any]],
        actors: list[Any],
        make: Callable[[str, int, dict[str, Any] | None], Any],
        job: MakeJob,
        retired: set[str],
        tq: TQAccess,
        prefix: str,
        timeline: Timeline,
    ) -> None:
        self.cfg = cfg
        self._workers = workers
        self._actors = actors
        self._make = make
        self._job = job
        self.retired = retired
        self._tq = tq
        self._prefix = prefix
        self._timeline = timeline
        self._next: dict[str, int] = {}
        self._holders: dict[str, str] = {}  # worker name -> its holder (Ray actor) name
        self.spawn: Spawn | None = None
        """Starts a job while the run goes on (the driver's supervisor sets it)."""
        self._lock = asyncio.Lock()

    def roles(self) -> list[tuple[str, PlacementConfig, int]]:
        """The worker stages of this run: (role, placement, instances at start)."""
        cfg, out = self.cfg, []
        if not cfg.reward.colocate:  # (else the rollout host scores)
            out.append(("reward", cfg.reward.placement, cfg.reward.instances))
        if cfg.reference.enabled:
            out.append(("reference", cfg.reference.placement, cfg.reference.instances))
        return out

    def start(self, placed: Callable[[PlacementConfig, int], list[dict[str, Any]]]) -> None:
        """Place every worker of the run's start (``placed``: a stage's actor options, from a
        placement group reserved for it where its placement asks for one)."""
        for role, placement, n in self.roles():
            for i, opts in enumerate(placed(placement, n)):
                self._keep(f"{role}/{i}" if n > 1 else role, role, i, self._make(role, i, opts))
            self._next[role] = n

    def _keep(self, name: str, role: str, index: int, actor: Any) -> None:
        self._workers.append((name, actor))
        self._actors.append(actor)
        self._holders[name] = f"{self._prefix}-{role}-{index}"  # (its Ray actor name)

    def jobs(self) -> dict[str, Job]:
        """Every worker's job: its ``run``, restarted when Ray restarts it, ending quietly when
        it left the run."""
        return {name: self.job(name, w) for name, w in self._workers}

    def job(self, name: str, worker: Any) -> Job:
        return self._job(name, worker.run.remote, restartable=True, host=worker, instance=name)

    def count(self, role: str) -> int:
        return sum(1 for name, _ in self._workers if name.split("/")[0] == role)

    async def scale(self, stage: str, n: int) -> int:
        """``stage`` to ``n`` worker instances; the count before."""
        if stage not in WORKER_ROLES:
            raise ControlError(f"the {stage} stage's workers cannot be scaled")
        if stage == "reward" and self.cfg.reward.colocate:
            raise ControlError(
                "reward.colocate=true: the rollout host scores, there are no reward workers to "
                "scale; start the run with reward.colocate=false to scale reward"
            )
        async with self._lock:  # (one change at a time)
            was = self.count(stage)
            while self.count(stage) < n:
                await self._add(stage)
            while self.count(stage) > n:
                await self._remove(stage)
        if was != n:
            log.warning("%s scaled from %d to %d workers", stage, was, n)
        return was

    async def _add(self, role: str) -> None:
        if self.spawn is None:
            raise ControlError("the run is not running its stages yet; try again in a moment")
        import ray

        index = self._next[role]
        self._next[role] += 1
        name = f"{role}/{index}"
        worker = self._make(role, index, None)  # (placed as at start, outside any group)
        try:
            await within(worker.ping.remote(), self.cfg.deploy.start_timeout_s)
        except BaseException as e:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
            if isinstance(e, TimeoutError):
                raise ControlError(
                    f"the new {role} worker did not start within deploy.start_timeout_s="
                    f"{self.cfg.deploy.start_timeout_s}: the cluster may lack what "
                    f"{role}.placement asks for (available: {ray.available_resources()})"
                ) from None
            raise
        self._keep(name, role, index, worker)
        self.spawn(name, self.job(name, worker))

    async def _remove(self, role: str) -> None:
        """The newest worker of ``role`` drains, is stopped and hands back what it held."""
        import ray

        name, worker = [(n, w) for n, w in self._workers if n.split("/")[0] == role][-1]
        grace = self.cfg.deploy.drain_grace_s
        t0 = time.monotonic()
        drained, batches = False, -1
        try:  # (bounded: a worker frozen or restarting meanwhile does not hold it)
            drained, batches = await within(worker.retire.remote(grace), grace + 30.0)
        except Exception as e:  # stopped all the same: its leases go back below
            log.warning("%s worker %s did not confirm its drain (%r)", role, name, e)
        self.retired.add(name)
        self._workers.remove((name, worker))
        with contextlib.suppress(Exception):  # (its last busy intervals: the run's timeline)
            intervals, _ = await within(worker.drain.remote(), 10.0)
            self._timeline.merge(intervals)
        with contextlib.suppress(Exception):  # (not closed first: what it held is counted below)
            ray.kill(worker, no_restart=True)
        back = await self._give_back(self._holders.pop(name))
        log.warning(
            "%s worker %s %s and left in %.1f s (it scored %d batches; %d leased rows handed back)",
            role,
            name,
            "drained" if drained else f"did not drain within deploy.drain_grace_s={grace}",
            time.monotonic() - t0,
            batches,
            back,
        )

    async def _give_back(self, holder: str) -> int:
        """Return the leases a stopped worker still holds to their task now: a handle named
        as the worker declares every earlier holder of its name replaced (as a restarted host
        does), bounded by :data:`GIVE_BACK_S`; -1 where that failed (its silence returns
        them)."""
        import transferqueue

        tq = self._tq

        def give_back() -> int:
            handle = transferqueue.connect(
                tq.resolve(), keys=tq.keys, ride_through_s=tq.ride_through_s, holder=holder
            )
            try:
                return handle.replace_earlier_holders()
            finally:
                handle.close()

        try:
            return await within(asyncio.to_thread(give_back), GIVE_BACK_S)
        except Exception as e:
            log.warning("could not hand back the leases of %s at once (%r)", holder, e)
            return -1
