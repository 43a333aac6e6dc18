"""The asynchronous GRPO workflow: every stage exchanges data only through TransferQueue.

    prompts (feeder) -> rollout -> reward -> [reference] -> train
                          ^                                   |
                          +------- deferred weight sync -------+

Stages are independent loops over TransferQueue (``asyncflow.stage``); the feeder admits
groups under the staleness bound (``asyncflow.feeder``); the train stage publishes weights
after each step and the generators pick them up at their next micro-batch boundary
(``asyncflow.weights``). The run ends after ``train.steps`` optimizer steps. If any part
fails, every stage is stopped, TransferQueue is closed and the error is raised (as
:class:`StageError` naming the stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

import transferqueue
from adapters import (
    Adapter,
    LengthAwareRouter,
    LengthRanker,
    ReferenceAdapter,
    RewardAdapter,
    RolloutAdapter,
    StepReport,
    TrainAdapter,
)
from asyncflow.build import Components, build_components
from asyncflow.config import RunConfig, config_to_dict
from asyncflow.feeder import PromptFeeder
from asyncflow.metrics import MetricsWriter, Timeline, plot_rewards, staleness_histogram
from asyncflow.stage import StageError, StageRunner
from asyncflow.weights import WeightSync
from engines.protocols import SamplingParams
from transferqueue import AsyncClient

__all__ = ["RunResult", "Workflow", "run"]

log = logging.getLogger(__name__)

PARTITION = "train"


@dataclass
class RunResult:
    """What a finished run returns (the same numbers are in ``output_dir``)."""

    records: list[dict[str, Any]]
    reports: list[StepReport]
    admission: list[tuple[int, int]]
    timeline: Timeline
    output_dir: Path
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def reward_first_last(self, fraction: float = 0.1) -> tuple[float, float]:
        """Mean reward over the first and the last ``fraction`` of the steps."""
        rewards = [r["reward"] for r in self.records if math.isfinite(r["reward"])]
        k = max(1, int(len(rewards) * fraction))
        return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


class Workflow:
    """One run of the GRPO graph.

    ``components`` overrides what the config would build (your own engines);
    ``adapters`` overrides adapter classes by role (``rollout``, ``reward``, ``reference``,
    ``train``) with subclasses that take the same constructor arguments.
    """

    def __init__(
        self,
        config: RunConfig,
        components: Components | None = None,
        *,
        adapters: dict[str, type[Adapter]] | None = None,
    ) -> None:
        self.config = config
        self._components = components
        unknown = set(adapters or {}) - {"rollout", "reward", "reference", "train"}
        if unknown:
            raise ValueError(
                f"unknown adapter roles {sorted(unknown)}; roles: rollout, reward, reference, train"
            )
        self.adapters: dict[str, Any] = {
            "rollout": RolloutAdapter,
            "reward": RewardAdapter,
            "reference": ReferenceAdapter,
            "train": TrainAdapter,
            **(adapters or {}),
        }

    def run(self) -> RunResult:
        return asyncio.run(self.run_async())

    async def run_async(self) -> RunResult:
        cfg = self.config
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        out_dir = Path(cfg.output.dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        comps = self._components
        if comps is None:
            comps = await asyncio.to_thread(build_components, cfg)
        tq, service = _open_transferqueue(cfg)
        writer = MetricsWriter(
            out_dir,
            total_steps=cfg.train.steps,
            tensorboard=cfg.output.tensorboard,
            progress=cfg.output.progress,
        )
        try:
            return await self._run(cfg, comps, tq.async_client(), writer, out_dir)
        finally:
            writer.close()
            tq.close()
            if service is not None:
                service.close()
            if self._components is None:
                comps.close()

    async def _run(
        self,
        cfg: RunConfig,
        comps: Components,
        client: AsyncClient,
        writer: MetricsWriter,
        out_dir: Path,
    ) -> RunResult:
        t_start = time.perf_counter()
        n, b = cfg.rollout.group_size, cfg.train.groups_per_step
        tasks = ["rollout", "reward", *(["reference"] if comps.reference else []), "train"]
        await client.declare_tasks(tasks, partition=PARTITION)
        timeline = Timeline()
        sync = WeightSync(initial_version=comps.trainer.version, policy=cfg.rollout.weight_sync)
        for g in comps.generators:
            sync.register(g)
        done = asyncio.Event()
        reports: list[StepReport] = []
        last_t = [0.0]

        async def on_step(report: StepReport) -> None:
            state = await asyncio.to_thread(comps.trainer.state_dict)
            sync.publish(state, report.version)
            now = timeline.now()
            stats = await client.stats()
            tq_tasks = stats["controller"]["partitions"][PARTITION]["tasks"]
            record = _record(report, timeline, last_t[0], now, tq_tasks, sync)
            last_t[0] = now
            reports.append(report)
            writer.write(record)
            if len(reports) >= cfg.train.steps:
                done.set()

        params = SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
        )
        lease_s = cfg.transferqueue.lease_s
        rc = cfg.rollout
        ranker = LengthRanker() if rc.ranker else None
        rollout = self.adapters["rollout"](
            comps.generators,
            params,
            batch_size=rc.micro_batch_groups * n,
            router=(
                LengthAwareRouter(range(rc.long_instances), long_capacity=rc.long_capacity or 2 * n)
                if rc.long_instances
                else None
            ),
            migrate_after=rc.migrate_after,
            on_demand=sync.demand,
            on_done=sync.poke,
            ranker=ranker,
            sampler="group" if rc.longest_first else "fifo",
            sampler_options=(
                {"group_size": n, "order": "length", "window": b} if rc.longest_first else None
            ),
            version_field="min_gen_version",
        )
        runners = [
            StageRunner(
                "rollout",
                rollout,
                client,
                timeline,
                concurrency=rc.concurrency * len(comps.generators),
                partition=PARTITION,
                lease_s=lease_s,
            )
        ]
        runners.append(
            StageRunner(
                "reward",
                self.adapters["reward"](
                    comps.reward_fn, comps.tokenizer, batch_size=cfg.reward.batch_size
                ),
                client,
                timeline,
                partition=PARTITION,
                lease_s=lease_s,
            )
        )
        if comps.reference is not None:
            runners.append(
                StageRunner(
                    "reference",
                    self.adapters["reference"](
                        comps.reference, batch_size=cfg.reference.batch_size
                    ),
                    client,
                    timeline,
                    partition=PARTITION,
                    lease_s=lease_s,
                )
            )
        train = self.adapters["train"](
            comps.trainer,
            group_size=n,
            groups_per_step=b,
            micro_batch_groups=cfg.train.micro_batch_groups,
            use_reference=comps.reference is not None,
            on_step=on_step,
            first_step=comps.trainer.version,
        )
        runners.append(
            StageRunner("train", train, client, timeline, partition=PARTITION, lease_s=lease_s)
        )
        feeder = PromptFeeder(
            client,
            comps.task,
            comps.tokenizer,
            sync,
            group_size=n,
            groups_per_step=b,
            max_staleness=cfg.train.max_staleness,
            total_groups=cfg.train.steps * b,
            partition=PARTITION,
            ranker=ranker,
        )
        sync.start()
        jobs: dict[asyncio.Task[None], str] = {}
        loop = asyncio.get_running_loop()
        jobs[loop.create_task(feeder.run())] = "feeder"
        for r in runners:
            jobs[loop.create_task(r.run())] = r.name
        finished = loop.create_task(done.wait())
        try:
            pending: set[asyncio.Task[Any]] = {*jobs, finished}
            while not done.is_set():
                ready, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in ready:
                    if t is finished or t.cancelled():
                        continue
                    exc = t.exception()
                    if exc is not None:
                        if isinstance(exc, StageError):
                            raise exc
                        raise StageError(jobs[t], exc) from exc
                if not done.is_set() and not (pending - {finished}):
                    raise RuntimeError("every stage ended before the last train step")
        finally:
            for t in [*jobs, finished]:
                t.cancel()
            for t in [*jobs, finished]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await sync.close()
            for r in runners:
                with contextlib.suppress(Exception):
                    await r.adapter.close()
        wall = time.perf_counter() - t_start
        (out_dir / "timeline.json").write_text(json.dumps(timeline.to_json()))
        result = RunResult(
            records=writer.records,
            reports=reports,
            admission=feeder.admission_log,
            timeline=timeline,
            output_dir=out_dir,
            wall_s=wall,
            extra={
                "weight_updates": sync.updates,
                "weight_update_s": sync.update_seconds,
                "ranker_error": ranker.mean_abs_log_error() if ranker else None,
                "migrated": getattr(rollout, "migrated", 0),
                "weight_adoption_s": list(sync.adoption_s),
            },
        )
        if cfg.output.plot and writer.records:
            plot_rewards({"reward": writer.records}, out_dir / "reward.png", _title(cfg))
        return result


def _title(cfg: RunConfig) -> str:
    return (
        f"GRPO {cfg.task.name}, {cfg.model.name} model, {cfg.rollout.engine} rollout, "
        f"max_staleness={cfg.train.max_staleness}"
    )


def _record(
    report: StepReport,
    timeline: Timeline,
    since: float,
    now: float,
    tq_tasks: dict[str, Any],
    sync: WeightSync,
) -> dict[str, Any]:
    st = report.staleness
    record: dict[str, Any] = {
        "step": report.step,
        "reward": report.reward_mean,
        "reward_std": report.reward_std,
        "version": report.version,
        "samples": report.samples,
        "tokens": report.tokens,
        "time_s": now,
        "step_s": now - since,
        "staleness_max": max(st) if st else 0,
        "staleness_mean": sum(st) / len(st) if st else 0.0,
        "staleness_hist": staleness_histogram(st),
        "generator_version": sync.generator_version(),
        "stages": timeline.summary(since, now),
        "queue": {k: {"queued": v["queued"], "waiting": v["waiting"]} for k, v in tq_tasks.items()},
    }
    for k, v in report.metrics.items():  # engine scalars; never shadow the run's own fields
        record.setdefault(k if k not in record else f"engine_{k}", v)
    return record


def _open_transferqueue(
    cfg: RunConfig,
) -> tuple[transferqueue.TransferQueue, transferqueue.LocalService | None]:
    tqc = cfg.transferqueue
    if tqc.mode == "embedded":
        return transferqueue.start(num_units=tqc.num_units), None
    if tqc.mode == "service":
        service = transferqueue.serve(num_units=tqc.num_units)
        try:
            return transferqueue.connect(service.address), service
        except BaseException:
            service.close()
            raise
    assert tqc.address is not None
    return transferqueue.connect(tqc.address), None


def run(
    config: RunConfig,
    components: Components | None = None,
    *,
    adapters: dict[str, type[Adapter]] | None = None,
) -> RunResult:
    """Run a workflow to completion (blocking); see :class:`Workflow` for the arguments."""
    return Workflow(config, components, adapters=adapters).run()
