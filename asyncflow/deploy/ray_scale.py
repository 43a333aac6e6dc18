"""Scaling a running ``deploy=ray`` job's rollout (``asyncflow scale DIR rollout=N``).

| step | scale up (one new instance)            | scale down (one instance leaves)      |
|------|----------------------------------------|---------------------------------------|
| 1    | a generator actor, placed as at start  | the rollout routes it no new batch    |
|      | (``rollout.placement``), its engine    |                                       |
|      | built from the run's policy            |                                       |
| 2    | its ``run``: a driver job as the       | the calls it has finish there (at     |
|      | others; it registers with the version  | most ``deploy.drain_grace_s``; past   |
|      | registry and loads the newest weights  | that they fail over to the other      |
|      | through the run's weight transport     | instances, as when an instance dies)  |
| 3    | the rollout routes to it once its      | it is stopped, leaves the registry,   |
|      | weights are recent enough for a batch  | its job ends                          |

No row moves: the rollout host holds every lease (a generator only answers ``generate``
calls), so a leaving generator hands back nothing and takes nothing with it, and the
staleness bound holds for a new one's first batch as for every batch (the rollout routes a
batch only to an instance whose version is at least the batch's ``min_gen_version``, and
checks every sample's). A new instance in a placement group reserved at start gets no bundle
of it (the group's bundles are fixed): it asks Ray for the same resources outside the group.
Instances added are named on from the highest index (``instance2``, ...), never reusing a
name: each has its own registry entry and job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from asyncflow.config import RunConfig
from asyncflow.control import SCALABLE, ControlError
from asyncflow.deploy.remote import RemoteRegistry
from asyncflow.supervisor import Job
from transferqueue.aio import within

__all__ = ["SCALABLE", "RolloutScaler"]

log = logging.getLogger(__name__)

Spawn = Callable[[str, Job], None]


class RolloutScaler:
    """The rollout's instances of one ``deploy=ray`` run, added and removed one at a time
    (requests are served in turn by the control channel).

    ``generators`` and ``actors`` are the deployment's own lists (its stage hosts by name, and
    every actor it stops at the end), changed here in place; ``make`` places a new generator
    host (index -> its name, actor, Ray actor name); ``job`` is a generator host's supervised
    job; ``hosts`` is read when a request comes: the rollout dispatcher, the trainer's rank
    0, the weight transport's name.
    """

    def __init__(
        self,
        cfg: RunConfig,
        generators: list[tuple[str, Any]],
        actors: list[Any],
        registry: RemoteRegistry,
        make: Callable[[int], tuple[str, Any, str]],
        job: Callable[[str, Any], Job],
        hosts: Callable[[], tuple[Any, Any, str]],
    ) -> None:
        self.cfg = cfg
        self._generators = generators
        self._actors = actors
        self._registry = registry
        self._make = make
        self._job = job
        self._hosts = hosts  # () -> (rollout dispatcher, trainer rank 0, transport name)
        self._next = len(generators)
        self._added: dict[str, str] = {}  # instances added since start: name -> actor name
        self.retired: set[str] = set()
        """Instances that left (their job ends quietly when their actor is stopped)."""
        self.spawn: Spawn | None = None
        """Starts a job while the run goes on (the driver's supervisor sets it)."""

    def count(self) -> int:
        return len(self._generators)

    async def scale(self, stage: str, n: int) -> int:
        """``stage`` to ``n`` instances; the count before."""
        if stage not in SCALABLE:
            raise ControlError(f"the {stage} stage cannot be scaled; what can be: rollout=N")
        was = self.count()
        while self.count() < n:
            await self._add()
        while self.count() > n:
            await self._remove()
        if was != n:
            log.warning("rollout scaled from %d to %d instances", was, n)
        return was

    async def _add(self) -> None:
        import ray

        if self.spawn is None:
            raise ControlError("the run is not running its stages yet; try again in a moment")
        index = self._next
        self._next += 1
        name, gen, actor_name = self._make(index)
        try:
            await within(gen.ping.remote(), self.cfg.deploy.start_timeout_s)
            await self._check_transport(name, gen)
        except BaseException as e:
            with contextlib.suppress(Exception):
                ray.kill(gen)
            if isinstance(e, ControlError):
                raise
            if isinstance(e, TimeoutError):
                raise ControlError(
                    f"the new rollout instance did not start within deploy.start_timeout_s="
                    f"{self.cfg.deploy.start_timeout_s}: the cluster may lack what "
                    f"rollout.placement asks for (available: {ray.available_resources()})"
                ) from None
            raise
        self._generators.append((name, gen))
        self._actors.append(gen)
        self.spawn(f"rollout/{name}", self._job(name, gen))
        self._added[name] = actor_name
        rollout, _, _ = self._hosts()
        await rollout.add_generator.remote(name, actor_name)

    async def rejoin(self, rollout: Any) -> None:
        """The rollout dispatcher's ``run``, after telling it of the instances added since the
        run started (a dispatcher Ray restarted starts again with the run's first ones)."""
        for name, actor_name in list(self._added.items()):
            await rollout.add_generator.remote(name, actor_name)
        await rollout.run.remote()

    async def _check_transport(self, name: str, gen: Any) -> None:
        """A transport chosen for one node (``shm``, ``ipc``) reaches no other node: a new
        instance placed elsewhere is refused (``deploy.weight_transport=broadcast`` serves
        newcomers anywhere)."""
        _, trainer0, transport = self._hosts()
        if transport not in ("shm", "ipc"):
            return
        there, trainer = await asyncio.gather(gen.where.remote(), trainer0.where.remote())
        if there["node_id"] != trainer["node_id"]:
            raise ControlError(
                f"the new rollout instance {name} landed on another node than the trainer, "
                f"which the run's weight transport {transport!r} cannot reach; start the run "
                "with deploy.weight_transport=broadcast to scale across nodes"
            )

    async def _remove(self) -> None:
        import ray

        name, gen = self._generators[-1]  # (the newest first: the oldest keep their caches)
        grace = self.cfg.deploy.drain_grace_s
        rollout, _, _ = self._hosts()
        drained = await rollout.retire_generator.remote(name, grace)
        if not drained:
            log.warning(
                "rollout instance %s still had calls after deploy.drain_grace_s=%s; they go to "
                "the other instances",
                name,
                grace,
            )
        self.retired.add(name)
        self._added.pop(name, None)
        self._generators.remove((name, gen))
        with contextlib.suppress(Exception):
            await within(gen.close.remote(), 10.0)
        with contextlib.suppress(Exception):
            ray.kill(gen, no_restart=True)
        await self._registry.unregister(name)
