"""``deploy=ray``: every stage instance a Ray actor on the resources its config names.

    asyncflow run deploy.mode=ray rollout.instances=2 reward.instances=2 train.dp_size=2

What runs where (``asyncflow.deploy.ray_hosts`` for the actors):

| actor                 | count               | resources (config)      | after its death   |
|-----------------------|---------------------|-------------------------|-------------------|
| TransferQueue units   | num_units           | transferqueue.placement | restarted empty   |
| TransferQueue ctl.    | 1                   | the driver's node       | -                 |
| coordinator           | 1                   | the driver's node       | -                 |
| generator             | rollout.instances   | rollout.placement       | restarted         |
| rollout dispatcher    | 1                   | the driver's node       | restarted         |
| reward worker         | reward.instances    | reward.placement        | restarted         |
| reference worker      | reference.instances | reference.placement     | restarted         |
| trainer rank 0        | 1                   | train.placement         | ddp, >= 2 ranks:  |
|                       |                     |                         | restarted, takes  |
|                       |                     |                         | the train stage   |
|                       |                     |                         | over; else the    |
|                       |                     |                         | run fails (below) |
| trainer ranks 1..     | train.dp_size - 1   | train.placement         | restarted (ddp),  |
|                       |                     |                         | state from rank 0;|
|                       |                     |                         | fsdp: the run     |
|                       |                     |                         | fails (below)     |

Restarts are Ray's (``deploy.max_restarts`` per actor); a node lost takes every actor on it
at once (``asyncflow.deploy.ray_nodes``: what that costs, who comes back where). Generators
and reward workers join and leave a running job by command (``asyncflow scale DIR rollout=N
reward=M``: ``ray_scale``, ``ray_workers``), and a generator that gets SIGTERM (preemption) is
drained and leaves.

The driver (this process) stays the run's single controller (LlamaRL's design): it runs the
prompt feeder, and so admission control, itself, and takes the step reports. Shared state
that stage hosts on other nodes report to and wait on (generator versions and loads, the
weight-update policy, the step reports) lives in a small coordinator actor, because a Ray
actor cannot call back into the driver.

**Recovery.** Generators, the rollout dispatcher and reward/reference workers are restarted by Ray
(``max_restarts``) and their ``run`` is called again by the driver, which counts the restarts
(``RunResult.extra["restarts"]``, and ``restarts`` in every step's record). What a dead host held
comes back without anyone's help: rows it had leased return to their task as its replacement
announces itself or its heartbeat stops (seconds, not ``transferqueue.lease_s``), and a
``generate`` call in flight on a dead generator fails at once in the dispatcher, which generates
the batch on another instance. A restarted generator registers again with its initial weights and
takes no batch until it holds weights recent enough for it (the staleness bound is checked per
sample, whatever happens). Every trainer rank of a ``train.strategy=ddp`` group of two or more is
restarted too (``asyncflow.deploy.ray_ranks``): a rank ``r >= 1``'s replacement gets rank 0's
weights and optimizer state, the group forms again and the step in flight is redone exactly; rank
0's replacement (the driver runs its ``run`` again, as for other hosts) takes a surviving rank's
state, forms the group again as its rank 0 and takes the train stage over from the step in flight:
the step's rows, held leased until the step is reported, come back with their dead holder, and a
step the survivors had already taken is reported, not trained again. The only rank of a single-rank
trainer (no other copy of its state) and the ranks of ``fsdp`` (each holds only its shards) are
not: the run fails with an error naming the rank and why (never a hang: every collective has a
timeout); resume the run from its newest checkpoint (``asyncflow run --resume DIR``, ``DIR`` the
run's ``output.dir``; ``checkpoint.every_steps`` writes them).

**Checkpoints and resume.** Trainer rank 0 writes the trainer's part of a checkpoint in its
actor (``asyncflow.checkpoint``; with ``train.strategy=fsdp`` every rank writes its shards:
``asyncflow.deploy.sharded``); with several nodes ``checkpoint.dir`` must be a folder every
node sees. On resume, every trainer rank restores the checkpoint before the data-parallel
group forms (fsdp: right after, into its shards), generator hosts are built from its policy
folder at its version, and the coordinator starts at that version.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

import transferqueue
from adapters import Adapter, StepReport
from asyncflow.build import EngineFactories
from asyncflow.checkpoint import CheckpointPlan, ResumePoint
from asyncflow.config import PlacementConfig, RunConfig
from asyncflow.deploy.base import Deployment, Job
from asyncflow.deploy.coordinator import Coordinator
from asyncflow.deploy.ray_hosts import GeneratorActor, RolloutActor, TQAccess, WorkerActor
from asyncflow.deploy.ray_nodes import NotBackError, on_driver_node, until_alive
from asyncflow.deploy.ray_probe import PROBE_OPTIONS, HostProbes
from asyncflow.deploy.ray_ranks import ranks_restartable, trainer_lost
from asyncflow.deploy.ray_scale import SCALABLE, RolloutScaler
from asyncflow.deploy.ray_start import QUIET_BLOCKING_GET, init_ray, take_early
from asyncflow.deploy.ray_trainer import TrainerActor
from asyncflow.deploy.ray_weights import ObjectStoreWeights
from asyncflow.deploy.ray_workers import WORKER_ROLES, WorkerScaler
from asyncflow.deploy.remote import RemoteRegistry, remote_cause
from asyncflow.metrics import Timeline
from asyncflow.registry import WeightSync
from asyncflow.stage_runner import COUNT_METRICS, StageError
from asyncflow.stall import Probe
from transferqueue.aio import within
from transferqueue.deploy.ray import RayStart
from transferqueue.wire.auth import ClientKeys

__all__ = ["RayDeployment", "actor_options"]

log = logging.getLogger(__name__)

DRAIN_S = 5.0
"""Bound of the driver's per-step call for what a stage host recorded (``collect``)."""


def actor_options(p: PlacementConfig, *, pg: Any = None, bundle: int = 0) -> dict[str, Any]:
    """Ray actor options for one instance of a stage placed as ``p`` says."""
    opts: dict[str, Any] = {"num_cpus": p.num_cpus, "num_gpus": p.num_gpus}
    if p.resources:
        opts["resources"] = dict(p.resources)
    if pg is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle
        )
    elif p.node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(p.node_id, soft=p.soft)
    return opts


def _bundle(p: PlacementConfig) -> dict[str, float]:
    bundle = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources}
    bundle = {k: float(v) for k, v in bundle.items() if v}
    if not bundle:
        raise ValueError(
            "placement.placement_group needs resources to reserve: set num_cpus, num_gpus or "
            "resources above 0"
        )
    return bundle


class RayDeployment(Deployment):
    """Stage hosts as Ray actors (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        timeline: Timeline,
        *,
        factories: EngineFactories | None = None,
        adapters: dict[str, type[Adapter]] | None = None,
        checkpoint: CheckpointPlan | None = None,
        resume: ResumePoint | None = None,
    ) -> None:
        self.cfg = cfg
        self.timeline = timeline
        self._plan = checkpoint
        self._resume = resume
        self._factories = factories or EngineFactories()
        self._adapters = adapters
        self._started_ray = False
        self._early = False  # Ray started by asyncflow.run, beside the imports
        self._tq: transferqueue.TransferQueue | None = None
        self._tq_keys: ClientKeys | None = None
        self._service: transferqueue.LocalService | None = None
        self._tq_names: list[str] = []
        self._actors: list[Any] = []
        self._groups: list[Any] = []
        self._coord: Any = None
        self._trainers: list[Any] = []
        self._generators: list[tuple[str, Any]] = []
        self._weights: Any = None
        self._coord_name = ""
        self.scaler: RolloutScaler  # (made with the generators: _open_hosts)
        self.workers: WorkerScaler  # (reward and reference workers: made after them)
        self._rollout: Any = None
        self._workers: list[tuple[str, Any]] = []
        self.restarts: dict[str, int] = {}
        self.restart_times: list[tuple[str, float, float]] = []
        self._syncs_seen = 0  # weight syncs handed to the driver so far
        self._syncs_ready: list[WeightSync] = []  # fetched with the reports, not yet handed out
        again = ranks_restartable(self.cfg)  # (a ddp rank recovers as a dead one does)
        self._probes = HostProbes(self._named, lambda n: again or not n.startswith("train"))
        self._closed = False

    # -- start ------------------------------------------------------------------------------
    def _init_ray(self) -> None:
        """Ray for the run: the cluster ``asyncflow.run`` started early for it, or started
        (or joined) now; one it started is shut down at the end (``close``)."""
        self._early = take_early()
        self._started_ray = self._early or init_ray(self.cfg)

    def _open_tq(self, prefix: str) -> transferqueue.TransferQueue | RayStart:
        """TransferQueue for the run, and the keys its stage hosts connect with
        (``self._tq_keys``): those of ``transferqueue.keys``, or, when the servers start
        on a cluster of several nodes without a key directory, keys made for this run (the servers
        must listen beyond loopback, and only this run's processes may reach them). Servers
        started on Ray come back still starting (their :class:`RayStart`): the stage hosts
        start beside them and find the controller by its name."""
        import ray

        from transferqueue.wire.auth import client_keys, server_keys, session_keys

        tqc = self.cfg.transferqueue
        if tqc.mode in ("ray", "auto"):
            from transferqueue.deploy.ray import launch_on_ray

            keys = server_keys(tqc.keys) if tqc.keys else None
            self._tq_keys = client_keys(tqc.keys) if tqc.keys else None
            if keys is None and len([n for n in ray.nodes() if n.get("Alive")]) > 1:
                keys, self._tq_keys = session_keys()
            opts = actor_options(tqc.placement)
            self._tq_names = [f"{prefix}-tq-unit{i}" for i in range(tqc.num_units)]
            self._tq_names.append(f"{prefix}-tq-controller")
            return launch_on_ray(
                tqc.num_units,
                actor_options=opts,
                name_prefix=f"{prefix}-tq",
                keys=keys,
                state_dir=tqc.state_dir,
                fsync=tqc.fsync,
                batch_sched=self.cfg.deploy.batch_sched,
                max_connections=tqc.max_connections,
                replicas=tqc.replicas,
                controller_options=on_driver_node({"num_cpus": tqc.placement.num_cpus}),
            )
        if tqc.mode == "service":
            self._service = transferqueue.serve(**tqc.service_options())
            return transferqueue.connect(self._service.address, ride_through_s=tqc.ride_through)
        assert tqc.address is not None
        self._tq_keys = client_keys(tqc.keys) if tqc.keys else None
        return transferqueue.connect(
            tqc.address, keys=self._tq_keys, ride_through_s=tqc.ride_through
        )

    def _placed(self, p: PlacementConfig, n: int) -> list[dict[str, Any]]:
        """Actor options for the ``n`` instances of a stage (with a placement group reserved
        for the stage when its placement asks for one)."""
        if p.placement_group is None:
            return [actor_options(p) for _ in range(n)]
        from ray.util.placement_group import placement_group

        pg = placement_group([_bundle(p)] * n, strategy=p.placement_group)
        self._groups.append(pg)
        return [actor_options(p, pg=pg, bundle=i) for i in range(n)]

    async def open(self) -> None:

        cfg = self.cfg
        t0 = time.perf_counter()
        f = self._factories
        self.task = f.task(cfg)
        # The model folder is found (or built) while Ray starts, and the driver's tokenizer
        # loads while the servers and hosts do: Ray's start and the hosts' are mostly waits.
        finding = asyncio.ensure_future(asyncio.to_thread(f.model, cfg, self.task))
        try:
            self._init_ray()  # on this thread: Ray installs its signal handlers on the main one
        except BaseException:
            await asyncio.gather(finding, return_exceptions=True)
            raise
        model = await finding
        loading = asyncio.ensure_future(asyncio.to_thread(f.tokenizer, model))
        try:
            await self._open_hosts(model, f, t0)
        finally:
            if not loading.done():
                await asyncio.gather(loading, return_exceptions=True)
        self.tokenizer = await loading

    async def _open_hosts(self, model: Path, f: EngineFactories, t0: float) -> None:
        import ray

        cfg = self.cfg
        t1 = time.perf_counter()
        prefix = f"asyncflow-{uuid.uuid4().hex[:8]}"
        opened = await asyncio.to_thread(self._open_tq, prefix)
        if isinstance(opened, RayStart):  # still starting: the hosts start beside its servers
            starting: RayStart | None = opened
            address = TQAccess(
                None,
                self._tq_keys,
                cfg.transferqueue.ride_through,
                controller=opened.controller_name,
                start_timeout_s=cfg.deploy.start_timeout_s,
            )
        else:
            starting, self._tq = None, opened
            self.client = opened.async_client()
            assert opened.address is not None
            address = TQAccess(opened.address, self._tq_keys, cfg.transferqueue.ride_through)
        origin = self.timeline.origin
        restart = {"max_restarts": cfg.deploy.max_restarts, "max_task_retries": 0}
        # Hosts find each other by name, never by a handle in their constructor arguments:
        # Ray restarts an actor with the same arguments, which must not depend on objects
        # the driver might let go of. Names: ``asyncflow-<run>-<stage>`` (``ray list actors``).
        # Hosts that block on Ray inside their event loop say so on purpose: the warning off.
        # A cluster the run started has it in every worker's environment already (init_ray);
        # a runtime_env would give those hosts workers of their own, started later.
        quiet = {"env_vars": {QUIET_BLOCKING_GET: "0"}}
        env: dict[str, Any] = {} if self._started_ray else {"runtime_env": quiet}
        coord_name = f"{prefix}-coordinator"
        coord_cls: Any = ray.remote(Coordinator)
        resume = self._resume
        start_version = 0 if resume is None else resume.version
        here = on_driver_node({"num_cpus": 0})  # (its loss would end the run: ray_nodes)
        self._coord = coord_cls.options(name=coord_name, **here).remote(
            start_version,
            policy=cfg.rollout.weight_sync,
            first_group=None if resume is None else resume.next_group,
            batch_sched=cfg.deploy.batch_sched,
        )
        self._actors.append(self._coord)  # not waited for: it starts beside the hosts
        registry = RemoteRegistry(self._coord)
        self.registry = self._registry = registry
        self._coord_name = coord_name

        trainer_cls: Any = ray.remote(**PROBE_OPTIONS)(TrainerActor)
        rank_restart = restart if ranks_restartable(cfg) else {}
        for rank, opts in enumerate(self._placed(cfg.train.placement, cfg.train.dp_size)):
            name = f"{prefix}-train-rank{rank}"
            actor = trainer_cls.options(name=name, **opts, **rank_restart, **env).remote(
                rank, cfg, model, f, self._adapters, address, coord_name, origin
            )
            self._trainers.append(actor)
            self._actors.append(actor)
        gen_cls: Any = ray.remote(**PROBE_OPTIONS)(GeneratorActor)
        policy = model if resume is None else resume.policy

        def make(i: int, opts: dict[str, Any]) -> tuple[str, Any, str]:
            name = f"instance{i}"
            actor = gen_cls.options(name=f"{prefix}-{name}", **opts, **restart, **env).remote(
                name, i, cfg, policy, f, coord_name, origin, start_version
            )
            return name, actor, f"{prefix}-{name}"

        for i, opts in enumerate(self._placed(cfg.rollout.placement, cfg.rollout.instances)):
            name, actor, _ = make(i, opts)
            self._generators.append((name, actor))
            self._actors.append(actor)
        # (later instances: placed as at start, outside any placement group: ray_scale)
        self.scaler = RolloutScaler(
            cfg,
            self._generators,
            self._actors,
            registry,
            lambda i: make(i, actor_options(cfg.rollout.placement)),
            self.generator_job,
            lambda: (self._rollout, self._trainers[0], getattr(self._weights, "name", "")),
        )
        rollout_cls: Any = ray.remote(**PROBE_OPTIONS)(RolloutActor)
        gen_names = [(n, f"{prefix}-{n}") for n, _ in self._generators]
        self._rollout = rollout_cls.options(name=f"{prefix}-rollout", **here, **restart).remote(
            cfg, self._adapters, address, coord_name, gen_names, origin, model, f
        )
        self._actors.append(self._rollout)
        worker_cls: Any = ray.remote(**PROBE_OPTIONS)(WorkerActor)

        def make_worker(role: str, i: int, opts: dict[str, Any] | None) -> Any:
            opts = actor_options(getattr(cfg, role).placement) if opts is None else opts
            return worker_cls.options(name=f"{prefix}-{role}-{i}", **opts, **restart).remote(
                role, i, cfg, model, f, self._adapters, address, origin
            )

        args = (make_worker, self._job, self.scaler.retired, address, prefix, self.timeline)
        self.workers = WorkerScaler(cfg, self._workers, self._actors, *args)
        self.workers.start(self._placed)  # (reward workers scale too: ray_workers)
        if starting is not None:
            self._tq = await asyncio.to_thread(starting.handle)
            self.client = self._tq.async_client()
        t3 = time.perf_counter()
        await self._until_started()
        t4 = time.perf_counter()
        fsdp = cfg.train.strategy == "fsdp"
        if resume is not None and not fsdp:  # every rank, before the group forms
            await asyncio.gather(*(t.restore.remote(resume.directory) for t in self._trainers))
        self._weights = await self._transport()
        if len(self._trainers) > 1 or fsdp:
            host, port = await self._trainers[0].endpoint.remote()
            world = len(self._trainers)
            await asyncio.gather(*(t.join.remote(world, host, port) for t in self._trainers))
        if resume is not None and fsdp:  # into the shards: every rank, once sharded
            await asyncio.gather(*(t.restore.remote(resume.directory) for t in self._trainers))
        log.info(
            "deploy=ray: Ray%s and the model in %.1f s, TransferQueue serving %.1f s later (the "
            "stage hosts starting beside it), %d stage hosts %.1f s after that, trainer group in "
            "%.1f s; weights through %r",
            " (started with the imports: not counted)" if self._early else "",
            t1 - t0,
            t3 - t1,
            len(self._actors),
            t4 - t3,
            time.perf_counter() - t4,
            self._weights.name,
        )

    async def _until_started(self) -> None:
        """Every actor constructed (engines loaded), or an error saying which are not and
        what they wait for."""
        import ray

        timeout = self.cfg.deploy.start_timeout_s
        names = {id(a): n for n, a in self._named()}
        pending = {a.ping.remote(): a for a in self._actors}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, _ = await asyncio.to_thread(
                ray.wait, list(pending), num_returns=len(pending), timeout=max(left, 0)
            )
            for ref in ready:
                await ref  # a constructor that raised raises here
                pending.pop(ref)
            if pending and time.monotonic() >= deadline:
                waiting = sorted(names.get(id(a), "coordinator") for a in pending.values())
                raise TimeoutError(
                    f"stage hosts {waiting} did not start within deploy.start_timeout_s="
                    f"{timeout}: the cluster may lack the resources their placement asks for "
                    f"(available: {ray.available_resources()}); lower the stages' placement "
                    "num_cpus/num_gpus or add nodes"
                )

    async def _transport(self) -> Any:
        """The weight transport, chosen now that every host has a node and a device
        (:func:`~asyncflow.deploy.transport_choice.choose_transport`): ``ipc`` when the
        trainer and every generator share a node and the trainer's GPU, ``shm`` on one node
        otherwise, ``broadcast`` from the trainer's rank 0 across nodes (NCCL between GPUs),
        or what ``deploy.weight_transport`` names."""
        from asyncflow.deploy.transport_choice import Where, choose_transport
        from asyncflow.transport import make_transport

        choice = self.cfg.deploy.weight_transport
        if choice == "ray":
            return ObjectStoreWeights(self._coord_name)
        hosts = [self._trainers[0], *(a for _, a in self._generators)]
        places = await asyncio.gather(*(h.where.remote() for h in hosts))
        trainer, *generators = [
            Where(str(p["node_id"]), p["device"], p["gpu"], tuple(p["gpus"])) for p in places
        ]
        name, options = choose_transport(choice, trainer, generators)
        if name == "broadcast":
            host, port = await self._trainers[0].endpoint.remote()
            options["address"] = f"tcp://{host}:{port}"
        return make_transport(name, **options)

    def _named(self) -> list[tuple[str, Any]]:
        out = [(f"train/rank{r}" if r else "train", t) for r, t in enumerate(self._trainers)]
        out += [(f"rollout/{n}", a) for n, a in self._generators]
        out += [("rollout", self._rollout), *self._workers]
        return out

    # -- run --------------------------------------------------------------------------------
    def jobs(self) -> dict[str, Job]:
        jobs: dict[str, Job] = {}
        trainers = self._trainers
        first_group = None if self._resume is None else self._resume.next_group
        again = ranks_restartable(self.cfg)  # ranks recover each other (ray_ranks)
        jobs["train"] = self._job(
            "train",
            lambda: trainers[0].run.remote(trainers[1:], self._weights, self._plan, first_group),
            restartable=again,
            host=trainers[0],
            lost=functools.partial(trainer_lost, 0, self.cfg),
        )
        for r, t in enumerate(trainers[1:], start=1):
            name = f"train/rank{r}"
            lost = functools.partial(trainer_lost, r, self.cfg)
            jobs[name] = self._job(name, t.hold.remote, restartable=again, host=t, lost=lost)
        for name, g in self._generators:
            jobs[f"rollout/{name}"] = self.generator_job(name, g)
        rollout = self._rollout
        run = functools.partial(self.scaler.rejoin, rollout)  # (instances added since start)
        jobs["rollout"] = self._job("rollout", run, restartable=True, host=rollout)
        return jobs | self.workers.jobs()

    def generator_job(self, name: str, gen: Any) -> Job:
        """Generator host ``name``'s job (restarted when it dies; ends when it left the run:
        ``asyncflow.deploy.ray_scale``)."""
        run = functools.partial(gen.run.remote, self._weights)
        return self._job(f"rollout/{name}", run, restartable=True, host=gen, instance=name)

    @property
    def scalable(self) -> tuple[str, ...]:
        colocated = self.cfg.reward.colocate  # (the rollout host scores: no reward workers)
        return tuple(s for s in SCALABLE if not (colocated and s == "reward"))

    def instances(self) -> dict[str, int]:
        out = {"rollout": len(self._generators), "train": len(self._trainers)}
        for name, _ in self._workers:
            stage = name.split("/")[0]
            out[stage] = out.get(stage, 0) + 1
        return out

    def supervise(self, spawn: Callable[[str, Job], None]) -> None:
        self.scaler.spawn = self.workers.spawn = spawn

    async def scale(self, stage: str, n: int, spawn: Callable[[str, Job], None]) -> int:
        scaler = self.workers if stage in WORKER_ROLES else self.scaler
        return await scaler.scale(stage, n)  # (spawn: taken by supervise)

    def _job(
        self,
        name: str,
        call: Callable[[], Awaitable[Any]],
        *,
        restartable: bool,
        host: Any = None,
        lost: Callable[[BaseException], Exception] | None = None,
        instance: str | None = None,
    ) -> Job:
        """A stage host's ``run`` on the driver's loop; after Ray restarted the host, run it
        again (each restart counted), until ``deploy.max_restarts`` is spent. ``lost`` words
        the error of a death that ends the run (trainer ranks: why, and how to resume)."""
        import ray

        async def supervised() -> None:
            while True:
                try:
                    try:
                        await call()
                        return
                    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
                        if instance is not None and instance in self.scaler.retired:
                            return  # it left the run (scaled down): stopped on purpose
                        raise
                except ray.exceptions.RayTaskError as e:  # the host's run raised: name it
                    cause = remote_cause(e)
                    root = cause.__cause__ if isinstance(cause, StageError) else None
                    raise StageError(
                        name, root if isinstance(root, BaseException) else cause
                    ) from e
                except ray.exceptions.RayActorError as e:
                    if not restartable or host is None:
                        if lost is not None:
                            raise lost(e) from e
                        raise RuntimeError(f"stage host {name!r} died: {e}") from e
                    used = self.restarts.get(name, 0) + 1
                    self.restarts[name] = used  # counted when seen: the run may end first
                    if used > self.cfg.deploy.max_restarts:
                        if lost is not None:
                            raise lost(e) from e
                        raise RuntimeError(
                            f"stage host {name!r} died {used} times (deploy.max_restarts="
                            f"{self.cfg.deploy.max_restarts}): {e}"
                        ) from e
                    log.warning("stage host %r died; Ray restarts it (restart %d)", name, used)
                    if instance is not None:  # (routed nothing meanwhile)
                        await self.scaler.lost(instance)
                    died = self.timeline.now()
                    bound = self.cfg.deploy.start_timeout_s
                    try:
                        with self._probes.restarting(name):
                            await until_alive(name, host, e, bound)
                    except NotBackError as gone:  # a generator leaves; others end the run
                        if instance is None or not await self.scaler.drop(instance, gone):
                            raise
                        return
                    self.restart_times.append((name, died, self.timeline.now()))

        return supervised

    async def progress(self) -> dict[str, Probe]:
        """Every host as last heard (``ray_probe``); trainer ranks are replaced only where a
        dead one recovers (``ray_ranks``); a generator that got SIGTERM is drained."""
        probes = self._probes.progress()
        self.scaler.notice(probes)
        return probes

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        return await self._probes.stacks(host, timeout_s)

    async def replace(self, host: str) -> bool:
        return await self._probes.replace(host)

    async def next_report(self) -> StepReport:
        """The next step's report; the weight syncs done by then come with it (one call to
        the coordinator per step: :meth:`weight_syncs` hands them out)."""
        while True:
            report, syncs, self._syncs_seen = await self._registry.next_step(5.0, self._syncs_seen)
            self._syncs_ready += syncs
            if report is not None:
                return report

    async def collect(self) -> dict[str, dict[str, float]]:
        """What the hosts recorded since the last call, for the step's record: hosts that Ray
        restarts are not asked (a call waits for the restart: a lost node's hosts held every
        record up until a new node took them), the others at most ``DRAIN_S`` (a host that
        answers later hands that part to no one)."""
        hosts = [a for n, a in self._named() if not self._probes.is_restarting(n)]
        drains = (within(a.drain.remote(), DRAIN_S) for a in hosts)
        results = await asyncio.gather(*drains, return_exceptions=True)
        merged: dict[str, list[dict[str, float]]] = {}
        for r in results:
            if isinstance(r, BaseException):
                continue  # a host that died lost what it had not handed over
            intervals, metrics = r
            self.timeline.merge(intervals)
            for stage, m in metrics.items():
                merged.setdefault(stage, []).append(m)
        out: dict[str, dict[str, float]] = {}
        for stage, ms in merged.items():
            keys = dict.fromkeys(k for m in ms for k in m)
            out[stage] = {  # (counts summed over a stage's hosts, means averaged)
                k: float(
                    (np.nansum if k in COUNT_METRICS else np.nanmean)([m[k] for m in ms if k in m])
                )
                for k in keys
            }
        return out

    @property
    def predict(self) -> Any:
        if not self.cfg.rollout.ranker:
            return None
        rollout = self._rollout

        async def predict(prompts: Sequence[torch.Tensor]) -> np.ndarray:
            try:
                return cast(np.ndarray, await rollout.predict.remote(list(prompts)))
            except Exception as e:  # the dispatcher restarting: no prediction this time
                log.warning("length prediction unavailable (%s); using none", e)
                return np.zeros(len(prompts))

        return predict

    async def save_policy(self, directory: Path) -> None:
        import ray

        try:
            # fsdp: every rank gathers the policy with rank 0, which writes it
            ranks = self._trainers if self.cfg.train.strategy == "fsdp" else self._trainers[:1]
            await asyncio.gather(*(t.save_policy.remote(str(directory.resolve())) for t in ranks))
        except ray.exceptions.RayTaskError as e:  # the trainer's own error, not Ray's wrapper
            raise remote_cause(e) from None

    async def weight_syncs(self) -> list[WeightSync]:
        """The syncs fetched with the reports since the last call (a sync that lands after a
        step's report goes in the next step's record)."""
        syncs, self._syncs_ready = self._syncs_ready, []
        return syncs

    async def summary(self) -> dict[str, Any]:
        stats = await self._registry.stats()
        rollout: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            rollout = await self._rollout.summary.remote()
        nodes: dict[str, str] = {}
        with contextlib.suppress(Exception):  # (a host that died at the end has no node)
            nodes = await within(self.where(), 30.0)
        return {
            "weight_transport": None if self._weights is None else self._weights.name,
            "nodes": nodes,
            "weight_updates": stats["updates"],
            "weight_update_s": stats["update_seconds"],
            "weight_pause_s": stats["pause_s"],
            "weight_adoption_s": stats["adoption_s"],
            "restarts": dict(self.restarts),
            "generator_restarts": stats["restarts"],
            **rollout,
        }

    async def where(self) -> dict[str, str]:
        """The Ray node (hex id) of every stage host by stage name, and of the TransferQueue
        servers (``tq/unit0``, ..., ``tq/controller``) when they run on Ray."""
        import ray

        named = self._named()
        places = await asyncio.gather(*(a.where.remote() for _, a in named))
        out = {n: str(p["node_id"]) for (n, _), p in zip(named, places, strict=True)}
        for name in self._tq_names:
            node = await ray.get_actor(name).node_id.remote()
            out["tq/" + name.rsplit("-", 1)[1]] = str(node)
        return out

    # -- stop -------------------------------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._probes.close()
        import ray

        for a in self._actors:
            with contextlib.suppress(Exception):
                await within(a.close.remote(), 10.0)
        for a in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        for pg in self._groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
        if self._tq is not None:
            self._tq.close()
        if self._service is not None:
            self._service.close()
        if self._started_ray:
            ray.shutdown()
