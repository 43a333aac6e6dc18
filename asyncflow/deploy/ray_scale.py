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

**Preemption.** A generator host that gets SIGTERM (a spot node's notice) does not exit: it
says so in its next progress probe's answer, and the driver removes it as a scale-down removes
an instance (its calls finish within ``deploy.drain_grace_s``, then it is stopped, not
restarted); the last instance (with ``rollout.autoscale``, one at its ``min``) is first
replaced by a new one, placed by Ray where resources allow. A host never drained exits by
itself ``drain_grace_s`` + 30 s after the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from asyncflow.config import RunConfig
from asyncflow.control import SCALABLE, ControlError
from asyncflow.deploy.remote import RemoteRegistry
from asyncflow.stall import Probe
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
        self._first = {name for name, _ in generators}  # the instances of the run's start
        self.retired: set[str] = set()
        """Instances that left (their job ends quietly when their actor is stopped)."""
        self.spawn: Spawn | None = None
        """Starts a job while the run goes on (the driver's supervisor sets it)."""
        self._preempting: set[str] = set()
        self._lock = asyncio.Lock()

    def count(self) -> int:
        return len(self._generators)

    async def scale(self, stage: str, n: int) -> int:
        """``stage`` to ``n`` instances; the count before."""
        if stage != "rollout":
            raise ControlError(f"the {stage} stage cannot be scaled; what can be: rollout=N")
        async with self._lock:  # (one change at a time: a command, a preemption)
            was = self.count()
            if self.cfg.rollout.autoscale.max and n > was:
                self._ask_ray(n)
            while self.count() < n:
                await self._add()
            while self.count() > n:
                await self._remove()
        if was != n:
            log.warning("rollout scaled from %d to %d instances", was, n)
        return was

    def _ask_ray(self, n: int) -> None:
        """Ask Ray for ``n`` instances' resources (``ray.autoscaler.sdk.request_resources``),
        so that an autoscaling cluster adds the nodes they need (a cluster without an
        autoscaler ignores it)."""
        p = self.cfg.rollout.placement
        bundle = {"CPU": p.num_cpus, **({"GPU": p.num_gpus} if p.num_gpus else {})}
        bundle.update(p.resources)
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[bundle] * n)
        except Exception as e:  # (best effort: the placement itself waits and is bounded)
            log.info("could not ask Ray's autoscaler for %d rollout instances: %r", n, e)

    def _by_name(self, name: str) -> Any:
        return dict(self._generators)[name]

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
        run started and of those of its start that left (a dispatcher Ray restarted starts
        again with the run's first ones)."""
        for name, actor_name in list(self._added.items()):
            await rollout.add_generator.remote(name, actor_name)
        for name in sorted(self.retired & self._first):  # (gone: routed nothing)
            await rollout.retire_generator.remote(name, 0.0)
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

    def notice(self, probes: Mapping[str, Probe]) -> None:
        """Start draining every generator whose last progress answer says it got SIGTERM
        (once each; the driver's stall watch reads the probes every second)."""
        for host, probe in probes.items():
            name = host.removeprefix("rollout/")
            if (
                probe.answer is not None
                and probe.answer.get("preempted")
                and name not in self._preempting
                and name in dict(self._generators)
                and self.spawn is not None
            ):
                self._preempting.add(name)
                self.spawn(f"preemption/{name}", functools.partial(self.preempt, name))

    async def preempt(self, name: str) -> None:
        """Drain the generator ``name`` that got SIGTERM and let it go; the last one is
        first replaced by a new instance (placed by Ray where resources allow)."""
        t0 = time.monotonic()
        log.warning(
            "rollout instance %s got SIGTERM (a preemption notice): it drains (at most "
            "deploy.drain_grace_s=%s) and leaves the run",
            name,
            self.cfg.deploy.drain_grace_s,
        )
        async with self._lock:
            if name not in dict(self._generators):  # (scaled away meanwhile)
                return
            scale = self.cfg.rollout.autoscale  # (never below 1, nor below autoscale's min)
            if self.count() <= (scale.min if scale.max else 1):
                await self._add()
            await self._remove(name)
        log.warning(
            "rollout instance %s drained and left in %.1f s; the rollout goes on with %d",
            name,
            time.monotonic() - t0,
            self.count(),
        )

    async def lost(self, name: str) -> None:
        """Instance ``name`` died: the rollout routes it nothing until it is back (bounded:
        a dispatcher that is itself restarting does not answer)."""
        rollout, _, _ = self._hosts()
        with contextlib.suppress(Exception):
            await within(rollout.lost_generator.remote(name), 10.0)

    async def drop(self, name: str, error: BaseException) -> bool:
        """Instance ``name`` died and Ray did not bring it back (``error``: why, e.g. its node
        lost and no other node has the resources it asks for): it leaves the run, as a
        scale-down removes one, and True; False (nothing changed) when it is the last."""
        async with self._lock:
            if name not in dict(self._generators) or self.count() == 1:
                return False
            log.warning(
                "rollout instance %s leaves the run (%s); the rollout goes on with %d; "
                "`asyncflow scale DIR rollout=N` adds instances again",
                name,
                error,
                self.count() - 1,
            )
            await self._remove(name, grace_s=0.0)
        return True

    async def _remove(self, name: str | None = None, grace_s: float | None = None) -> None:
        import ray

        # (the newest first: the oldest keep their caches)
        name, gen = self._generators[-1] if name is None else (name, self._by_name(name))
        grace = self.cfg.deploy.drain_grace_s if grace_s is None else grace_s
        rollout, _, _ = self._hosts()
        try:  # (bounded: a rollout host frozen or restarting meanwhile does not hold it)
            drained = await within(rollout.retire_generator.remote(name, grace), grace + 30.0)
        except Exception as e:  # the instance is stopped all the same; its calls fail over
            log.warning(
                "rollout instance %s: the rollout did not confirm its drain (%r); it is "
                "stopped, and its calls in flight go to the other instances",
                name,
                e,
            )
            drained = True
        if not drained and grace > 0:
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
