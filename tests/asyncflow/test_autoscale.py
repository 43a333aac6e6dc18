"""The rollout's autoscaling policy (:mod:`asyncflow.autoscale`) over step records the test
writes: grow when the trainer starves on busy generators, shrink when they idle, nothing in
the hysteresis band, a window and a cool-down between changes, every decision in its record;
a grow that fails leaves the run as it is. The config refuses what cannot autoscale."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncflow.autoscale import Autoscaler, decide
from asyncflow.config import AutoscaleConfig, load_config
from asyncflow.control import ControlError
from asyncflow.supervisor import Job

CFG = AutoscaleConfig(min=1, max=3, window_steps=3, cooldown_steps=2)


def test_the_policy_grows_on_a_starving_trainer_and_shrinks_on_idle_generators() -> None:
    grow = decide(CFG, 1, train_idle=0.7, rollout_busy=0.95)
    assert grow is not None and grow[0] == 2
    assert "the trainer waited for data 70%" in grow[1] and "busy 95%" in grow[1]
    assert decide(CFG, 3, 0.7, 0.95) is None  # at max
    assert decide(CFG, 2, 0.7, 0.5) is None  # the trainer waits, generators not saturated
    assert decide(CFG, 2, 0.2, 0.95) is None  # generators busy, the trainer is not starving
    shrink = decide(CFG, 2, 0.0, 0.2)
    assert shrink is not None and shrink[0] == 1 and "shrink at <= 30%" in shrink[1]
    assert decide(CFG, 1, 0.0, 0.2) is None  # at min


def _record(step: int, n: int, train_idle: float, rollout_busy: float) -> dict[str, Any]:
    return {
        "step": step,
        "step_s": 1.0,
        "instances": {"rollout": n, "train": 1},
        "stages": {"train": {"idle": train_idle}, "rollout": {"busy": rollout_busy}},
    }


def test_decisions_wait_for_a_full_window_and_a_cooldown_and_go_into_the_records() -> None:
    async def main() -> tuple[list[dict[str, Any]], list[int]]:
        counts = [1]
        jobs: list[asyncio.Task[None]] = []

        async def scale(n: int) -> int:
            was, counts[0] = counts[0], n
            return was

        def spawn(name: str, job: Job) -> None:
            jobs.append(asyncio.ensure_future(job()))

        auto = Autoscaler(CFG, scale, spawn)
        records = []
        for step in range(12):
            rec = _record(step, counts[0], 0.8, 0.9)  # starving all along
            auto.observe(rec)
            records.append(rec)
            await asyncio.gather(*jobs)  # (the change is done before the next step)
        return records, counts

    records, counts = asyncio.run(main())
    told = [r for r in records if "autoscale" in r]
    # a full window (3 steps), the change, 2 steps of cool-down, a new full window
    assert [(r["step"], r["autoscale"]["from"], r["autoscale"]["to"]) for r in told] == [
        (2, 1, 2),
        (7, 2, 3),
    ]
    assert told[0]["autoscale"]["train_idle"] == 0.8
    assert counts == [3]  # and no more: max


def test_a_window_averages_over_step_time_and_a_failed_grow_leaves_the_count() -> None:
    async def main() -> tuple[Autoscaler, dict[str, Any]]:
        jobs: list[asyncio.Task[None]] = []

        async def scale(n: int) -> int:
            raise ControlError("the new rollout instance did not start within 1 s")

        def spawn(name: str, job: Job) -> None:
            jobs.append(asyncio.ensure_future(job()))

        auto = Autoscaler(CFG, scale, spawn)
        long = _record(0, 1, 0.9, 1.0)
        long["step_s"] = 8.0  # one long starving step outweighs two short idle ones
        auto.observe(long)
        auto.observe(_record(1, 1, 0.0, 0.1))
        last = _record(2, 1, 0.0, 0.1)
        auto.observe(last)
        await asyncio.gather(*jobs)
        return auto, last

    auto, last = asyncio.run(main())
    assert last["autoscale"]["to"] == 2
    assert last["autoscale"]["train_idle"] == pytest.approx(0.72)
    (decision,) = auto.decisions
    assert decision["done"] is None  # failed: logged, the run goes on with 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.autoscale={min: 3, max: 2}"], r"1 <= min <= max, got min=3, max=2"),
        (["rollout.autoscale={max: 2}", "rollout.instances=3"], r"rollout.instances=3 is outside"),
        (
            ["rollout.autoscale={max: 2, shrink_rollout_busy: 0.9}"],
            "shrink_rollout_busy must be below grow_rollout_busy",
        ),
        (["deploy.mode=local", "rollout.autoscale={max: 2}"], "needs deploy.mode=ray"),
    ],
)
def test_the_config_refuses_what_cannot_autoscale(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(overrides=["deploy.mode=ray", *overrides])


def test_the_status_line_and_the_capacity_plot_show_instances_over_time(tmp_path: Path) -> None:
    from asyncflow.metrics import plot_capacity
    from asyncflow.status import _record_line

    records = []
    for step in range(20):
        n = 1 if step < 8 else 2
        rec = _record(step, n, 0.5, 0.9)
        rec.update(time_s=float(step), samples=8, step_s=1.0 / n)
        records.append(rec)
    records[7]["autoscale"] = {"from": 1, "to": 2, "reason": "starving"}
    line = _record_line(records[7])
    assert "instances rollout 1, train 1" in line and "autoscaled rollout 1 -> 2" in line
    png = plot_capacity(records, tmp_path / "capacity.png", "elastic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
