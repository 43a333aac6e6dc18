"""``deploy=local``: every stage an asyncio task in the driver's process.

Engines are built in the driver (or given as :class:`~asyncflow.build.Components`); the stages
share one TransferQueue client (embedded by default, or a local service); the generator
registry is a plain object on the driver's loop that reads the engines live; weights go from
trainer to generators in memory (the ``inprocess`` weight transport: the trainer's
``state_dict()`` copy, no other copy).
Checkpoints are written by the train stage's step callback in this process (the trainer's
part, in a worker thread; the rollout and the other stages keep running meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

import transferqueue
from adapters import Adapter, LengthRanker, StepReport
from asyncflow import graph
from asyncflow.build import Components, EngineFactories, build_components
from asyncflow.checkpoint import (
    CheckpointPlan,
    ResumePoint,
    adopt_version,
    check_checkpointable,
    restore_trainer,
    write_trainer_part,
)
from asyncflow.config import RunConfig
from asyncflow.deploy.base import Deployment, Job
from asyncflow.hosts import GeneratorHost, check_engine
from asyncflow.metrics import Timeline
from asyncflow.progress import host_answer
from asyncflow.registry import Registry, WeightSync
from asyncflow.stage_runner import StageRunner
from asyncflow.stall import Probe
from asyncflow.transport import WeightSender, make_transport, sync_metrics
from engines.protocols import ScoringEngine, TrainingEngine

__all__ = ["LocalDeployment", "open_transferqueue"]


def open_transferqueue(
    cfg: RunConfig,
) -> tuple[transferqueue.TransferQueue, transferqueue.LocalService | None]:
    """TransferQueue as ``transferqueue.mode`` says: embedded, a local service, or a running
    service at ``transferqueue.address``."""
    tqc = cfg.transferqueue
    if tqc.mode in ("embedded", "auto"):
        return transferqueue.start(num_units=tqc.num_units), None
    if tqc.mode == "service":
        service = transferqueue.serve(**tqc.service_options())
        try:
            return transferqueue.connect(service.address, ride_through_s=tqc.ride_through), service
        except BaseException:
            service.close()
            raise
    assert tqc.address is not None
    tq = transferqueue.connect(tqc.address, keys=tqc.keys, ride_through_s=tqc.ride_through)
    return tq, None


class LocalDeployment(Deployment):
    """Every stage in this process (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        timeline: Timeline,
        *,
        components: Components | None = None,
        factories: EngineFactories | None = None,
        adapters: dict[str, type[Adapter]] | None = None,
        checkpoint: CheckpointPlan | None = None,
        resume: ResumePoint | None = None,
    ) -> None:
        self.cfg = cfg
        self.timeline = timeline
        self._plan = checkpoint
        self._resume = resume
        self._given = components
        self._factories = factories
        self._adapters = graph.adapter_classes(adapters)
        self._comps: Components | None = None
        self._tq: transferqueue.TransferQueue | None = None
        self._service: transferqueue.LocalService | None = None
        self._reports: asyncio.Queue[StepReport] = asyncio.Queue()
        self._ranker: LengthRanker | None = None
        self._runners: list[StageRunner] = []
        self._hosts: list[GeneratorHost] = []
        self._sender: WeightSender | None = None
        self._rollout: Adapter | None = None
        self._closed = False
        self.restarts: dict[str, int] = {}
        self.restart_times: list[tuple[str, float, float]] = []
        self._syncs_seen = 0  # weight syncs handed to the driver so far

    async def open(self) -> None:
        cfg = self.cfg
        comps = self._given
        resume = self._resume
        if comps is None:
            policy = None if resume is None else resume.policy
            comps = await asyncio.to_thread(build_components, cfg, self._factories, policy=policy)
        self._comps = comps
        check_engine(comps.trainer, TrainingEngine, "train")
        if self._plan is not None:
            check_checkpointable(comps.trainer, "checkpoint.every_steps")
        if resume is not None:
            await asyncio.to_thread(restore_trainer, comps.trainer, resume.directory)
            for g in comps.generators:
                await adopt_version(g, resume.policy, resume.version)
        if comps.reference is not None:
            check_engine(comps.reference, ScoringEngine, "reference")
        if not callable(comps.reward_fn):
            raise TypeError(f"the reward function {comps.reward_fn!r} is not callable")
        self.task, self.tokenizer = comps.task, comps.tokenizer
        self._tq, self._service = open_transferqueue(cfg)
        self.client = self._tq.async_client()
        registry = Registry(comps.trainer.version, policy=cfg.rollout.weight_sync)
        self.registry = self._registry = registry
        transport = make_transport("inprocess")
        self._sender = transport.sender()
        self._hosts = [
            GeneratorHost(f"instance{i}", g, registry, transport.receiver(f"instance{i}"))
            for i, g in enumerate(comps.generators)
        ]
        for h in self._hosts:
            await h.start()
        self._ranker = LengthRanker() if cfg.rollout.ranker else None
        rollout = graph.rollout_adapter(
            self._adapters["rollout"],
            self._hosts,
            cfg,
            on_demand=registry.demand,
            on_done=registry.poke,
            ranker=self._ranker,
            tokenizer=comps.tokenizer,
        )
        self._rollout = rollout
        tl, client = self.timeline, self.client
        reward_cls = self._adapters["reward"]
        self._runners = [
            graph.runner(
                "rollout",
                graph.colocated(rollout, cfg, reward_cls, comps.reward_fn, comps.tokenizer),
                client,
                tl,
                cfg,
                concurrency=cfg.rollout.concurrency * len(self._hosts),
            ),
        ]
        if not cfg.reward.colocate:
            self._runners.append(
                graph.runner(
                    "reward",
                    graph.reward_adapter(reward_cls, comps.reward_fn, comps.tokenizer, cfg),
                    client,
                    tl,
                    cfg,
                    concurrency=cfg.reward.instances,
                )
            )
        if comps.reference is not None:
            ref = graph.reference_adapter(self._adapters["reference"], comps.reference, cfg)
            self._runners.append(graph.runner("reference", ref, client, tl, cfg))
        train = graph.train_adapter(
            self._adapters["train"],
            comps.trainer,
            cfg,
            self._on_step,
            on_filtered=registry.filter_groups,
            first_group=None if resume is None else resume.next_group,
        )
        self._runners.append(graph.runner("train", train, client, tl, cfg))
        if cfg.eval.every_steps:
            self._runners += [
                graph.eval_rollout_runner(
                    self._adapters["rollout"],
                    self._hosts,
                    client,
                    tl,
                    cfg,
                    on_demand=registry.demand,
                    on_done=registry.poke,
                    tokenizer=comps.tokenizer,
                ),
                graph.eval_reward_runner(
                    self._adapters["reward"], comps.reward_fn, comps.tokenizer, client, tl, cfg
                ),
            ]

    async def _on_step(self, report: StepReport) -> None:
        """After each optimizer step: publish the weights (generators follow at their next
        micro-batch boundary), write the trainer's part of a checkpoint when one is due
        (generators already hold the new weights; only the train stage waits), then hand
        the report to the driver."""
        assert self._comps is not None
        trainer = self._comps.trainer
        state = await asyncio.to_thread(trainer.state_dict)
        assert self._sender is not None
        self._sender.publish(state, report.version)
        report.metrics.update(sync_metrics(self._sender))
        await self._registry.publish(report.version)
        plan = self._plan
        if plan is not None and plan.due(report.step + 1):
            staging = plan.staging(report.step + 1)
            seconds = await asyncio.to_thread(write_trainer_part, trainer, staging)
            report.metrics["checkpoint_save_s"] = seconds
        self._reports.put_nowait(report)

    async def save_policy(self, directory: Path) -> None:
        assert self._comps is not None
        engine = check_checkpointable(self._comps.trainer, "saving the trained policy")
        await asyncio.to_thread(engine.save_policy, directory)

    @property
    def predict(self) -> Any:
        ranker = self._ranker
        if ranker is None:
            return None

        async def predict(prompts: Sequence[torch.Tensor]) -> np.ndarray:
            return ranker.predict(prompts)

        return predict

    def jobs(self) -> dict[str, Job]:
        jobs: dict[str, Job] = {r.name: r.run for r in self._runners}
        for h in self._hosts:
            jobs[f"rollout/{h.name} weights"] = h.run
        return jobs

    def _answer(self, host: str, *, stacks: bool = False) -> dict[str, Any]:
        """The stages (``driver``) or one generation engine (``rollout/<instance>``, with its
        child's pid where it runs in a process of its own) as a host of the stall watch."""
        if host == "driver":
            return host_answer([r.work for r in self._runners], stacks=stacks)
        h = self._generator(host)
        answer = host_answer([h.work], stacks=stacks)
        pid = getattr(h.engine, "pid", None)
        if pid is not None:
            answer["pid"] = pid
            if stacks:  # (this process's threads: the child's own cannot be read from here)
                answer["stacks"] = f"(of the driver, pid {os.getpid()})\n{answer['stacks']}"
        return answer

    def _generator(self, host: str) -> GeneratorHost:
        return {f"rollout/{h.name}": h for h in self._hosts}[host]

    async def progress(self) -> dict[str, Probe]:
        """The driver's stages as one host, and each generation engine as one (never silent:
        this process answers for them; an engine in a process of its own,
        ``rollout.engine_process``, is replaceable)."""
        out = {"driver": Probe(self._answer("driver"), 0.0, replaceable=False)}
        for h in self._hosts:
            name = f"rollout/{h.name}"
            out[name] = Probe(self._answer(name), 0.0, replaceable=h.replaceable)
        return out

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        return self._answer(host, stacks=True)

    async def replace(self, host: str) -> bool:
        """A stuck engine process is killed and started again with the weights it held
        (:meth:`~asyncflow.hosts.GeneratorHost.replace`); the stages are not replaceable."""
        if host == "driver":
            return False
        return await self._generator(host).replace()

    def instances(self) -> dict[str, int]:
        """The stages' instances (fixed in one process: the generation engines, the reward
        stage's workers, one trainer, one reference)."""
        cfg = self.cfg
        out = {"rollout": len(self._hosts), "train": 1}
        if not cfg.reward.colocate:  # (else the rollout scores)
            out["reward"] = cfg.reward.instances
        if cfg.reference.enabled:
            out["reference"] = 1
        return out

    async def next_report(self) -> StepReport:
        return await self._reports.get()

    async def collect(self) -> dict[str, dict[str, float]]:
        return {r.name: m for r in self._runners if (m := r.drain_metrics())}

    async def weight_syncs(self) -> list[WeightSync]:
        syncs, self._syncs_seen = await self._registry.weight_syncs(self._syncs_seen)
        return syncs

    async def summary(self) -> dict[str, Any]:
        stats = await self._registry.stats()
        rollout = self._rollout
        return {
            "weight_updates": stats["updates"],
            "weight_update_s": stats["update_seconds"],
            "weight_pause_s": stats["pause_s"],
            "weight_adoption_s": stats["adoption_s"],
            "restarts": stats["restarts"],
            "ranker_error": self._ranker.mean_abs_log_error() if self._ranker else None,
            "migrated": getattr(rollout, "migrated", 0),
            "rollout_retries": getattr(rollout, "retries", 0),
        }

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for r in self._runners:
            with contextlib.suppress(Exception):
                await r.adapter.close()
        if self._sender is not None:
            self._sender.close()
        for h in self._hosts:
            close = getattr(h.weights, "close", None)
            if close is not None:
                close()
        if self._tq is not None:
            self._tq.close()
        if self._service is not None:
            self._service.close()
        if self._given is None and self._comps is not None:
            self._comps.close()
