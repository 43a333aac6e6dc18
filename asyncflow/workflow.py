"""The asynchronous GRPO workflow: every stage exchanges data only through TransferQueue.

    prompts (feeder) -> rollout -> reward -> [reference] -> train
                          ^                                   |
                          +------- deferred weight sync -------+

Stages are independent loops over TransferQueue (``asyncflow.stage_runner``, built the same way in
every deployment by ``asyncflow.graph``); the feeder admits groups under the staleness bound
(``asyncflow.feeder``); the train stage publishes weights after each step and the generators
pick them up at their next micro-batch boundary, when the registry's policy says so
(``asyncflow.registry``, ``asyncflow.hosts``). Where the stages run is the deployment's
business (``asyncflow.deploy``: this process, or Ray actors); this process stays the run's
single controller either way: it runs the feeder, takes the step reports and writes the
records. The run ends after ``train.steps`` optimizer steps. If any part fails, every stage is
stopped, TransferQueue is closed and the error is raised (as :class:`StageError` naming the
stage). Rows a dead TransferQueue storage unit takes are not a failure: their groups are
regenerated (:func:`_regenerate_lost`) and each is trained once, whole. With
``train.dynamic_sampling`` the train stage filters the groups whose rewards all tie and the
feeder admits one more group per filtered one (each record's ``groups_filtered`` and
``filtered``; a checkpoint lists them, so a resumed run neither trains nor counts them).

Around the steps, the driver also: evaluates the policy on held-out prompts every
``eval.every_steps`` steps (``asyncflow.evaluation``), writes each step's record once its
evaluation is in (records stay in step order; training does not wait), completes the
checkpoints the trainer staged (``asyncflow.checkpoint``), resumes from one (``resume``), and
saves the trained policy as a Hugging Face folder, ``output.dir/policy``, when the run ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from adapters import Adapter, StepReport
from asyncflow import checkpoint, graph
from asyncflow.build import Components, EngineFactories
from asyncflow.checkpoint import CheckpointPlan, DriverState, ResumePoint
from asyncflow.config import RunConfig
from asyncflow.config.load import config_to_dict
from asyncflow.deploy.base import Deployment
from asyncflow.deploy.local import LocalDeployment
from asyncflow.evaluation import Evaluator
from asyncflow.feeder import PromptFeeder
from asyncflow.graph import EVAL_PARTITION, PARTITION
from asyncflow.loggers import make_loggers
from asyncflow.metrics import (
    MetricsWriter,
    Timeline,
    plot_rewards,
    staleness_histogram,
    sync_metrics,
    version_metrics,
    write_timeline,
)
from asyncflow.stage_runner import LOST_SERVER_HINT, StageError
from transferqueue import AsyncClient

__all__ = ["RunResult", "Workflow", "run"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run returns (the same numbers are in ``output_dir``).

    A resumed run's ``records`` and ``admission`` include those of the run it resumed (up to
    the checkpoint); ``reports`` are this process's steps only.
    """

    records: list[dict[str, Any]]
    reports: list[StepReport]
    admission: list[tuple[int, int]]
    timeline: Timeline
    output_dir: Path
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    policy_dir: Path | None = None
    """The trained policy as a Hugging Face folder (None: the training engine cannot save)."""

    def reward_first_last(self, fraction: float = 0.1) -> tuple[float, float]:
        """Mean reward over the first and the last ``fraction`` of the steps."""
        rewards = [r["reward"] for r in self.records if math.isfinite(r["reward"])]
        k = max(1, int(len(rewards) * fraction))
        return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


class Workflow:
    """One run of the GRPO graph; this process is its driver (the single controller).

    ``components`` overrides what the config would build (your own engines, ``deploy=local``
    only); ``factories`` says how each role's engine is built wherever it lives (any
    deployment); ``adapters`` overrides adapter classes by role (``rollout``, ``reward``,
    ``reference``, ``train``) with subclasses that take the same constructor arguments.
    """

    def __init__(
        self,
        config: RunConfig,
        components: Components | None = None,
        *,
        factories: EngineFactories | None = None,
        adapters: dict[str, type[Adapter]] | None = None,
    ) -> None:
        self.config = config
        self._components = components
        self._factories = factories
        graph.adapter_classes(adapters)  # unknown roles fail here, before anything starts
        self._adapters = adapters
        if components is not None and config.deploy.mode != "local":
            raise ValueError(
                f"components= (engines built in this process) needs deploy.mode=local, got "
                f"{config.deploy.mode!r}; give factories= (how to build each engine) instead"
            )

    def run(self) -> RunResult:
        return asyncio.run(self.run_async())

    def _deployment(
        self, timeline: Timeline, plan: CheckpointPlan | None, resume: ResumePoint | None
    ) -> Deployment:
        cfg = self.config
        if cfg.deploy.mode == "local":
            return LocalDeployment(
                cfg,
                timeline,
                components=self._components,
                factories=self._factories,
                adapters=self._adapters,
                checkpoint=plan,
                resume=resume,
            )
        from asyncflow.deploy.ray import RayDeployment

        return RayDeployment(
            cfg,
            timeline,
            factories=self._factories,
            adapters=self._adapters,
            checkpoint=plan,
            resume=resume,
        )

    async def run_async(self) -> RunResult:
        cfg = self.config
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        found = _resume_state(cfg)
        state = None if found is None else found[1]
        out_dir = Path(cfg.output.dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        # a resumed run's clock goes on from the checkpoint's run time
        timeline = Timeline(None if state is None else time.time() - state.elapsed_s)
        writer = MetricsWriter(
            out_dir,
            total_steps=cfg.train.steps,
            loggers=make_loggers(cfg.output, config_to_dict(cfg)),
            progress=cfg.output.progress,
            previous=state.records if state is not None else (),
        )
        plan = CheckpointPlan.of(cfg)
        resume = None
        if found is not None:
            resume = ResumePoint(str(found[0]), found[1].version, found[1].next_group)
        try:
            async with self._deployment(timeline, plan, resume) as deployment:
                return await self._drive(cfg, deployment, writer, out_dir, plan, state)
        finally:
            writer.close()

    async def _drive(
        self,
        cfg: RunConfig,
        dep: Deployment,
        writer: MetricsWriter,
        out_dir: Path,
        plan: CheckpointPlan | None,
        state: DriverState | None,
    ) -> RunResult:
        t_start = time.perf_counter()
        timeline, client = dep.timeline, dep.client
        b = cfg.train.groups_per_step
        first_step = 0 if state is None else state.steps
        await client.declare_tasks(graph.tasks(cfg), partition=PARTITION)
        evaluator: Evaluator | None = None
        if cfg.eval.every_steps:
            await client.declare_tasks(graph.eval_tasks(cfg), partition=EVAL_PARTITION)
            evaluator = Evaluator(cfg, client, dep.tokenizer)
        reports: list[StepReport] = []
        feeder = PromptFeeder(
            client,
            dep.task,
            dep.tokenizer,
            dep.registry,
            group_size=cfg.rollout.group_size,
            groups_per_step=b,
            max_staleness=cfg.train.max_staleness,
            total_groups=cfg.train.steps * b,
            partition=PARTITION,
            predict=dep.predict,
            start=0 if state is None else state.next_group,  # the TransferQueue is new
            admission_log=None if state is None else state.admission,
            dynamic_sampling=cfg.train.dynamic_sampling,
            filtered_before=0 if state is None else len(state.filtered),
        )
        filtered: list[int] = [] if state is None else list(state.filtered)
        steps = range(first_step, cfg.train.steps)
        Pending = tuple[StepReport, dict[str, Any], "asyncio.Future[dict[str, float]] | None"]
        pending: asyncio.Queue[Pending] = asyncio.Queue()
        config = config_to_dict(cfg)

        async def bookkeeping() -> None:
            """Step reports -> records (and evaluations started), until the last step."""
            last_t = timeline.now()
            for _ in steps:
                report = await dep.next_report()
                stage_metrics = await dep.collect()
                now = timeline.now()
                stats = await client.stats()
                tq_tasks = stats["controller"]["partitions"][PARTITION]["tasks"]
                versions = await dep.registry.admission_view()
                record = _record(report, timeline, last_t, now, tq_tasks, versions[0])
                record["stage_metrics"] = stage_metrics
                record["restarts"] = sum(dep.restarts.values())
                record.update(
                    version_metrics(
                        report.step,
                        report.sample_versions,
                        report.newest_versions,
                        report.ended_versions,
                    )
                )
                record.update(sync_metrics(await dep.weight_syncs()))
                last_t = now
                reports.append(report)
                done = None
                if evaluator is not None and evaluator.due(report.step + 1):
                    done = await evaluator.start(report.version)
                pending.put_nowait((report, record, done))

        async def recording() -> None:
            """Records in step order, each once its evaluation is in, then the checkpoint
            due after its step."""
            for _ in steps:
                report, record, done = await pending.get()
                if done is not None:
                    assert evaluator is not None
                    record["eval"] = await evaluator.result(done, report.step)
                writer.write(record)
                done_steps = report.step + 1
                filtered.extend(report.filtered)
                if plan is not None and plan.due(done_steps):
                    # every group before the step's next one was consumed: trained, filtered
                    nxt = report.next_group if report.next_group >= 0 else done_steps * b
                    part = DriverState(
                        steps=done_steps,
                        version=report.version,
                        next_group=nxt,
                        admission=[a for a in feeder.admission_log if a[0] < nxt],
                        elapsed_s=float(record["time_s"]),
                        records=list(writer.records),
                        filtered=list(filtered),
                    )
                    path = await asyncio.to_thread(
                        checkpoint.commit, plan, part, dep.tokenizer, config
                    )
                    log.info("checkpoint after step %d: %s", report.step, path)

        loop = asyncio.get_running_loop()
        jobs: dict[asyncio.Task[None], str] = {loop.create_task(feeder.run()): "feeder"}
        jobs[loop.create_task(bookkeeping())] = "driver"
        if evaluator is not None:
            jobs[loop.create_task(evaluator.collect())] = "eval"
        for name, job in dep.jobs().items():
            jobs[loop.create_task(job())] = name
        watch = loop.create_task(_regenerate_lost(client, feeder, PARTITION))
        jobs[watch] = "transferqueue"
        finished = loop.create_task(recording())
        try:
            pending_tasks: set[asyncio.Task[Any]] = {*jobs, finished}
            while not finished.done():
                ready, pending_tasks = await asyncio.wait(
                    pending_tasks, return_when=asyncio.FIRST_COMPLETED
                )
                for t in ready:
                    if t.cancelled():
                        continue
                    exc = t.exception()
                    if exc is not None:
                        if isinstance(exc, StageError):
                            raise exc
                        raise StageError(jobs.get(t, "driver"), exc) from exc
                if not finished.done() and not (pending_tasks - {finished, watch}):  # never ends
                    raise RuntimeError("every stage ended before the last train step")
        finally:
            for t in [*jobs, finished]:
                t.cancel()
            for t in [*jobs, finished]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
        await dep.collect()
        policy_dir = await _save_policy(dep, out_dir / "policy", cfg.train.steps)
        wall = time.perf_counter() - t_start
        write_timeline(timeline, out_dir, writer.records)
        result = RunResult(
            records=writer.records,
            reports=reports,
            admission=feeder.admission_log,
            timeline=timeline,
            output_dir=out_dir,
            wall_s=wall,
            extra={**await dep.summary(), "regenerated_groups": list(feeder.readmitted)},
            policy_dir=policy_dir,
        )
        if cfg.output.plot and writer.records:
            plot_rewards({"reward": writer.records}, out_dir / "reward.png", _title(cfg))
        return result


LOST_ROWS_POLL_S = 2.0  # how often the driver looks for rows lost with a storage unit


async def _regenerate_lost(client: AsyncClient, feeder: PromptFeeder, partition: str) -> None:
    """Put again every group that lost rows with a dead TransferQueue storage unit before
    the train stage consumed it (its loss log, see ``transferqueue.controller.retire``): first
    retire the group's surviving rows (wherever they are in the graph), then admit it afresh under
    the same id and staleness rule. A group the train stage holds leased right now waits for that
    lease to end (acked: it was trained; released: it comes back in the log). So every group
    is trained exactly once and never partially, whatever the unit took."""
    cursor = 0
    waiting: set[int] = set()
    while True:
        await asyncio.sleep(LOST_ROWS_POLL_S)
        while True:
            page = await client.lost_rows("train", partition, after=cursor)
            if page.missed:
                raise RuntimeError(
                    f"{page.missed} rows of partition {partition!r} were lost faster than the "
                    f"driver could regenerate their groups; {LOST_SERVER_HINT}"
                )
            if page.indexes.size == 0:
                break
            cursor = page.next
            waiting.update(int(g) for g in np.unique(page.groups).tolist())
        if not waiting:
            continue
        retired = await client.retire_groups(sorted(waiting), partition, unless_leased_by="train")
        busy = {int(g) for g in retired.busy.tolist()}
        again = sorted(waiting - busy)
        if again:
            log.warning(
                "groups %s lost rows with a TransferQueue storage unit: %d surviving rows "
                "retired, the groups put again",
                again,
                retired.rows,
            )
            await feeder.readmit(again)
        waiting = busy


def _resume_state(cfg: RunConfig) -> tuple[Path, DriverState] | None:
    """The checkpoint ``cfg.resume`` names and its driver's state (None: a fresh run);
    ``ValueError`` if this config cannot continue it."""
    if cfg.resume is None:
        return None
    found = checkpoint.find_checkpoint(cfg.resume)
    state = checkpoint.read_driver_state(found)
    checkpoint.check_resumable(config_to_dict(cfg), cfg.resume, found, state)
    return found, state


async def _save_policy(dep: Deployment, directory: Path, version: int) -> Path | None:
    """The trained policy as a Hugging Face folder with the tokenizer (replaced atomically);
    None, with a warning, when the training engine cannot save."""
    tmp = await asyncio.to_thread(checkpoint.staging_dir, directory)
    try:
        await dep.save_policy(tmp)
    except TypeError as e:  # not a CheckpointableEngine
        log.warning("the trained policy is not saved: %s", e)
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        return None
    return await asyncio.to_thread(checkpoint.finish_policy, tmp, directory, dep.tokenizer, version)


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
    generator_version: int,
) -> dict[str, Any]:
    st = report.staleness
    record: dict[str, Any] = {
        "step": report.step,
        "reward": report.reward_mean,
        "reward_std": report.reward_std,
        "version": report.version,
        "samples": report.samples,
        "groups": report.groups,
        "groups_filtered": len(report.filtered),
        "filtered": report.filtered,
        "tokens": report.tokens,
        "time_s": now,
        "step_s": now - since,
        "staleness_max": max(st) if st else 0,
        "staleness_mean": sum(st) / len(st) if st else 0.0,
        "staleness_hist": staleness_histogram(st),
        "generator_version": generator_version,
        "stages": timeline.summary(since, now),
        "queue": {k: {"queued": v["queued"], "waiting": v["waiting"]} for k, v in tq_tasks.items()},
    }
    record.update(report.episodes)  # turns_mean, tool_calls_per_episode, episode_end_reasons
    for k, v in report.metrics.items():  # engine scalars; never shadow the run's own fields
        record.setdefault(k if k not in record else f"engine_{k}", v)
    return record


def run(
    config: RunConfig,
    components: Components | None = None,
    *,
    factories: EngineFactories | None = None,
    adapters: dict[str, type[Adapter]] | None = None,
) -> RunResult:
    """Run a workflow to completion (blocking); see :class:`Workflow` for the arguments."""
    return Workflow(config, components, factories=factories, adapters=adapters).run()
