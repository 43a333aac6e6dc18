"""Trainer ranks for ``deploy=ray``: :class:`TrainerActor`, one Ray actor per data-parallel
rank (``ray.remote`` is applied in ``asyncflow.deploy.ray``). Rank 0 runs the train stage
(:class:`~asyncflow.deploy.ray_ranks.DataParallelTrain` over several ranks); how a dead rank
is replaced is in ``asyncflow.deploy.ray_ranks``.

Checkpoints (``asyncflow.checkpoint``): trainer rank 0 writes the trainer's part after the
optimizer step of a step the plan marks (ranks are identical); on resume every rank restores
from the checkpoint (:meth:`TrainerActor.restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from adapters import Adapter, StepReport
from adapters.train import TrainAdapter, token_parts, train_micro_batches
from asyncflow import graph
from asyncflow.build import EngineFactories
from asyncflow.checkpoint import (
    CheckpointPlan,
    check_checkpointable,
    restore_trainer,
    write_trainer_part,
)
from asyncflow.config import RunConfig
from asyncflow.deploy import sharded
from asyncflow.deploy.ray_hosts import TQAccess, _Host, actor
from asyncflow.deploy.ray_ranks import (
    DataParallelTrain,
    RankRestartedError,
    ranks_restartable,
    take_over,
)
from asyncflow.deploy.ray_start import fewer_collections
from asyncflow.deploy.remote import RemoteRegistry
from asyncflow.hosts import check_engine
from engines.protocols import TrainingEngine
from transferqueue import BatchMeta
from transferqueue.aio import within
from transferqueue.schema import Column

__all__ = ["TrainerActor"]

log = logging.getLogger(__name__)


def _reconstructed() -> bool:
    """Whether this actor is a replacement Ray started after its predecessor died."""
    import ray

    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


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
        with fewer_collections():  # (transformers' imports)
            self.engine: TrainingEngine = factories.trainer(cfg, model, rank)
        check_engine(self.engine, TrainingEngine, "train")
        self.registry = RemoteRegistry(actor(coordinator))
        self._adapters = adapters
        self._sender: Any = None
        self._plan: CheckpointPlan | None = None
        self._ranks: list[Any] = []
        self._sharding: sharded.Sharding | None = None  # fsdp, once joined
        self._joined = False  # in the data-parallel group (a restarted rank: not yet)
        self._working = 0  # calls into the engine in flight (quiesce waits for none)
        self._idle = asyncio.Event()
        self._idle.set()
        self.use_reference = cfg.reference.enabled
        self._connect()  # (after the engine: the servers may start meanwhile)

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

    @contextlib.asynccontextmanager
    async def _work(self) -> AsyncIterator[None]:
        self._working += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._working -= 1
            if not self._working:
                self._idle.set()

    async def quiesce(self) -> int:
        """Wait (bounded by ``deploy.start_timeout_s``) until no call into this rank's engine
        is in flight (one a dead rank 0 made, still training or failing its collective);
        returns the version held (rank 0's replacement: ``asyncflow.deploy.ray_ranks``)."""
        await within(self._idle.wait(), self.cfg.deploy.start_timeout_s)
        return int(self.engine.version)

    async def state_files(self) -> dict[str, bytes]:
        """A surviving rank's state as :meth:`write_state` writes it, as bytes, for the other
        ranks' :meth:`adopt_state` (rank 0's replacement: ``asyncflow.deploy.ray_ranks``). It
        leaves the group rank 0's death broke first: transformers writes a model's files on
        the group's rank 0 only; :meth:`regroup` forms the new one."""
        import torch.distributed as dist

        from asyncflow.deploy.ray_ranks import read_state

        def read() -> dict[str, bytes]:
            if dist.is_initialized():
                with contextlib.suppress(Exception):  # (a group with a dead peer)
                    dist.destroy_process_group()
            self._joined = False
            return read_state(self.write_state)

        return await asyncio.to_thread(read)

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
        async with self._work():
            return await self._train_part(meta, advantages, loss_scale)

    async def _train_part(
        self, meta: BatchMeta, advantages: torch.Tensor, loss_scale: float
    ) -> tuple[dict[str, float], int, int, list[int]]:
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
        return await self._train_cols(meta, cols, advantages, loss_scale)

    async def train_cols(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int, int, list[int]]:
        """:meth:`train_part` over columns already read (rank 0's own part when ranks are
        restartable; a replacement rank training the step's parts again)."""
        async with self._work():
            return await self._train_cols(meta, cols, advantages, loss_scale)

    async def _train_cols(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int, int, list[int]]:
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

        async with self._work():
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
        position = None
        if ranks and ranks_restartable(cfg) and _reconstructed():
            position = await self.registry.train_position()
            first_group = position[1]
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
                first_step=position[0] if position else None,
            )
            if position is not None:  # this rank 0 replaces a dead one
                assert isinstance(adapter, DataParallelTrain) and self.client is not None
                await take_over(adapter, self.client, *position)
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
        if ranks:  # the ranks' calls into this actor (quiesce, its own part) share its loop
            await self.runners[0].run()
        else:
            await self.on_tq_loop(self.runners[0].run())

    async def _on_step(self, report: StepReport) -> None:
        from asyncflow.transport import ReceiverFailedError, sync_metrics

        try:
            if self._sharding is not None:  # every rank gathers each bucket
                await sharded.publish(self._sharding, self._sender, self._ranks, report.version)
            else:
                await asyncio.to_thread(_publish, self.engine, self._sender, report.version)
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


def _publish(engine: Any, sender: Any, version: int) -> None:
    """The trainer's weights of ``version`` through the weight transport (one worker-thread
    hop for the state and the send)."""
    sender.publish(engine.state_dict(), version)
