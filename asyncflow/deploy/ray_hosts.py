"""Stage hosts for ``deploy=ray``: plain classes, one Ray actor each (``ray.remote`` is applied
in ``asyncflow.deploy.ray``, at deployment).

| host           | instances               | builds                     | runs               |
|----------------|-------------------------|----------------------------|--------------------|
| GeneratorActor | rollout.instances       | one generation engine      | its weight         |
|                |                         |                            | follower; generate |
| RolloutActor   | 1                       | the rollout adapter over   | the rollout stage  |
|                |                         | proxies of the generators  |                    |
| WorkerActor    | reward/reference        | the reward function or the | that stage         |
|                | .instances              | reference engine           |                    |
| TrainerActor   | train.dp_size           | one training engine        | rank 0: the train  |
| (ray_trainer)  |                         | (a rank)                   | stage              |

Every host opens its own TransferQueue client (``transferqueue.connect``): sample data goes
from TransferQueue to the host that needs it and back, never through the driver. The rollout
is one host that dispatches to the generators rather than one stage per generator, because
StreamRL's skew-aware dispatch (dedicated long-tail instances, migration of samples past a
length budget) needs one view of every instance's load; what it relays to a generator is the
micro-batch's token ids and what comes back the sampled tokens and log-probs (kilobytes).

Each host records its busy intervals on a :class:`~asyncflow.metrics.Timeline` with the run's
origin; the driver drains them (:meth:`drain`) into the run's timeline at every step.

A host's stages run on its TransferQueue client's I/O loop, not on the actor's own event loop
(:meth:`_Host.on_tq_loop`): a stage's puts and gets then await their sockets on the loop that
runs them, with no hand-off between two threads and back for each call. The actor methods that
read what the stages write (``drain``, ``predict``, ``summary``) run there too.

Checkpoints (``asyncflow.checkpoint``): trainer rank 0 writes the trainer's part after the
optimizer step of a step the plan marks (ranks are identical); on resume every rank restores
from the checkpoint (``asyncflow.deploy.ray_trainer.TrainerActor.restore``) and generator hosts
start from its policy folder at its version (``initial_version``, a constructor argument so
that a host Ray restarts starts there too). Validation adds the ``eval`` stage to the rollout
host and the ``eval/reward`` stage to each reward worker, over the ``val`` partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

import transferqueue
from adapters import Adapter, LengthRanker
from asyncflow import graph
from asyncflow.build import EngineFactories
from asyncflow.checkpoint import (
    adopt_version,
)
from asyncflow.config import RunConfig
from asyncflow.deploy.ray_ranks import ranks_restartable
from asyncflow.deploy.ray_start import fewer_collections
from asyncflow.deploy.remote import GeneratorView, RemoteGenerator, RemoteRegistry
from asyncflow.hosts import GeneratorHost, WeightSource, check_engine
from asyncflow.metrics import Timeline
from asyncflow.progress import Work, host_answer
from asyncflow.stage_runner import StageRunner
from asyncflow.threads import intra_op_threads
from engines.packed import PackedGenerations, pack_generations, unpack_prompts
from engines.protocols import Generation, SamplingParams, ScoringEngine
from transferqueue import AsyncClient
from transferqueue.aio import within
from transferqueue.sched import batch_process
from transferqueue.wire.auth import ClientKeys

__all__ = [
    "PROBE_GROUP",
    "GeneratorActor",
    "RolloutActor",
    "WorkerActor",
    "ranks_restartable",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

Drained = tuple[dict[str, list[tuple[float, float, int, int]]], dict[str, dict[str, float]]]


PROBE_GROUP = "probe"
"""The Ray concurrency group of :meth:`_Host.progress` (a thread and event loop of its own in
every host actor: the probe is answered while the host's other loops are busy or blocked)."""


def _quiet_hf() -> None:
    """No per-model "Loading weights" bars in the hosts' logs, without importing transformers
    in a host that never loads a model (its first import reads the variable)."""
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    else:
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"


def actor(name: str, timeout_s: float = 60.0) -> Any:
    """The named actor of this run (created by the driver before the caller, but its name
    may take a moment to be visible on another node)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(name)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _reserved_cpus() -> int:
    """The CPUs Ray reserved for this actor (its placement's ``num_cpus``; at least one)."""
    try:
        import ray

        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    except Exception:  # (not in an actor)
        return 1
    return max(1, int(cpus))


def _holder_name() -> str | None:
    """The Ray actor's name (the same in every incarnation): the holder of its leases."""
    try:
        import ray

        name = ray.get_runtime_context().get_actor_name()
    except Exception:  # (not in an actor)
        return None
    if not name or "/" in name or len(name) > 96:
        return None  # (host:pid; its rows come back after its silence)
    return str(name)


@dataclass(frozen=True)
class TQAccess:
    """How a stage host reaches the run's TransferQueue: its address, or the name of the
    controller actor that gives it (servers started on Ray beside the hosts; at most
    ``start_timeout_s``), and the CURVE keys (None on one node's loopback). Sent in the
    actor's arguments, so a restarted actor connects again the same way."""

    address: str | None
    keys: ClientKeys | None = None
    ride_through_s: float = 0.0  # (transferqueue.ride_through_s, resolved)
    controller: str | None = None
    start_timeout_s: float = 300.0

    def resolve(self) -> str:
        """The controller's address (asked of the controller actor when not given)."""
        if self.address is not None:
            return self.address
        if self.controller is None:
            raise ValueError("TQAccess needs an address or the controller actor's name")
        from transferqueue.deploy.ray import controller_address

        return controller_address(self.controller, self.start_timeout_s)


class _Host:
    """What every stage host has: where it runs, its TransferQueue client, its timeline."""

    def __init__(self, cfg: RunConfig, tq: TQAccess | None, origin: float) -> None:
        if cfg.deploy.batch_sched:  # (first: the threads started later inherit it)
            batch_process()
        _quiet_hf()
        threads = intra_op_threads(cfg, cores=_reserved_cpus(), ray_host=True)
        if threads is not None:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.timeline = Timeline(origin)
        self._tq: transferqueue.TransferQueue | None = None
        self.client: AsyncClient | None = None
        self._access = tq
        self.runners: list[StageRunner] = []

    def _connect(self) -> AsyncClient:
        """Connect to the run's TransferQueue (a host calls it once its engine is built: the
        servers may start meanwhile) and return its client."""
        tq = self._access
        assert tq is not None and self._tq is None
        self._tq = transferqueue.connect(
            tq.resolve(), keys=tq.keys, ride_through_s=tq.ride_through_s, holder=_holder_name()
        )
        # A host Ray restarted replaces its dead incarnation: the rows that one held go
        # back to their queues now, not after its silence (holder_dead_after_s).
        try:
            back = self._tq.replace_earlier_holders()
        except transferqueue.TQError as e:  # (their silence returns the rows instead)
            log.warning(
                "stage host %s could not replace its earlier incarnation: %r",
                self._tq.holder.name,
                e,
            )
            back = 0
        if back:
            log.warning(
                "stage host %s replaces its dead incarnation: %d leased rows returned",
                self._tq.holder.name,
                back,
            )
        self.client = self._tq.async_client()
        return self.client

    def where(self) -> dict[str, Any]:
        """This host's node and process (placement tests; SIGKILL in fault tests), its
        engine's device, the GPUs it sees (UUIDs; the weight transport's choice)."""
        import ray

        from transferqueue.device.sharing import device_uuid, visible_gpus

        ctx = ray.get_runtime_context()
        device = self._device()
        gpu = None
        if device.type == "cuda":
            gpu = device_uuid(device.index if device.index is not None else 0)
        return {
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "device": str(device),
            "gpu": gpu,
            "gpus": visible_gpus(),
        }

    def _device(self) -> torch.device:
        """Where this host's engine runs (the CPU for hosts without a device of their own)."""
        return torch.device("cpu")

    def ping(self) -> bool:
        return True

    def _works(self) -> list[Work]:
        """What this host's stages (or engine) hold and have done."""
        return [r.work for r in self.runners]

    async def progress(self, stacks: bool = False) -> dict[str, Any]:
        """The driver's progress probe (:func:`asyncflow.progress.host_answer`; ``stacks``:
        with the Python stacks of this process). Called on :data:`PROBE_GROUP`."""
        import ray

        ctx = ray.get_runtime_context()
        return host_answer(
            self._works(), stacks=stacks, node=ctx.get_node_id(), actor=ctx.get_actor_name()
        )

    async def on_tq_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this host's TransferQueue client loop (where its stages run: each
        put and get then awaits its sockets with no hop between two threads, two wake-ups a
        call on busy cores); at once where the host has no client."""
        if self._tq is None:
            return await coro
        return await self._tq.run_async(coro)

    async def drain(self) -> Drained:
        """Busy intervals and adapter metrics recorded since the last drain (read on the
        loop the stages record them on)."""

        async def read() -> Drained:
            return self.timeline.drain(), {
                r.name: m for r in self.runners if (m := r.drain_metrics())
            }

        return await self.on_tq_loop(read())

    async def hold(self) -> None:
        """Returns only when the actor dies (the driver watches hosts without a stage of
        their own through it)."""
        await asyncio.Event().wait()

    def close(self) -> None:
        if self._tq is not None:
            self._tq.close()
            self._tq = None


PREEMPT_EXIT_S = 30.0
"""A generator that got SIGTERM and was not drained within ``deploy.drain_grace_s`` plus this
exits by itself (a driver that no longer answers keeps no preempted process alive)."""


def on_sigterm(handler: Callable[[], None]) -> None:
    """Call ``handler`` (quickly: it runs as a signal handler) instead of exiting when this Ray
    worker process gets SIGTERM.

    Ray's worker installs its own SIGTERM handler on its main thread, which an async actor's
    code never runs on (``signal.signal`` refuses other threads); that handler ends the
    process through ``ray._private.worker.raise_sys_exit_with_custom_error_message``, looked
    up when the signal comes, so that name is what is replaced here (for SIGTERM's message
    only). Where Ray has no such name, SIGTERM ends the process as before: the restart path
    replaces it."""
    try:
        from ray._private import worker
    except ImportError:  # (not a Ray worker)
        return
    exit_with = getattr(worker, "raise_sys_exit_with_custom_error_message", None)
    if exit_with is None:
        log.warning("SIGTERM is not drained here: this Ray has no hook for it")
        return

    def instead(message: str, *args: Any, **kwargs: Any) -> None:
        if "SIGTERM" not in message:
            exit_with(message, *args, **kwargs)
            return
        handler()

    worker.raise_sys_exit_with_custom_error_message = instead


class GeneratorActor(_Host):
    """One generation engine, following published weights, serving ``generate`` calls.

    Its weight receiver is opened by :meth:`run` (not the constructor), because the driver
    picks the transport once it knows where every host landed (one node: shared memory;
    several: a broadcast from the trainer).
    """

    def __init__(
        self,
        name: str,
        index: int,
        cfg: RunConfig,
        model: Path,
        factories: EngineFactories,
        coordinator: str,
        origin: float,
        initial_version: int = 0,
    ) -> None:
        super().__init__(cfg, None, origin)
        self.name = name
        self._model, self._initial_version = model, initial_version
        with fewer_collections():  # (transformers' imports)
            self.engine = factories.generator(cfg, model, index)
        self.registry = RemoteRegistry(actor(coordinator))
        self.host: GeneratorHost | None = None
        self._registered = asyncio.Event()
        self._preempted = False
        on_sigterm(self._on_sigterm)

    def _on_sigterm(self) -> None:
        """A preemption notice (a spot node's SIGTERM): said in the next progress probe's
        answer, the driver drains this instance and stops it (``ray_scale``); a host never
        drained exits by itself :data:`PREEMPT_EXIT_S` after ``deploy.drain_grace_s``."""
        if self._preempted:
            return
        self._preempted = True
        log.warning("generator %s got SIGTERM: it asks the driver to drain it", self.name)
        timer = threading.Timer(self.cfg.deploy.drain_grace_s + PREEMPT_EXIT_S, os._exit, (1,))
        timer.daemon = True
        timer.start()

    async def progress(self, stacks: bool = False) -> dict[str, Any]:
        return {**await super().progress(stacks), "preempted": self._preempted}

    def _works(self) -> list[Work]:
        return [] if self.host is None else [self.host.work]

    def _device(self) -> torch.device:
        from asyncflow.build import resolve_device

        device = torch.device(resolve_device(self.cfg.rollout.device))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    async def run(self, weights: Any) -> None:
        """Register (a restarted incarnation counts as a restart), then follow weights."""
        if self.host is None:
            receiver: WeightSource = weights.receiver(f"{self.name}:{os.getpid()}")
            # eager: every generator loads each version at once, so it loads as its weights
            # arrive, not when the coordinator (told by the trainer after that) says so
            eager = self.cfg.rollout.weight_sync == "eager"
            self.host = GeneratorHost(
                self.name, self.engine, self.registry, receiver, follow_source=eager
            )
            if self._initial_version:  # ``model`` is a checkpoint's policy of that version
                await adopt_version(self.engine, self._model, self._initial_version)
        await self.host.start()
        self._registered.set()
        await self.host.run()

    async def wait_version(self, version: int, timeout_s: float) -> bool:
        """True once this host's engine holds ``version`` or a newer one, False after
        ``timeout_s``: the rollout's wait for new weights, answered by the load itself (no
        report through the coordinator in between)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await within(self._registered.wait(), timeout_s)
        except TimeoutError:
            return False
        assert self.host is not None
        return await self.host.wait_version(version, max(0.0, deadline - loop.time()))

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        # A fresh incarnation serves only once registered: its version is then known
        await within(self._registered.wait(), 120.0)
        assert self.host is not None
        return await self.host.generate(prompts, params)

    async def generate_packed(
        self, flat: np.ndarray, lengths: np.ndarray, params: SamplingParams
    ) -> PackedGenerations:
        """:meth:`generate` with the prompts and the generations as flat arrays
        (``engines.packed``): what the rollout's proxy calls, a few arrays each way instead
        of three tensors per sample."""
        gens = await self.generate(unpack_prompts(flat, lengths), params)
        return pack_generations(gens)

    async def generate_packed_after(
        self,
        flat: np.ndarray,
        lengths: np.ndarray,
        params: SamplingParams,
        version: int,
        timeout_s: float,
    ) -> tuple[PackedGenerations, float] | None:
        """:meth:`generate_packed` once this host's engine holds ``version``, and the seconds
        waited (``GeneratorHost.generate_after``); None after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            await within(self._registered.wait(), timeout_s)
        except TimeoutError:
            return None
        assert self.host is not None
        prompts = unpack_prompts(flat, lengths)
        left = max(0.0, deadline - loop.time())
        got = await self.host.generate_after(prompts, params, version, left)
        if got is None:
            return None
        gens, waited = got
        return pack_generations(gens), waited + timeout_s - left

    def close(self) -> None:
        if self.host is not None:
            close = getattr(self.host.weights, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        super().close()


class RolloutActor(_Host):
    """The rollout stage, dispatching micro-batches to the generator actors."""

    def __init__(
        self,
        cfg: RunConfig,
        adapters: dict[str, type[Adapter]] | None,
        tq: TQAccess,
        coordinator: str,
        generators: list[tuple[str, str]],
        origin: float,
        model: Path,
        factories: EngineFactories,
    ) -> None:
        super().__init__(cfg, tq, origin)
        self.registry = RemoteRegistry(actor(coordinator))
        self.view = GeneratorView(self.registry)
        self.instances = [RemoteGenerator(n, actor(h), self.view) for n, h in generators]
        self.ranker = LengthRanker() if cfg.rollout.ranker else None
        # the policy's tokenizer writes the observations of multi-turn episodes (and decodes
        # the responses a colocated reward scores)
        colocate = cfg.reward.colocate
        tokenizer = None
        if cfg.episodic() or colocate:
            with fewer_collections():  # (transformers' imports)
                tokenizer = factories.tokenizer(model)
        classes = graph.adapter_classes(adapters)
        cls = classes["rollout"]
        self.adapter = graph.rollout_adapter(
            cls,
            self.instances,
            cfg,
            on_demand=self.registry.demand,
            ranker=self.ranker,
            tokenizer=tokenizer,
            remote=True,
        )
        stage: Adapter = self.adapter
        reward_fn = None
        if colocate:  # this host scores each batch (there is no reward worker)
            reward_fn = factories.reward(cfg)
            if not callable(reward_fn):
                raise TypeError(f"the reward function {reward_fn!r} is not callable")
            stage = graph.colocated(self.adapter, cfg, classes["reward"], reward_fn, tokenizer)
        self._connect()
        assert self.client is not None
        self.runners = [
            graph.runner(
                "rollout",
                stage,
                self.client,
                self.timeline,
                cfg,
                concurrency=cfg.rollout.concurrency * len(self.instances),
            )
        ]
        if reward_fn is not None and cfg.eval.every_steps:  # (the reward worker's, else)
            self.runners.append(
                graph.eval_reward_runner(
                    classes["reward"], reward_fn, tokenizer, self.client, self.timeline, cfg
                )
            )
        if cfg.eval.every_steps:
            self.runners.append(
                graph.eval_rollout_runner(
                    cls,
                    self.instances,
                    self.client,
                    self.timeline,
                    cfg,
                    on_demand=self.registry.demand,
                    tokenizer=tokenizer,
                )
            )

    def _rollouts(self) -> list[Any]:
        """The adapters that route to the instances (the rollout's, the evaluation's)."""
        adapters = [self.adapter, *(r.adapter for r in self.runners[1:])]
        return [a for a in adapters if hasattr(a, "retire")]

    async def add_generator(self, name: str, actor_name: str) -> int:
        """Generator host ``actor_name`` joins as instance ``name`` (a running job scaled
        up): routed to once it holds weights recent enough for a batch; the instances now.
        Known already: nothing changes."""

        async def add() -> int:
            if any(g.name == name for g in self.instances):
                return self._live()  # (told again: the driver re-adds after a restart)
            if not self._rollouts():
                raise TypeError(
                    f"the rollout adapter {type(self.adapter).__name__} cannot take instances "
                    "while it runs (it has no add/retire: see adapters.rollout.RolloutAdapter)"
                )
            gen = RemoteGenerator(name, actor(actor_name), self.view)
            self.instances.append(gen)
            for a in self._rollouts():
                a.add(gen)
            self.runners[0].grow(self.cfg.rollout.concurrency * self._live())
            await self.view.refresh()
            return self._live()

        return await self.on_tq_loop(add())

    async def lost_generator(self, name: str) -> None:
        """Instance ``name`` died (the driver saw it): routed nothing until it registers
        again. A batch routed to it meanwhile would wait for Ray to place it again (its node
        lost: for as long as no node has its resources), not fail over."""

        async def lost() -> None:
            self.view.lost(name)

        await self.on_tq_loop(lost())

    async def retire_generator(self, name: str, timeout_s: float) -> bool:
        """Instance ``name`` takes no new batch; returns once the calls it has finished
        (True) or after ``timeout_s`` (False: the driver stops it anyway and its calls fail
        over to the other instances, as when an instance dies)."""

        async def retire() -> bool:
            k = next(i for i, g in enumerate(self.instances) if g.name == name)
            for a in self._rollouts():
                a.retire(k)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            gen = self.instances[k]
            while gen.outstanding:
                if loop.time() > deadline:
                    return False
                await asyncio.sleep(0.05)
            return True

        return await self.on_tq_loop(retire())

    def _live(self) -> int:
        rollouts = self._rollouts()
        return len(self.instances) - (len(rollouts[0].retired) if rollouts else 0)

    async def run(self) -> None:
        await self.on_tq_loop(self._run())

    async def _run(self) -> None:
        await self.view.refresh()
        try:
            async with asyncio.TaskGroup() as tg:
                view = tg.create_task(self.view.run())
                evals = [tg.create_task(r.run()) for r in self.runners[1:]]
                await self.runners[0].run()
                if not evals:  # else the eval stage serves until the driver stops the run
                    view.cancel()
        except ExceptionGroup as eg:  # a stage failed: its StageError, as with one stage
            raise eg.exceptions[0] from None

    async def predict(self, prompts: Sequence[torch.Tensor]) -> np.ndarray:
        """The ranker's predicted response lengths (the feeder sets the length header)."""
        ranker = self.ranker
        if ranker is None:
            return np.zeros(len(prompts))

        async def predict() -> np.ndarray:  # (where the rollout trains the ranker)
            return ranker.predict(prompts)

        return await self.on_tq_loop(predict())

    async def summary(self) -> dict[str, Any]:
        async def read() -> dict[str, Any]:
            return {
                "ranker_error": self.ranker.mean_abs_log_error() if self.ranker else None,
                "migrated": getattr(self.adapter, "migrated", 0),
                "rollout_retries": getattr(self.adapter, "retries", 0),
                "lost_calls": sum(g.lost for g in self.instances),
            }

        return await self.on_tq_loop(read())


class WorkerActor(_Host):
    """One reward or reference worker: its stage over its own engine."""

    def __init__(
        self,
        role: str,
        index: int,
        cfg: RunConfig,
        model: Path,
        factories: EngineFactories,
        adapters: dict[str, type[Adapter]] | None,
        tq: TQAccess,
        origin: float,
    ) -> None:
        super().__init__(cfg, tq, origin)
        cls = graph.adapter_classes(adapters)[role]
        adapter: Adapter
        evals: list[StageRunner] = []
        if role == "reward":
            reward_fn = factories.reward(cfg)
            if not callable(reward_fn):
                raise TypeError(f"the reward function {reward_fn!r} is not callable")
            with fewer_collections():  # (transformers' imports)
                tokenizer = factories.tokenizer(model)
            adapter = graph.reward_adapter(cls, reward_fn, tokenizer, cfg)
            client = self._connect()
            if cfg.eval.every_steps:
                evals.append(
                    graph.eval_reward_runner(cls, reward_fn, tokenizer, client, self.timeline, cfg)
                )
        elif role == "reference":
            with fewer_collections():  # (transformers' imports)
                engine = factories.reference(cfg, model)
            check_engine(engine, ScoringEngine, "reference")
            adapter = graph.reference_adapter(cls, engine, cfg)
            client = self._connect()
        else:
            raise ValueError(f"a worker runs the reward or reference stage, not {role!r}")
        self.runners = [graph.runner(role, adapter, client, self.timeline, cfg), *evals]
        self._running: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        await self.on_tq_loop(self._run())

    async def _run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:  # (a stage cancelled by retire: not an error)
                self._running = [tg.create_task(r.run()) for r in self.runners]
        except ExceptionGroup as eg:  # a stage failed: its StageError, as with one stage
            raise eg.exceptions[0] from None

    async def retire(self, timeout_s: float) -> tuple[bool, int]:
        """Drain before leaving the run (``asyncflow.deploy.ray_workers``): the stages take no
        new batch and end once the batches they hold are written, then :meth:`run` returns;
        past ``timeout_s`` they are cancelled (the driver hands their leases back). Whether
        they ended in time, and the batches this host's stages processed."""

        async def retire() -> tuple[bool, int]:
            for r in self.runners:
                r.stop()
            running = [t for t in self._running if not t.done()]
            late = (await asyncio.wait(running, timeout=timeout_s))[1] if running else set()
            for t in late:
                t.cancel()
            if late:  # (ended before the driver hands their leases back: no write after it)
                await asyncio.wait(late, timeout=5.0)
            return not late, sum(r.batches for r in self.runners)

        return await self.on_tq_loop(retire())
