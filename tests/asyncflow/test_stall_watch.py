"""The stall watch's judgement (:mod:`asyncflow.stall`) over a deployment that reports what
the test says: the automatic bound, a silent host named once and replaced, a host holding a
unit past its bound, a run without steps."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.progress import Work, host_answer, waiting
from asyncflow.stall import (
    AUTO_MAX_S,
    AUTO_MIN_S,
    FIRST_UNIT_S,
    GIVE_UP_MIN_S,
    HELD_MAX_S,
    Probe,
    StallError,
    StallWatch,
    give_up_s,
    stall_bound,
)


def test_the_automatic_bound_is_ten_medians_within_its_limits() -> None:
    # silent: a live host answers at once however long its calls
    assert stall_bound(None, None) == AUTO_MAX_S == 60.0  # before the first unit
    assert stall_bound(None, 0.05) == AUTO_MIN_S == 10.0
    assert stall_bound(None, 2.5) == 25.0
    assert stall_bound(None, 30.0) == AUTO_MAX_S
    # a unit in hand: scales with the stage's own calls, a first call may compile
    assert stall_bound(None, None, held=True) == FIRST_UNIT_S == 300.0
    assert stall_bound(None, 0.05, held=True) == 10.0
    assert stall_bound(None, 30.0, held=True) == 300.0
    assert stall_bound(None, 120.0, held=True) == HELD_MAX_S == 600.0
    assert stall_bound(7.0, 30.0) == stall_bound(7.0, None, held=True) == 7.0  # configured


@pytest.mark.parametrize("bad", ["0", "-1", "inf"])
def test_stall_timeout_must_be_finite_seconds(bad: str) -> None:
    with pytest.raises(ValueError, match=r"deploy\.stall_timeout_s must be finite seconds > 0"):
        load_config(overrides=[f"deploy.stall_timeout_s={bad}"])


class _Fake:
    """A deployment whose hosts' probes the test sets."""

    def __init__(self) -> None:
        self.probes: dict[str, Probe] = {}
        self.replaced: list[str] = []
        self.asked: list[str] = []

    async def progress(self) -> dict[str, Probe]:
        return dict(self.probes)

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        self.asked.append(host)
        answer = self.probes[host].answer
        return None if answer is None else {**answer, "stacks": "thread 'main':\n  here"}

    async def replace(self, host: str) -> bool:
        self.replaced.append(host)
        return True


def _answer(work: Work) -> dict[str, Any]:
    return {**host_answer([work]), "actor": "asyncflow-x-rollout", "node": "n1"}


def test_a_silent_host_is_named_once_and_replaced(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    work = Work("rollout", "rows of ['prompt'] from task 'rollout'")
    token = work.take(8, 42)
    work.phase(token, "process")
    dep = _Fake()
    live = tmp_path / "progress.json"
    watch = StallWatch(dep, 5.0, lambda: 0, live=live)

    async def rounds() -> None:
        dep.probes["rollout"] = Probe(_answer(work), 4.0, replaceable=True)
        await watch.check()  # silent 4 s < 5 s: nothing yet
        dep.probes["rollout"] = Probe(_answer(work), 6.0, replaceable=True)
        await watch.check()
        await watch.check()  # still silent: told once

    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(rounds())
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1, told
    text = told[0]
    assert "stage 'rollout' made no progress for 6.0 s (bound 5.0 s" in text
    assert f"Ray actor asyncflow-x-rollout, pid {_answer(work)['pid']}" in text
    assert "did not answer its progress probe for 6.0 s" in text
    assert "rollout: holds 1 unit(s), 8 rows, leases [42]: in process for" in text
    assert "killed and replaced" in text
    assert dep.replaced == ["rollout"] and dep.asked == []  # a silent host is not asked
    assert watch.stalls[0]["silent"] is True
    view = json.loads(live.read_text())  # the run's live view, as of the last round
    host = view["hosts"]["rollout"]
    assert host["silent_s"] == 6.0 and host["stalled"] is True
    assert host["works"][0]["holding"][0]["lease"] == 42
    assert [s["host"] for s in view["stalls"]] == ["rollout"]


def test_a_host_holding_a_unit_past_its_bound_is_named_with_stacks_and_told_again_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    work = Work("reward", "rows of ['response'] from task 'reward'")
    work.take(4, 7)
    dep = _Fake()
    watch = StallWatch(dep, 0.01, lambda: 0)

    async def rounds() -> None:
        await asyncio.sleep(0.05)
        dep.probes["reward"] = Probe(_answer(work), 0.0, replaceable=False)
        await watch.check()
        dep.probes["reward"] = Probe(host_answer([Work("reward", "-")]), 0.0, replaceable=False)
        await watch.check()  # progress: re-armed
        await asyncio.sleep(0.05)  # (past the quiet time after a stall is told)
        dep.probes["reward"] = Probe(_answer(work), 0.0, replaceable=False)
        await watch.check()

    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(rounds())
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 2
    assert "stage 'reward' made no progress" in told[0]
    assert "threads of pid" in told[0] and "thread 'main'" in told[0]
    assert "not replaced here" in told[0]
    assert dep.replaced == [] and dep.asked == ["reward", "reward"]


def test_a_run_without_steps_says_what_every_stage_waits_for(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("asyncflow.stall.time.monotonic", lambda: now[0])
    steps = [0]
    reward = Work("reward", "rows of ['response'] from task 'reward'")
    reward.idle(0)
    dep = _Fake()
    dep.probes["reward"] = Probe(host_answer([reward]), 0.0, replaceable=True)
    watch = StallWatch(dep, 1000.0, lambda: steps[0])

    async def rounds() -> None:
        for _ in range(4):  # steps of 3 s
            now[0] += 3.0
            steps[0] += 1
            await watch.check()
        now[0] += 14.0  # < 5 medians
        await watch.check()
        now[0] += 2.0
        await watch.check()
        now[0] += 2.0
        await watch.check()  # told once per gap

    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(rounds())
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1, told
    assert told[0].startswith(
        "no train step for 16.0 s (bound: 5 x the median step of 3.00 s, at least 10 s)"
    )
    assert "reward: waits for rows of ['response'] from task 'reward'" in told[0]


def test_the_stuck_engine_is_replaced_not_the_stage_waiting_on_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A generator's call and the rollout batch that waits on it are both past their bound in
    the same round: the engine (its call holds no lease) is named and replaced; the rollout
    gets its bound to move again before it is judged itself."""
    engine = Work("instance0", "generate calls from the rollout")
    engine.phase(engine.take(4), "generate")
    stage = Work("rollout", "rows of ['prompt'] from task 'rollout'")
    stage.phase(stage.take(4, 9), "process")
    dep = _Fake()
    watch = StallWatch(dep, 0.01, lambda: 0)

    async def rounds() -> None:
        await asyncio.sleep(0.05)
        dep.probes["rollout"] = Probe(_answer(stage), 0.0, replaceable=True)
        dep.probes["rollout/instance0"] = Probe(_answer(engine), 0.0, replaceable=True)
        await watch.check()

    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(rounds())
    assert dep.replaced == ["rollout/instance0"]
    assert [s["host"] for s in watch.stalls] == ["rollout/instance0"]


def test_the_stage_waiting_on_a_replaced_engine_is_judged_only_once_it_is_back() -> None:
    """While the replaced engine restarts (absent from the probes, then not yet answering),
    the rollout batch waiting on it is not judged, however long; once the replacement
    answers, the rollout gets its bound again from then."""
    engine = Work("instance0", "generate calls from the rollout")
    engine.phase(engine.take(4), "generate")
    stage = Work("rollout", "rows of ['prompt'] from task 'rollout'")
    stage.phase(stage.take(4, 9), "process")
    dep = _Fake()
    watch = StallWatch(dep, 0.05, lambda: 0)

    async def rounds() -> None:
        await asyncio.sleep(0.1)
        dep.probes["rollout"] = Probe(_answer(stage), 0.0, replaceable=True)
        dep.probes["rollout/instance0"] = Probe(_answer(engine), 0.0, replaceable=True)
        await watch.check()  # the engine replaced
        del dep.probes["rollout/instance0"]  # restarting: not probed
        for _ in range(3):
            await asyncio.sleep(0.1)  # (past the rollout's bound each time)
            await watch.check()
        dep.probes["rollout/instance0"] = Probe(None, 0.0, replaceable=True)  # heard afresh
        await asyncio.sleep(0.1)
        await watch.check()
        assert dep.replaced == ["rollout/instance0"]  # still: it waits on the new engine
        dep.probes["rollout/instance0"] = Probe(host_answer([]), 0.0, replaceable=True)
        await watch.check()  # back: the rollout's bound counts from now
        assert dep.replaced == ["rollout/instance0"]
        await asyncio.sleep(0.1)
        await watch.check()  # the rollout's unit still in hand, past its bound since then

    asyncio.run(rounds())
    assert dep.replaced == ["rollout/instance0", "rollout"]


def test_a_silent_host_has_its_verdict_before_the_peers_that_wait_on_it() -> None:
    """Trainer rank 1 frozen: rank 0 waits in the step's collective holding its unit, and may
    pass its bound before rank 1's silence passes its own; rank 1 is judged (and replaced)
    first, never rank 0."""
    step = Work("train", "rows of ['reward'] from task 'train'")
    step.phase(step.take(8, 5), "process")
    dep = _Fake()
    watch = StallWatch(dep, 0.05, lambda: 0)

    async def rounds() -> None:
        dep.probes["train"] = Probe(_held(step, 0.1), 0.0, replaceable=True)
        dep.probes["train/rank1"] = Probe(host_answer([Work("train", "-")]), 0.04, True)
        await watch.check()  # rank 1 silent, not past its bound: rank 0 told
        assert dep.replaced == ["train"]

    asyncio.run(rounds())  # (the rule's counterpart: without a quiet host, rank 0 is told)
    dep = _Fake()
    watch = StallWatch(dep, 10.0, lambda: 0, period_s=1.0)

    async def frozen() -> None:
        dep.probes["train"] = Probe(_held(step, 11.0), 0.0, replaceable=True)
        dep.probes["train/rank1"] = Probe(host_answer([Work("train", "-")]), 5.0, True)
        await watch.check()  # rank 1 silent 5 s (bound 10 s): rank 0's verdict waits
        assert dep.replaced == []
        dep.probes["train/rank1"] = Probe(host_answer([Work("train", "-")]), 11.0, True)
        await watch.check()
        assert dep.replaced == ["train/rank1"]
        await watch.check()  # rank 1 restarting: rank 0 still waits
        assert dep.replaced == ["train/rank1"]

    asyncio.run(frozen())


def test_a_host_without_a_stage_of_its_own_is_silent_within_the_runs_pace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trainer rank past 0 runs no stage (rank 0 leases the steps): silent, it gets the
    run's pace (the smallest automatic bound of a stage: 10 x rank 0's median step within
    10..60 s), not the 60 s of a host before its first unit."""
    step = Work("train", "rows of ['reward'] from task 'train'")
    for _ in range(3):
        step.finish(step.take(8, 5))
    dep = _Fake()
    watch = StallWatch(dep, None, lambda: 0)
    dep.probes["train"] = Probe(_answer(step), 0.0, replaceable=True)
    dep.probes["train/rank1"] = Probe(host_answer([]), AUTO_MIN_S + 1, replaceable=True)
    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(watch.check())
    (text,) = [r.getMessage() for r in caplog.records]
    assert f"stage 'train' made no progress for {AUTO_MIN_S + 1:.1f} s (bound 10.0 s" in text
    assert dep.replaced == ["train/rank1"]


def _held(work: Work, held_s: float) -> dict[str, Any]:
    """``work``'s answer with its unit in hand for ``held_s``."""
    answer = _answer(work)
    for unit in answer["works"][0]["holding"]:
        unit["held_s"] = unit["quiet_s"] = held_s
    return answer


def test_a_unit_in_a_bounded_wait_is_judged_by_that_bound_and_quiet_from_its_end() -> None:
    """Trainer rank 0 brings a replaced rank back (``waiting``, bounded by Ray's restart): its
    step's unit is not stuck however long the recovery takes within that bound (CI saw rank 0
    killed 10 s after rank 1's replacement answered, in the middle of the hand-over); after the
    wait its unit gets its full bound again; a wait past its own bound is a stall."""
    step = Work("train", "rows of ['reward'] from task 'train'")
    dep = _Fake()
    watch = StallWatch(dep, 0.05, lambda: 0)

    async def held() -> None:  # (in the unit's own task, as the stage runner's worker)
        step.phase(step.take(8, 5), "process")
        with waiting("recover trainer rank(s) [1]", 0.3):
            await asyncio.sleep(0.1)  # (past the stage's bound of 0.05 s)
            dep.probes["train"] = Probe(_answer(step), 0.0, replaceable=True)
            (unit,) = dep.probes["train"].answer["works"][0]["holding"]  # type: ignore[index]
            assert unit["phase"] == "recover trainer rank(s) [1]" and unit["bound_s"] == 0.3
            await watch.check()
            assert dep.replaced == []
        dep.probes["train"] = Probe(_answer(step), 0.0, replaceable=True)
        await watch.check()  # quiet again from the wait's end
        assert dep.replaced == []
        await asyncio.sleep(0.1)
        dep.probes["train"] = Probe(_answer(step), 0.0, replaceable=True)
        await watch.check()
        assert dep.replaced == ["train"]

    asyncio.run(held())
    step = Work("train", "rows of ['reward'] from task 'train'")
    dep = _Fake()
    watch = StallWatch(dep, 0.05, lambda: 0)

    async def past_its_bound() -> None:
        step.take(8, 5)
        with waiting("recover trainer rank(s) [1]", 0.1):
            await asyncio.sleep(0.15)
            dep.probes["train"] = Probe(_answer(step), 0.0, replaceable=True)
            await watch.check()
            assert dep.replaced == ["train"]

    asyncio.run(past_its_bound())
    with waiting("outside any unit", 1.0):  # (a task that holds no unit: nothing to mark)
        pass


def test_a_host_never_heard_from_is_named_by_its_stage(caplog: pytest.LogCaptureFixture) -> None:
    dep = _Fake()
    dep.probes["reward/1"] = Probe(None, AUTO_MAX_S + 1, replaceable=True)
    watch = StallWatch(dep, None, lambda: 0)
    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        asyncio.run(watch.check())
    (text,) = [r.getMessage() for r in caplog.records]
    assert f"stage 'reward' made no progress for {AUTO_MAX_S + 1:.1f} s" in text
    assert "host 'reward/1' (never answered)" in text
    assert dep.replaced == ["reward/1"]


class _Method:
    """``actor.progress`` of a Ray actor handle: ``.options(...).remote(stacks)``."""

    def __init__(self, answers: list[asyncio.Future[dict[str, Any]]]) -> None:
        self.answers = answers
        self.sent = 0

    def options(self, **_: Any) -> _Method:
        return self

    def remote(self, stacks: bool) -> asyncio.Future[dict[str, Any]]:
        self.sent += 1
        return self.answers.pop(0)


class _Actor:
    def __init__(self, answers: list[asyncio.Future[dict[str, Any]]]) -> None:
        self.progress = _Method(answers)


def test_a_probe_that_never_answers_is_sent_again_less_and_less_often(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe lost on its way (its future never completes) would leave a live host unheard
    for good, and named frozen; it is asked again after RESEND_S, then twice as long."""
    from asyncflow.deploy import ray_probe

    clock = [100.0]  # the probes' clock, moved by the test (no timing in the test)
    monkeypatch.setattr(ray_probe, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(ray_probe, "RESEND_S", 2.0)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        lost, late, answered = loop.create_future(), loop.create_future(), loop.create_future()
        actor = _Actor([lost, late, answered])
        probes = ray_probe.HostProbes(lambda: [("reward", actor)], lambda _: True)

        async def tick(after_s: float) -> ray_probe.Probe:
            clock[0] += after_s
            probe = probes.progress()["reward"]
            await asyncio.sleep(0.01)  # (the probe's coroutine sends it)
            return probe

        assert (await tick(0)).answer is None and actor.progress.sent == 1
        await tick(1.0)
        assert actor.progress.sent == 1  # within its wait: not asked again
        await tick(1.5)
        assert actor.progress.sent == 2 and lost.cancelled()  # asked again
        await tick(3.0)
        assert actor.progress.sent == 2  # the second wait is twice as long (4 s)
        await tick(1.5)
        assert actor.progress.sent == 3 and late.cancelled()
        answered.set_result({"pid": 7, "works": []})
        await tick(0)
        probe = await tick(0)
        assert probe.answer == {"pid": 7, "works": []} and probe.silent_s == 0.0
        probes.close()

    asyncio.run(go())


def test_a_stall_nothing_can_replace_fails_the_run_past_its_give_up_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A host that cannot be replaced (a trainer rank, a stage or engine in the driver's
    process) is told once; the watch fails the run with a StallError naming it once the stall
    lasts five times its bound (at least two minutes); progress before that forgives it, and
    a replaced host is never failed."""
    assert give_up_s(5.0) == GIVE_UP_MIN_S == 120.0 and give_up_s(60.0) == 300.0
    work = Work("train", "rows of ['reward'] from task 'train'")
    work.take(8, 3)
    dep = _Fake()
    watch = StallWatch(dep, 0.01, lambda: 0)  # (a short quiet time between two stalls told)

    def probe(silent_s: float, replaceable: bool = False) -> Probe:
        return Probe(_answer(work), silent_s, replaceable=replaceable)

    async def rounds() -> None:
        dep.probes["rank1"] = probe(6.0)
        await watch.check()  # told, not replaced
        dep.probes["rank1"] = probe(119.0)
        await watch.check()  # within the give-up bound: waited for
        dep.probes["rank1"] = Probe(host_answer([Work("train", "-")]), 0.0, replaceable=False)
        dep.probes["rank0"] = probe(500.0, replaceable=True)
        await asyncio.sleep(0.02)
        await watch.check()  # rank1 made progress: forgiven; rank0 told and replaced
        await asyncio.sleep(0.02)
        dep.probes["rank0"] = probe(600.0, replaceable=True)
        dep.probes["rank1"] = probe(121.0)
        await watch.check()  # rank1: a new stall, told again (not failed at once)
        await asyncio.sleep(0.02)
        await watch.check()  # rank1 fails the run; rank0 (replaced) never does

    with (
        caplog.at_level(logging.WARNING, logger="asyncflow.stall"),
        pytest.raises(StallError) as failed,
    ):
        asyncio.run(rounds())
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert len(told) == 3  # rank1 twice, rank0 once
    assert "the run fails if it makes no progress for 120 s" in told[0]
    message = str(failed.value)
    assert "stage 'train' on host 'rank1'" in message
    assert "made no progress for 121.0 s, past 120 s" in message
    assert "train: holds 1 unit(s), 8 rows, leases [3]" in message
    assert "rollout.engine_process=true" in message and "deploy.stall_timeout_s" in message
    assert dep.replaced == ["rank0"]
