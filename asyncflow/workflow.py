"""The asynchronous GRPO workflow: every stage exchanges data only through TransferQueue.

    prompts (feeder) -> rollout -> reward -> [reference] -> train
                          ^                                   |
                          +------- deferred weight sync -------+

Stages are independent loops over TransferQueue (``asyncflow.stage_runner``, built the same
way in every deployment by ``asyncflow.graph``); the feeder admits groups under the staleness
bound (``asyncflow.feeder``); the train stage publishes weights after each step and the
generators pick them up at their next micro-batch boundary, when the registry's policy says so
(``asyncflow.registry``, ``asyncflow.hosts``). Where the stages run is the deployment's
business (``asyncflow.deploy``: this process, or Ray actors); this process stays the run's
single controller either way. Its parts run as named jobs of one supervisor
(``asyncflow.supervisor``: an ``asyncio.TaskGroup``):

| job              | what it does                                                       |
|------------------|--------------------------------------------------------------------|
| ``feeder``       | admits groups under the staleness bound                            |
| ``steps``        | takes each step report, builds its record, starts its evaluation   |
|                  | (``asyncflow.recorder``)                                           |
| ``records``      | the main job: writes the records in step order, each once its      |
|                  | evaluation is in, and completes the checkpoints the trainer staged |
|                  | (``asyncflow.checkpoint``); the run's steps end when it returns    |
| ``evaluation``   | with ``eval.every_steps``: reads the held-out rewards              |
|                  | (``asyncflow.evaluation``)                                         |
| ``regeneration`` | puts again the groups whose rows a dead storage unit took          |
|                  | (:func:`_regenerate_lost`: each is trained once, whole)            |
| each stage       | the deployment's jobs (stages, weight followers), by stage name    |

The run ends after ``train.steps`` optimizer steps. If any job fails, every other is stopped,
TransferQueue is closed and the error is raised as :class:`StageError` naming the job (a
stage's own as is); no task is left running. Lost rows are not a failure. With
``train.dynamic_sampling`` the train stage filters the groups whose rewards all tie and the
feeder admits one more group per filtered one (each record's ``groups_filtered`` and
``filtered``; a checkpoint lists them, so a resumed run neither trains nor counts them). With
an environment, a group with an episode whose environment failed on every try (``env_error``)
is dropped and refilled the same way (``groups_dropped``, ``dropped``).

Around the steps, the driver also resumes from a checkpoint (``resume``) and saves the trained
policy as a Hugging Face folder, ``output.dir/policy``, when the run ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from adapters import Adapter, StepReport
from asyncflow import checkpoint, graph
from asyncflow.autoscale import Autoscaler
from asyncflow.build import Components, EngineFactories
from asyncflow.checkpoint import CheckpointPlan, DriverState, ResumePoint
from asyncflow.config import RunConfig
from asyncflow.config.load import config_to_dict
from asyncflow.control import ControlServer, serve
from asyncflow.deploy.base import Deployment
from asyncflow.deploy.local import LocalDeployment
from asyncflow.evaluation import Evaluator
from asyncflow.feeder import PromptFeeder
from asyncflow.graph import EVAL_PARTITION, PARTITION
from asyncflow.loggers import make_loggers
from asyncflow.metrics import (
    MetricsWriter,
    Timeline,
    plot_capacity,
    plot_rewards,
    write_timeline,
)
from asyncflow.recorder import StepRecorder
from asyncflow.stage_runner import LOST_SERVER_HINT
from asyncflow.stall import PROGRESS_FILE, StallWatch
from asyncflow.supervisor import Job, Supervisor
from asyncflow.threads import intra_op_threads
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
        caller_threads = torch.get_num_threads()  # (given back when the run ends)
        threads = intra_op_threads(cfg)  # before any torch work: every thread inherits it
        if threads is not None:
            torch.set_num_threads(threads)
            log.info("torch_threads=%s: %d intra-op threads", cfg.torch_threads, threads)
        try:
            return await self._run(cfg)
        finally:
            torch.set_num_threads(caller_threads)

    async def _run(self, cfg: RunConfig) -> RunResult:
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
        """Run the driver's jobs under one supervisor until the last step's record is
        written, then finish the run (policy, timeline, plot)."""
        t_start = time.perf_counter()
        client = dep.client
        first_step = 0 if state is None else state.steps
        await client.declare_tasks(graph.tasks(cfg), partition=PARTITION)
        evaluator: Evaluator | None = None
        if cfg.eval.every_steps:
            await client.declare_tasks(graph.eval_tasks(cfg), partition=EVAL_PARTITION)
            evaluator = Evaluator(cfg, client, dep.tokenizer)
        feeder = _feeder(cfg, dep, state)
        checkpoints = None if plan is None else _Checkpoints(cfg, plan, feeder, writer, dep, state)
        jobs = Supervisor()
        autoscaler = None
        if cfg.rollout.autoscale.max and dep.scalable:  # (the config refuses it elsewhere)
            rollout = functools.partial(_scale, dep, jobs.spawn, "rollout")
            autoscaler = Autoscaler(cfg.rollout.autoscale, rollout, jobs.spawn)
        recorder = StepRecorder(
            dep,
            writer,
            range(first_step, cfg.train.steps),
            evaluator=evaluator,
            after=None if checkpoints is None else checkpoints.after,
            observe=None if autoscaler is None else autoscaler.observe,
        )
        dep.supervise(jobs.spawn)
        jobs.add("feeder", feeder.run)
        jobs.add("steps", recorder.take_reports)
        if evaluator is not None:
            jobs.add("evaluation", evaluator.collect)
        for name, job in dep.jobs().items():
            jobs.add(name, job)
        regenerate = functools.partial(_regenerate_lost, client, feeder, PARTITION)
        jobs.add("regeneration", regenerate, background=True)
        watch = StallWatch(
            dep,
            cfg.deploy.stall_timeout_s,
            lambda: len(recorder.reports),
            live=out_dir / PROGRESS_FILE,
            total_steps=cfg.train.steps,
        )
        jobs.add("stall watch", watch.run, background=True)
        if dep.scalable:  # ``asyncflow scale OUTPUT_DIR rollout=N`` reaches the run here
            scale = functools.partial(_scale, dep, jobs.spawn)
            server = ControlServer(
                out_dir,
                scale,
                dep.instances,
                dep.scalable,
                cfg.deploy.control_host,
                cfg.transferqueue.keys,
            )
            jobs.add("control", functools.partial(serve, server), background=True)
        try:
            await jobs.run(
                "records",
                recorder.write_records,
                idle_error="every stage ended before the last train step",
            )
            await dep.collect()
            policy_dir = await _save_policy(dep, out_dir / "policy", cfg.train.steps)
            write_timeline(dep.timeline, out_dir, writer.records)
        except BaseException as e:  # (the live view says the run is over, and why)
            await asyncio.shield(watch.finish("failed", f"{type(e).__name__}: {e}"))
            raise
        await watch.finish("finished")
        result = RunResult(
            records=writer.records,
            reports=recorder.reports,
            admission=feeder.admission_log,
            timeline=dep.timeline,
            output_dir=out_dir,
            wall_s=time.perf_counter() - t_start,
            extra={
                **await dep.summary(),
                "regenerated_groups": list(feeder.readmitted),
                "stalls": list(watch.stalls),
                "autoscale": [] if autoscaler is None else list(autoscaler.decisions),
                "torch_threads": torch.get_num_threads(),
            },
            policy_dir=policy_dir,
        )
        if cfg.output.plot and writer.records:
            plot_rewards({"reward": writer.records}, out_dir / "reward.png", _title(cfg))
            counts = {str(r.get("instances")) for r in writer.records}
            if len(counts) > 1:  # (scaled while it ran: instances and throughput over time)
                plot_capacity(writer.records, out_dir / "capacity.png", _title(cfg))
        return result


async def _scale(dep: Deployment, spawn: Callable[[str, Job], None], stage: str, n: int) -> int:
    return await dep.scale(stage, n, spawn)


def _feeder(cfg: RunConfig, dep: Deployment, state: DriverState | None) -> PromptFeeder:
    """The prompt feeder of this run (a resumed one from the checkpoint's next group)."""
    b = cfg.train.groups_per_step
    return PromptFeeder(
        dep.client,
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
        refill=cfg.episodic(),  # a group may be dropped (env_error: an environment or an agent)
        prefetch_steps=cfg.prefetch_steps(),
    )


class _Checkpoints:
    """The driver's part of each checkpoint the plan marks (the trainer staged its part
    before handing over the step's report): the feeder's state, the groups dynamic sampling
    filtered and the records so far, written once the step's record is (see
    ``asyncflow.checkpoint``)."""

    def __init__(
        self,
        cfg: RunConfig,
        plan: CheckpointPlan,
        feeder: PromptFeeder,
        writer: MetricsWriter,
        dep: Deployment,
        state: DriverState | None,
    ) -> None:
        self.plan = plan
        self.feeder = feeder
        self.writer = writer
        self.tokenizer = dep.tokenizer
        self.config = config_to_dict(cfg)
        self.groups_per_step = cfg.train.groups_per_step
        self.filtered: list[int] = [] if state is None else list(state.filtered)

    async def after(self, report: StepReport, record: dict[str, Any]) -> None:
        """Note the step's filtered groups; complete the checkpoint due after the step, if
        one is."""
        done_steps = report.step + 1
        self.filtered.extend(report.filtered)
        if not self.plan.due(done_steps):
            return
        # every group before the step's next one was consumed: trained, filtered
        nxt = report.next_group if report.next_group >= 0 else done_steps * self.groups_per_step
        part = DriverState(
            steps=done_steps,
            version=report.version,
            next_group=nxt,
            admission=[a for a in self.feeder.admission_log if a[0] < nxt],
            elapsed_s=float(record["time_s"]),
            records=list(self.writer.records),
            filtered=list(self.filtered),
        )
        path = await asyncio.to_thread(
            checkpoint.commit, self.plan, part, self.tokenizer, self.config
        )
        log.info("checkpoint after step %d: %s", report.step, path)


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


def run(
    config: RunConfig,
    components: Components | None = None,
    *,
    factories: EngineFactories | None = None,
    adapters: dict[str, type[Adapter]] | None = None,
) -> RunResult:
    """Run a workflow to completion (blocking); see :class:`Workflow` for the arguments."""
    return Workflow(config, components, factories=factories, adapters=adapters).run()
