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
|                |                         | (a rank)                   | stage              |

Every host opens its own TransferQueue client (``transferqueue.connect``): sample data goes
from TransferQueue to the host that needs it and back, never through the driver. The rollout
is one host that dispatches to the generators rather than one stage per generator, because
StreamRL's skew-aware dispatch (dedicated long-tail instances, migration of samples past a
length budget) needs one view of every instance's load; what it relays to a generator is the
micro-batch's token ids and what comes back the sampled tokens and log-probs (kilobytes).

Each host records its busy intervals on a :class:`~asyncflow.metrics.Timeline` with the run's
origin; the driver drains them (:meth:`drain`) into the run's timeline at every step.

Checkpoints (``asyncflow.checkpoint``): trainer rank 0 writes the trainer's part after the
optimizer step of a step the plan marks (ranks are identical); on resume every rank restores
from the checkpoint (:meth:`TrainerActor.restore`) and generator hosts start from its policy
folder at its version (``initial_version``, a constructor argument so that a host Ray
restarts starts there too). Validation adds the ``eval`` stage to the rollout host and the
``eval/reward`` stage to each reward worker, over the ``val`` partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import transferqueue
from adapters import Adapter, LengthRanker, StepReport
from adapters.train import TrainAdapter, token_parts, train_micro_batches
from asyncflow import graph
from asyncflow.build import EngineFactories
from asyncflow.checkpoint import (
    CheckpointPlan,
    adopt_version,
    check_checkpointable,
    restore_trainer,
    write_trainer_part,
)
from asyncflow.config import RunConfig
from asyncflow.deploy import sharded
from asyncflow.deploy.ray_ranks import DataParallelTrain, RankRestartedError, ranks_restartable
from asyncflow.deploy.remote import GeneratorView, RemoteGenerator, RemoteRegistry
from asyncflow.hosts import GeneratorHost, WeightSource, check_engine
from asyncflow.metrics import Timeline
from asyncflow.stage_runner import StageRunner
from engines.protocols import Generation, SamplingParams, ScoringEngine, TrainingEngine
from transferqueue import AsyncClient, BatchMeta
from transferqueue.aio import within
from transferqueue.schema import Column
from transferqueue.wire.auth import ClientKeys

__all__ = [
    "GeneratorActor",
    "RolloutActor",
    "TrainerActor",
    "WorkerActor",
    "ranks_restartable",
]

log = logging.getLogger(__name__)

Drained = tuple[dict[str, list[tuple[float, float, int, int]]], dict[str, dict[str, float]]]


def _quiet_hf() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


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
    """How a stage host reaches the run's TransferQueue: its address, and the CURVE keys
    (None on one node's loopback). Sent in the actor's arguments, so a restarted actor
    connects again the same way."""

    address: str
    keys: ClientKeys | None = None
    ride_through_s: float = 0.0  # (transferqueue.ride_through_s, resolved)


class _Host:
    """What every stage host has: where it runs, its TransferQueue client, its timeline."""

    def __init__(self, cfg: RunConfig, tq: TQAccess | None, origin: float) -> None:
        _quiet_hf()
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.timeline = Timeline(origin)
        self._tq: transferqueue.TransferQueue | None = None
        self.client: AsyncClient | None = None
        if tq is not None:
            self._tq = transferqueue.connect(
                tq.address, keys=tq.keys, ride_through_s=tq.ride_through_s, holder=_holder_name()
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
        self.runners: list[StageRunner] = []

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

    def drain(self) -> Drained:
        """Busy intervals and adapter metrics recorded since the last drain."""
        return self.timeline.drain(), {r.name: m for r in self.runners if (m := r.drain_metrics())}

    async def hold(self) -> None:
        """Returns only when the actor dies (the driver watches hosts without a stage of
        their own through it)."""
        await asyncio.Event().wait()

    def close(self) -> None:
        if self._tq is not None:
            self._tq.close()
            self._tq = None


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
        self.engine = factories.generator(cfg, model, index)
        self.registry = RemoteRegistry(actor(coordinator))
        self.host: GeneratorHost | None = None
        self._registered = asyncio.Event()

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
            self.host = GeneratorHost(self.name, self.engine, self.registry, receiver)
            if self._initial_version:  # ``model`` is a checkpoint's policy of that version
                await adopt_version(self.engine, self._model, self._initial_version)
        await self.host.start()
        self._registered.set()
        await self.host.run()

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        # A fresh incarnation serves only once registered: its version is then known
        await within(self._registered.wait(), 120.0)
        assert self.host is not None
        return await self.host.generate(prompts, params)

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
        # the policy's tokenizer writes the observations of multi-turn episodes
        tokenizer = factories.tokenizer(model) if cfg.episodic() else None
        cls = graph.adapter_classes(adapters)["rollout"]
        self.adapter = graph.rollout_adapter(
            cls,
            self.instances,
            cfg,
            on_demand=self.registry.demand,
            ranker=self.ranker,
            tokenizer=tokenizer,
        )
        assert self.client is not None
        self.runners = [
            graph.runner(
                "rollout",
                self.adapter,
                self.client,
                self.timeline,
                cfg,
                concurrency=cfg.rollout.concurrency * len(self.instances),
            )
        ]
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

    async def run(self) -> None:
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
        if self.ranker is None:
            return np.zeros(len(prompts))
        return self.ranker.predict(prompts)

    def summary(self) -> dict[str, Any]:
        return {
            "ranker_error": self.ranker.mean_abs_log_error() if self.ranker else None,
            "migrated": getattr(self.adapter, "migrated", 0),
            "rollout_retries": getattr(self.adapter, "retries", 0),
            "lost_calls": sum(g.lost for g in self.instances),
        }


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
        assert self.client is not None
        evals: list[StageRunner] = []
        if role == "reward":
            reward_fn = factories.reward(cfg)
            if not callable(reward_fn):
                raise TypeError(f"the reward function {reward_fn!r} is not callable")
            tokenizer = factories.tokenizer(model)
            adapter = graph.reward_adapter(cls, reward_fn, tokenizer, cfg)
            if cfg.eval.every_steps:
                evals.append(
                    graph.eval_reward_runner(
                        cls, reward_fn, tokenizer, self.client, self.timeline, cfg
                    )
                )
        elif role == "reference":
            engine = factories.reference(cfg, model)
            check_engine(engine, ScoringEngine, "reference")
            adapter = graph.reference_adapter(cls, engine, cfg)
        else:
            raise ValueError(f"a worker runs the reward or reference stage, not {role!r}")
        self.runners = [graph.runner(role, adapter, self.client, self.timeline, cfg), *evals]

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for r in self.runners:
                    tg.create_task(r.run())
        except ExceptionGroup as eg:  # a stage failed: its StageError, as with one stage
            raise eg.exceptions[0] from None


class TrainerActor(_Host):
    """One data-parallel rank of the trainer; rank 0 runs the train stage."""

    def __init__(
        self,
        rank: int,
        cfg: RunConfig,
        model: Path,
        factories: EngineFactories,
        adapters: dict[str, type[Adapter]] | None,
        tq: TQAccess,
        coordinator: str,
        origin: float,
    ) -> None:
        super().__init__(cfg, tq, origin)
        self.rank = rank
        self.engine: TrainingEngine = factories.trainer(cfg, model, rank)
        check_engine(self.engine, TrainingEngine, "train")
        self.registry = RemoteRegistry(actor(coordinator))
        self._adapters = adapters
        self._sender: Any = None
        self._plan: CheckpointPlan | None = None
        self._ranks: list[Any] = []
        self._sharding: sharded.Sharding | None = None  # fsdp, once joined
        self._joined = False  # in the data-parallel group (a restarted rank: not yet)
        self.use_reference = cfg.reference.enabled

    # -- data-parallel group ----------------------------------------------------------------
    def endpoint(self) -> tuple[str, int]:
        """An address and a free port on this rank's node (rank 0 hosts the rendezvous)."""
        import ray

        from engines.distributed import free_port

        ip = str(ray.util.get_node_ip_address())
        return ip, free_port(ip)

    def _device(self) -> torch.device:
        module = getattr(self.engine, "model", None)
        if isinstance(module, torch.nn.Module):
            return next(module.parameters()).device
        return super()._device()

    async def join(self, world: int, address: str, port: int) -> None:
        """Join the data-parallel group: every rank starts from rank 0's weights (``ddp``),
        or the model and optimizer are sharded over the ranks (``fsdp``)."""
        from engines.distributed import backend_for, broadcast_parameters, init_group

        module = self._module()
        backend = backend_for(next(module.parameters()).device)
        sharding = sharded.sharding(self.engine, self.cfg, self._device())

        def setup() -> None:
            init_group(self.rank, world, address, port, backend=backend)
            if sharding is not None:  # every rank loaded the same weights: shard them
                sharding.engine.shard(sharding.config)
            else:
                broadcast_parameters(module)

        await asyncio.to_thread(setup)
        self._sharding = sharding
        self._joined = True

    async def regroup(self, world: int, address: str, port: int) -> None:
        """Leave the group a dead rank broke and form a new one with its replacement (every
        rank at once, called by rank 0's recovery: ``asyncflow.deploy.ray_ranks``). The
        weights are not broadcast: the replacement adopted rank 0's state before."""
        import torch.distributed as dist

        from engines.distributed import backend_for, init_group

        backend = backend_for(self._device())

        def setup() -> None:
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # (a group with a dead peer)
                    dist.destroy_process_group()
            init_group(self.rank, world, address, port, backend=backend)

        await asyncio.to_thread(setup)
        self._joined = True

    def version(self) -> int:
        return int(self.engine.version)

    def digest(self) -> tuple[int, str]:
        """This rank's version and a hash of its weights (ddp replicas hold the same: the
        fault tests compare them after a rank was replaced)."""
        import hashlib

        h = hashlib.sha256()
        for name, t in sorted(self.engine.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return int(self.engine.version), h.hexdigest()

    def write_state(self, directory: Path) -> None:
        """This rank's state (weights, optimizer, version, RNGs) in the checkpoint format,
        into ``directory`` (rank 0, for a replacement rank: see :meth:`adopt_state`)."""
        write_trainer_part(self.engine, directory)

    async def adopt_state(self, files: dict[str, bytes]) -> int:
        """A replacement rank: take rank 0's state (the files of :meth:`write_state`); returns
        the version it now holds."""
        from asyncflow.deploy.ray_ranks import write_state

        await asyncio.to_thread(write_state, files, functools.partial(restore_trainer, self.engine))
        return int(self.engine.version)

    def _check_joined(self) -> None:
        if self.cfg.train.dp_size > 1 and not self._joined:
            raise RankRestartedError(
                f"trainer rank {self.rank} was restarted and has not joined the group yet"
            )

    def _module(self) -> torch.nn.Module:
        module = getattr(self.engine, "model", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"train.dp_size > 1 needs a training engine with a torch ``model`` attribute "
                f"(gradients are all-reduced over it); {type(self.engine).__name__} has none"
            )
        return module

    async def train_part(
        self, meta: BatchMeta, advantages: torch.Tensor, loss_scale: float
    ) -> tuple[dict[str, float], int, int, list[int]]:
        """Read this rank's part of a micro-batch and accumulate its gradients (in calls of at
        most ``train.max_tokens_per_micro_batch`` tokens); returns (metrics, response tokens,
        rows, prompt + response tokens of each engine call)."""
        self._check_joined()
        sharding = self._sharding
        if not len(meta):  # fewer rows than ranks: nothing here this time
            if sharding is not None:  # ... but the collectives of the others' calls
                most = await sharded.calls_to_make(sharding, 0)
                await sharded.empty_calls(sharding, most, loss_scale)
            return {}, 0, 0, []
        assert self.client is not None
        fields = ["prompt_ids", "response_ids", "behaviour_logprobs", "loss_mask", "token_versions"]
        if self.use_reference:
            fields.append("ref_logprobs")
        cols = await self.client.get_data(meta, fields)
        return await self.train_cols(meta, cols, advantages, loss_scale)

    async def train_cols(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int, int, list[int]]:
        """:meth:`train_part` over columns already read (rank 0's own part when ranks are
        restartable; a replacement rank training the step's parts again)."""
        self._check_joined()
        sharding = self._sharding
        if not len(meta):
            return {}, 0, 0, []
        max_tokens = self.cfg.train.max_tokens_per_micro_batch
        most = 0
        if sharding is not None:  # agreed before any call (each call is collective)
            parts = token_parts(cols, len(meta), max_tokens)[1]
            most = await sharded.calls_to_make(sharding, len(parts))
        metrics, tokens, calls = await train_micro_batches(
            self.engine,
            meta,
            cols,
            advantages,
            loss_scale,
            use_reference=self.use_reference,
            max_tokens=max_tokens,
        )
        if sharding is not None:
            await sharded.empty_calls(sharding, most - len(calls), loss_scale)
        return metrics, tokens, len(meta), calls

    async def optimizer_step(self, atomic: bool = False) -> dict[str, float]:
        """Sum the gradients over the ranks (when there are several), then step. ``atomic``:
        a failed all-reduce leaves this rank's gradients its own (restartable ranks)."""
        from engines.distributed import all_reduce_gradients

        self._check_joined()

        def step() -> dict[str, float]:
            import torch.distributed as dist

            if dist.is_initialized() and self._sharding is None:  # fsdp reduced them already
                all_reduce_gradients(self._module(), atomic=atomic)
            return self.engine.optimizer_step()

        return await asyncio.to_thread(step)

    async def restore(self, directory: str) -> int:
        """Load a checkpoint's trainer part (every rank; before :meth:`join`, or after it when
        sharded: the shards load into the sharded model); returns the restored version."""
        await asyncio.to_thread(restore_trainer, self.engine, directory)
        return int(self.engine.version)

    async def gather_weights(self, bucket_bytes: int) -> None:
        """Ranks 1..: take part in rank 0's publish of sharded weights (each bucket is
        gathered on every rank)."""
        assert self._sharding is not None, "gather_weights is for sharded trainers"
        await asyncio.to_thread(sharded.take_part, self._sharding.engine, bucket_bytes)

    async def save_part(self, directory: str) -> None:
        """Ranks 1..: write this rank's shards of a sharded checkpoint, beside rank 0's
        :func:`~asyncflow.checkpoint.write_trainer_part` (which writes the rest)."""
        await asyncio.to_thread(check_checkpointable(self.engine, "checkpoints").save, directory)

    # -- rank 0 ---------------------------------------------------------------------------
    async def run(
        self,
        ranks: list[Any],
        weights: Any,
        checkpoint: CheckpointPlan | None = None,
        first_group: int | None = None,
    ) -> None:
        """Rank 0: the train stage (from ``first_group`` on: a resumed run's next group).
        After each step the weights are published through the weight transport, the
        trainer's part of a checkpoint written when one is due, then the coordinator learns
        the version and the report. Filtered groups go to the coordinator as they happen."""
        if self.rank != 0:
            raise RuntimeError("only trainer rank 0 runs the train stage")
        if checkpoint is not None:
            check_checkpointable(self.engine, "checkpoint.every_steps")
        self._plan = checkpoint
        if self._sender is None:
            self._sender = weights.sender()
        self._ranks = list(ranks)
        cls = graph.adapter_classes(self._adapters)["train"]
        cfg = self.cfg
        if ranks:
            if not issubclass(cls, TrainAdapter):
                raise TypeError("train.dp_size > 1 needs the train adapter to be a TrainAdapter")
            adapter: Adapter = graph.train_adapter(
                DataParallelTrain,
                self.engine,
                cfg,
                self._on_step,
                on_filtered=self.registry.filter_groups,
                first_group=first_group,
                ranks=ranks,
                local=self,
                restartable=ranks_restartable(cfg),
                restart_timeout_s=cfg.deploy.start_timeout_s,
                run_cfg=cfg,
            )
        else:
            adapter = graph.train_adapter(
                cls,
                self.engine,
                cfg,
                self._on_step,
                on_filtered=self.registry.filter_groups,
                first_group=first_group,
            )
        assert self.client is not None
        self.runners = [graph.runner("train", adapter, self.client, self.timeline, cfg)]
        await self.runners[0].run()

    async def _on_step(self, report: StepReport) -> None:
        from asyncflow.transport import ReceiverFailedError, sync_metrics

        try:
            if self._sharding is not None:  # every rank gathers each bucket
                await sharded.publish(self._sharding, self._sender, self._ranks, report.version)
            else:
                state = await asyncio.to_thread(self.engine.state_dict)
                await asyncio.to_thread(self._sender.publish, state, report.version)
        except ReceiverFailedError as e:
            # the version reached every other receiver; the failed ones were dropped, and a
            # restarted generator rejoins and gets the newest version by itself
            log.warning("weights version %d missed some generators: %s", report.version, e)
        report.metrics.update(sync_metrics(self._sender))
        await self.registry.publish(report.version)
        plan = self._plan
        if plan is not None and plan.due(report.step + 1):
            staging = plan.staging(report.step + 1)
            write = asyncio.to_thread(write_trainer_part, self.engine, staging)
            if self._sharding is not None:  # every rank writes its shards
                parts = [r.save_part.remote(str(staging)) for r in self._ranks]
                seconds, *_ = await asyncio.gather(write, *parts)
            else:
                seconds = await write
            report.metrics["checkpoint_save_s"] = seconds
        await self.registry.step_done(report)

    async def save_policy(self, directory: str) -> None:
        """The trained policy's model files into ``directory`` (rank 0; every rank when
        sharded: the policy is gathered a bucket at a time, rank 0 writes it)."""
        engine = check_checkpointable(self.engine, "saving the trained policy")
        await asyncio.to_thread(engine.save_policy, directory)

    def close(self) -> None:
        if self._sender is not None:
            with contextlib.suppress(Exception):
                self._sender.close()
        super().close()
