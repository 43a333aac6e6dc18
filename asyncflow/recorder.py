"""The driver's recorder: one record per train step, written in step order.

Two jobs of the driver's supervisor (:mod:`asyncflow.supervisor`):

| job       | what it does                                                               |
|-----------|----------------------------------------------------------------------------|
| ``steps`` | takes each step report as the trainer hands it over and builds that step's |
|           | record (:func:`step_record`, plus the stages' adapter metrics and the      |
|           | restarts so far); starts the step's evaluation when one is due             |
| ``records`` | (the run's main job) writes each record in step order once its           |
|           | evaluation is in, then runs ``after(report, record)``: the checkpoint due  |
|           | after that step; returns after the last step                               |

Training never waits for an evaluation: only the writing of its step's record, and of the
records after it, does (bounded by ``eval.timeout_s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from adapters import StepReport
from asyncflow.deploy.base import Deployment
from asyncflow.evaluation import Evaluator
from asyncflow.graph import PARTITION
from asyncflow.metrics import (
    MetricsWriter,
    Timeline,
    staleness_histogram,
    sync_metrics,
    version_metrics,
)

__all__ = ["AfterRecord", "StepRecorder", "step_record"]

AfterRecord = Callable[[StepReport, dict[str, Any]], Awaitable[None]]
"""Called with each step's report and record once the record is written."""
_Pending = tuple[StepReport, dict[str, Any], "asyncio.Future[dict[str, float]] | None"]


class StepRecorder:
    """Step reports in, records out (see the module doc)."""

    def __init__(
        self,
        deployment: Deployment,
        writer: MetricsWriter,
        steps: range,
        *,
        evaluator: Evaluator | None = None,
        after: AfterRecord | None = None,
        observe: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        self.deployment = deployment
        self.observe = observe
        """Sees each record before it is queued (``asyncflow.autoscale``), may add to it."""
        self.writer = writer
        self.steps = steps
        self.evaluator = evaluator
        self.after = after
        self.reports: list[StepReport] = []
        """This process's step reports, in order."""
        self._pending: asyncio.Queue[_Pending] = asyncio.Queue()

    async def take_reports(self) -> None:
        """The ``steps`` job: a record per step report (evaluation started), until the last."""
        dep = self.deployment
        timeline = dep.timeline
        last_t = timeline.now()
        # rows that dead holders' leases gave back, as of the previous step
        returned = int((await dep.client.stats())["controller"].get("returned_rows", 0))
        for _ in self.steps:
            report = await dep.next_report()
            stage_metrics = await dep.collect()
            now = timeline.now()
            stats = await dep.client.stats()
            tq_tasks = stats["controller"]["partitions"][PARTITION]["tasks"]
            versions = await dep.registry.admission_view()
            record = step_record(report, timeline, last_t, now, tq_tasks, versions[0])
            record["stage_metrics"] = stage_metrics
            record["restarts"] = sum(dep.restarts.values())
            record["instances"] = dep.instances()
            if self.observe is not None:  # (the autoscaler: its decision goes into the record)
                self.observe(record)
            # Recovery: seconds from a stage host's death to its replacement answering, for
            # the restarts that ended in this step, and the rows its leases gave back.
            record["restart_s"] = sum(
                back - died for _, died, back in dep.restart_times if last_t < back <= now
            )
            now_returned = int(stats["controller"].get("returned_rows", 0))
            record["rows_returned"] = now_returned - returned
            returned = now_returned
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
            self.reports.append(report)
            done = None
            if self.evaluator is not None and self.evaluator.due(report.step + 1):
                done = await self.evaluator.start(report.version)
            self._pending.put_nowait((report, record, done))

    async def write_records(self) -> None:
        """The ``records`` job: records in step order, each once its evaluation is in, then
        ``after`` it; returns after the last step."""
        for _ in self.steps:
            report, record, done = await self._pending.get()
            if done is not None:
                assert self.evaluator is not None
                record["eval"] = await self.evaluator.result(done, report.step)
            self.writer.write(record)
            if self.after is not None:
                await self.after(report, record)


def step_record(
    report: StepReport,
    timeline: Timeline,
    since: float,
    now: float,
    tq_tasks: dict[str, Any],
    generator_version: int,
) -> dict[str, Any]:
    """A step's record: the trainer's report, the time since the previous step, staleness,
    the stages' busy time and TransferQueue's queue depths over that time."""
    st = report.staleness
    record: dict[str, Any] = {
        "step": report.step,
        "reward": report.reward_mean,
        "reward_std": report.reward_std,
        "version": report.version,
        "samples": report.samples,
        "groups": report.groups,
        "groups_filtered": len(report.filtered) - len(report.dropped),
        "groups_dropped": len(report.dropped),
        "filtered": report.filtered,
        "dropped": report.dropped,
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
    record.update(report.episodes)  # end reasons and rates, env counters, latency, waits
    for k, v in report.metrics.items():  # engine scalars; never shadow the run's own fields
        record.setdefault(k if k not in record else f"engine_{k}", v)
    return record
