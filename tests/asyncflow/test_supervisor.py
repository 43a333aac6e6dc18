"""The driver's supervisor: named jobs in one TaskGroup, none left running, failures named."""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncflow import supervisor as supervisor_module
from asyncflow.stage_runner import StageError
from asyncflow.supervisor import Supervisor

IDLE = "every stage ended before the last train step"


class Forever:
    """A job that runs until cancelled and says so."""

    def __init__(self) -> None:
        self.started = False
        self.cancelled = False

    async def __call__(self) -> None:
        self.started = True
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def others() -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}


def test_the_main_job_ends_the_run_and_no_job_is_left_running() -> None:
    stage, watch = Forever(), Forever()
    steps: list[int] = []

    async def feeder() -> None:  # a job that finishes early is fine
        steps.append(0)

    async def main() -> None:
        for i in range(1, 4):
            await asyncio.sleep(0)
            steps.append(i)

    async def scenario() -> None:
        jobs = Supervisor()
        jobs.add("feeder", feeder)
        jobs.add("rollout", stage)
        jobs.add("regeneration", watch, background=True)
        await jobs.run("records", main, idle_error=IDLE)
        assert not others()

    asyncio.run(scenario())
    assert steps == [0, 1, 2, 3]
    assert stage.started and stage.cancelled and watch.cancelled


def test_a_failing_job_stops_the_run_with_its_name() -> None:
    stage, main = Forever(), Forever()

    async def reward() -> None:
        await asyncio.sleep(0)
        raise ValueError("reward model exploded")

    async def scenario() -> None:
        jobs = Supervisor()
        jobs.add("rollout", stage)
        jobs.add("reward", reward)
        try:
            await jobs.run("records", main, idle_error=IDLE)
        finally:
            assert not others()

    with pytest.raises(StageError, match="stage 'reward' failed: ValueError: reward model") as e:
        asyncio.run(scenario())
    assert isinstance(e.value.__cause__, ValueError)
    assert stage.cancelled and main.cancelled


def test_a_stage_error_passes_as_is_and_a_failing_main_job_is_named() -> None:
    async def train() -> None:
        raise StageError("train/rank1", RuntimeError("died"))

    async def records() -> None:
        raise TimeoutError("the evaluation after step 3 did not finish")

    async def run(job: str) -> None:
        jobs = Supervisor()
        jobs.add("rollout", Forever())
        if job == "train":
            jobs.add("train", train)
        await jobs.run("records", records if job == "records" else Forever(), idle_error=IDLE)

    with pytest.raises(StageError, match=r"stage 'train/rank1' failed: RuntimeError: died"):
        asyncio.run(run("train"))
    with pytest.raises(StageError, match=r"stage 'records' failed: TimeoutError: the evaluation"):
        asyncio.run(run("records"))


def test_every_job_ending_before_the_main_one_is_an_error() -> None:
    """Nothing would make progress: the run fails instead of waiting forever (a background
    job, which only reacts, does not count)."""
    watch = Forever()

    async def ends() -> None:
        await asyncio.sleep(0)

    async def scenario() -> None:
        jobs = Supervisor()
        jobs.add("feeder", ends)
        jobs.add("rollout", ends)
        jobs.add("regeneration", watch, background=True)
        await jobs.run("records", Forever(), idle_error=IDLE)

    with pytest.raises(RuntimeError, match=IDLE):
        asyncio.run(scenario())
    assert watch.cancelled


def test_names_are_unique() -> None:
    jobs = Supervisor()
    jobs.add("eval", Forever())
    with pytest.raises(ValueError, match="'eval' is already supervised"):
        jobs.add("eval", Forever())
    with pytest.raises(ValueError, match="'eval' is already supervised"):
        asyncio.run(jobs.run("eval", Forever(), idle_error=IDLE))


def test_a_job_that_outlives_its_cancellation_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(supervisor_module, "STOP_S", 0.05)

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # (a job must end on cancellation; this one lingers)

    async def main() -> None:
        await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="asyncflow.supervisor"):
        asyncio.run(_run_with(stubborn, main))
    assert "['reward'] have not ended" in caplog.text


async def _run_with(job: supervisor_module.Job, main: supervisor_module.Job) -> None:
    jobs = Supervisor()
    jobs.add("reward", job)
    await jobs.run("records", main, idle_error=IDLE)


def test_a_job_spawned_while_the_run_goes_on_is_supervised() -> None:
    """``spawn``: a job started after ``run`` began runs beside the others, its failure stops
    the run with its name; spawning before the run or twice under one name is refused."""
    sup = Supervisor()
    with pytest.raises(RuntimeError, match="not running"):
        sup.spawn("late", Forever())
    feeder = Forever()
    sup.add("feeder", feeder)
    ran: list[str] = []

    async def late() -> None:
        ran.append("late")
        raise ValueError("boom")

    async def main() -> None:
        await asyncio.sleep(0.01)
        sup.spawn("rollout/instance1", late)
        with pytest.raises(ValueError, match="already supervised"):
            sup.spawn("rollout/instance1", late)
        await asyncio.Event().wait()

    with pytest.raises(StageError, match="rollout/instance1") as info:
        asyncio.run(sup.run("records", main, idle_error=IDLE))
    assert ran == ["late"] and feeder.cancelled
    assert isinstance(info.value.__cause__, ValueError)
