"""``asyncflow scale DIR rollout=N`` on a running ``deploy=ray`` job: the rollout grows from
1 to 2 generators after step 10 and shrinks back to 1 after step 30; the run finishes every
step, each group trained once within the staleness bound, no step more than 10 s over the
median. Marked ``ray`` and ``slow``."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncflow import run
from asyncflow.cli import scale
from asyncflow.control import CONTROL_FILE
from tests.asyncflow.conftest import RAY_START, RAY_TEST_TIMEOUT_S, small_config

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)]


def _steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _until_steps(out: Path, steps: int, deadline_s: float = 900.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if _steps(out) >= steps:
            return True
        time.sleep(0.2)
    return False


def _scaler(
    out: Path,
    plan: list[tuple[int, int]],
    seen: list[tuple[int, int, int, float]],
    stage: str = "rollout",
    before: Callable[[int], bool] = lambda n: True,
) -> None:
    """For each ``(after_step, n)``: once that many steps are recorded, and 5 more since the
    previous command returned (a new generator's start takes tens of seconds on 2 shared
    cores: each phase must show in the records), ``before(n)`` and ``scale <stage>=n``;
    ``seen`` gets (n, exit status, steps recorded when it returned, seconds it took)."""
    for after, n in plan:
        if not _until_steps(out, max(after, seen[-1][2] + 5 if seen else 0)) or not before(n):
            return
        t0 = time.monotonic()
        rc = scale(str(out), [f"{stage}={n}"], timeout_s=600.0)
        seen.append((n, rc, _steps(out), time.monotonic() - t0))


def test_a_running_job_scales_its_rollout_up_and_down(ray_cluster: None, tmp_path: Path) -> None:
    out = tmp_path / "run"
    k, steps = 1, 60
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "rollout.instances=1",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        # steps of about a second (small_config's: 0.13 s), so that the run outlasts a new
        # generator's start (its process imports torch and loads the model: tens of seconds)
        "rollout.max_new_tokens=64",
        "train.groups_per_step=4",
        RAY_START,
    )
    seen: list[tuple[int, int, int, float]] = []
    scaler = threading.Thread(target=_scaler, args=(out, [(10, 2), (30, 1)], seen), daemon=True)
    scaler.start()
    try:
        result = run(cfg)
    finally:
        scaler.join(timeout=60)
    assert [(n, rc) for n, rc, _, _ in seen] == [(2, 0), (1, 0)], seen
    assert not (out / CONTROL_FILE).exists()  # removed at the end of the run
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))  # every group trained exactly once
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
    counts = [r["instances"]["rollout"] for r in result.records]
    phases = [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c]
    assert phases == [1, 2, 1], (counts, seen)
    lanes = set(result.timeline.intervals)
    assert "rollout/instance1" in lanes, sorted(lanes)  # the new generator took batches
    step_s = sorted(r["step_s"] for r in result.records)
    median = step_s[len(step_s) // 2]
    worst = max(step_s)
    at = [s for _, _, s, _ in seen]
    took = [round(t, 1) for _, _, _, t in seen]
    print(
        f"scaled 1 -> 2 -> 1 (records at {at}, commands took {took} s): {steps} steps in "
        f"{result.wall_s:.1f} s, instances by step {counts}, median step {median:.2f} s, worst "
        f"{worst:.2f} s"
    )
    assert worst <= median + 10.0, [round(r["step_s"], 2) for r in result.records]


def _hang_second_reward_worker(out: Path, n: int) -> bool:
    """Before ``reward=1``: make reward worker 1 hang in a batch (``HangingReward``) and wait
    (bounded) until it does."""
    from tests.asyncflow.faulty import HANG_REWARD, HUNG_REWARD

    if n != 1:
        return True
    (out / HANG_REWARD).touch()
    deadline = time.monotonic() + 60.0
    while not (out / HUNG_REWARD).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("leave", ["drains", "past_grace"])
def test_a_running_job_scales_its_reward_workers_up_and_down(
    ray_cluster: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, leave: str
) -> None:
    """``asyncflow scale DIR reward=2`` then ``reward=1`` on a run whose reward takes 0.4 s a
    batch (one worker is the bottleneck): a second reward worker joins and scores batches,
    then the newest leaves. ``drains``: it finishes the batch it holds and leaves, handing
    nothing back. ``past_grace``: it hangs in a batch (``deploy.drain_grace_s=1``): the batch
    is cancelled, the worker stopped and its leased rows handed back at once, scored by the
    worker left. Either way every group trained once within the staleness bound, no step
    more than 10 s over the median."""
    from asyncflow import EngineFactories
    from tests.asyncflow.faulty import second_worker_hanging_reward_factory, slow_reward_factory

    out = tmp_path / "run"
    k, steps = 1, 40
    hang = leave == "past_grace"
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "reward.colocate=false",
        "reward.instances=1",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        f"deploy.drain_grace_s={1 if hang else 60}",
        RAY_START,
    )
    seen: list[tuple[int, int, int, float]] = []
    plan = [(4, 2), (0, 1)]  # (down: 5 steps after up returned)
    before = (lambda n: _hang_second_reward_worker(out, n)) if hang else (lambda n: True)
    scaler = threading.Thread(target=_scaler, args=(out, plan, seen, "reward", before), daemon=True)
    scaler.start()
    reward = second_worker_hanging_reward_factory if hang else slow_reward_factory
    try:
        with caplog.at_level(logging.WARNING, logger="asyncflow"):
            result = run(cfg, factories=EngineFactories(reward=reward))
    finally:
        scaler.join(timeout=60)
    assert [(n, rc) for n, rc, _, _ in seen] == [(2, 0), (1, 0)], seen
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))  # every group trained exactly once
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
    counts = [r["instances"]["reward"] for r in result.records]
    phases = [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c]
    assert phases == [1, 2, 1], (counts, seen)
    told = [r.getMessage() for r in caplog.records]
    how = "did not drain within deploy.drain_grace_s=1.0" if hang else "drained"
    left = [m for m in told if m.startswith(f"reward worker reward/1 {how} and left")]
    assert left, told
    scored = int(left[0].split("it scored ")[1].split()[0])
    assert scored > 0, left  # the new worker scored batches before it left
    back = int(left[0].split("; ")[-1].split()[0])
    assert back > 0 if hang else back == 0, left  # (what it held, back at once)
    assert result.extra["restarts"].get("reward/1", 0) == 0  # stopped, not restarted
    step_s = sorted(r["step_s"] for r in result.records)
    median, worst = step_s[len(step_s) // 2], step_s[-1]
    two = sorted(r["step_s"] for r, n in zip(result.records, counts, strict=True) if n == 2)
    at = [s for _, _, s, _ in seen]
    took = [round(t, 1) for _, _, _, t in seen]
    print(
        f"reward scaled 1 -> 2 -> 1, {leave} (records at {at}, commands took {took} s): "
        f"{steps} steps in {result.wall_s:.1f} s, instances by step {counts}; {left[0]}; "
        f"median step {median:.2f} s (with 2 workers {two[len(two) // 2]:.2f} s), worst "
        f"{worst:.2f} s"
    )
    assert worst <= median + 10.0, [round(r["step_s"], 2) for r in result.records]


def _sigterm_when(out: Path, after_steps: int, suffix: str, seen: dict[str, float]) -> None:
    """Once ``after_steps`` steps are recorded, SIGTERM the generator host whose Ray actor
    name ends with ``suffix`` (a spot node's preemption notice)."""
    import ray

    if not _until_steps(out, after_steps):
        return
    actors: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    name = max(a["name"] for a in actors if a["name"].endswith(suffix))
    host: Any = ray.get_actor(name)
    pid = int(ray.get(host.where.remote(), timeout=60)["pid"])
    os.kill(pid, signal.SIGTERM)
    seen["pid"], seen["at"], seen["step"] = pid, time.time(), _steps(out)


@pytest.mark.parametrize("instances", [2, 1])
def test_a_generator_that_gets_sigterm_drains_and_leaves(
    ray_cluster: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, instances: int
) -> None:
    """Preemption: SIGTERM to a generator host's process after step 8. It does not die: the
    driver drains it (its calls finish) and stops it, never restarted, and the run goes on
    with the others (2 -> 1 instances), or (the last one) with a new instance put in its
    place first; every group trained once within the staleness bound, no step more than 10 s
    over the median."""
    out = tmp_path / "run"
    k, steps = 1, 30
    cfg = small_config(
        out,
        "deploy.mode=ray",
        f"rollout.instances={instances}",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        "rollout.max_new_tokens=64",
        "train.groups_per_step=4",
        RAY_START,
    )
    victim = f"instance{instances - 1}"
    seen: dict[str, float] = {}
    signaller = threading.Thread(
        target=_sigterm_when, args=(out, 8, f"-{victim}", seen), daemon=True
    )
    signaller.start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncflow"):
            result = run(cfg)
    finally:
        signaller.join(timeout=60)
    assert "pid" in seen, "the generator was never signalled"
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))  # every group trained exactly once
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
    told = [r.getMessage() for r in caplog.records]
    assert any(f"rollout instance {victim} got SIGTERM" in m for m in told), told
    left = [m for m in told if f"rollout instance {victim} drained and left" in m]
    assert left, told
    assert result.extra["restarts"].get(f"rollout/{victim}", 0) == 0  # stopped, not restarted
    counts = [r["instances"]["rollout"] for r in result.records]
    assert counts[0] == instances and counts[-1] == max(1, instances - 1), counts
    if instances == 1:  # its replacement took batches
        assert "rollout/instance1" in result.timeline.intervals, sorted(result.timeline.intervals)
    step_s = sorted(r["step_s"] for r in result.records)
    median, worst = step_s[len(step_s) // 2], step_s[-1]
    print(
        f"SIGTERM to {victim} of {instances} at step {seen['step']:g}: {left[0]}; instances "
        f"by step {counts}; median step {median:.2f} s, worst {worst:.2f} s"
    )
    assert worst <= median + 10.0, [round(r["step_s"], 2) for r in result.records]


@pytest.mark.parametrize("change", ["grow", "shrink"])
def test_autoscaling_follows_where_the_run_waits(
    ray_cluster: None, tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    """``rollout.autoscale={min: 1, max: 2}``. ``grow``: one instance whose every call takes
    0.5 s longer (the trainer starves on a busy rollout); after a window of steps the
    autoscaler adds an instance, the new instance takes batches and the steps get faster
    (capacity doubled: at least 1.3x the steps per second of one instance alone).
    ``shrink``: two instances and a reward of 0.4 s a batch (the generators idle, held by the
    staleness bound); the autoscaler removes one. Each decision logged and recorded with its
    reason; every group trained once within the staleness bound."""
    from asyncflow import EngineFactories
    from tests.asyncflow.faulty import slow_generator, slow_reward_factory

    out = tmp_path / "run"
    k, steps = 1, 50 if change == "grow" else 30
    start, end = (1, 2) if change == "grow" else (2, 1)
    cfg = small_config(
        out,
        "deploy.mode=ray",
        f"rollout.instances={start}",
        "rollout.autoscale={min: 1, max: 2, window_steps: 3, cooldown_steps: 2}",
        "rollout.autoscale.grow_rollout_busy=0.5",  # (measured here: 0.68-0.82)
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        RAY_START,
    )
    if change == "grow":
        factories = EngineFactories(generator=slow_generator)
    else:
        factories = EngineFactories(reward=slow_reward_factory)
    with caplog.at_level(logging.WARNING, logger="asyncflow"):
        result = run(cfg, factories=factories)
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))  # every group trained exactly once
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
    decisions = [r for r in result.records if "autoscale" in r]
    assert decisions, "no autoscaling decision"
    first = decisions[0]["autoscale"]
    assert (first["from"], first["to"]) == (start, end), decisions
    assert ("the trainer waited" if change == "grow" else "shrink at") in first["reason"]
    told = [r.getMessage() for r in caplog.records if r.name == "asyncflow.autoscale"]
    assert any(f"rollout {start} -> {end} instances" in m for m in told), told
    assert [d["done"] for d in result.extra["autoscale"]][:1] == [True]
    counts = [r["instances"]["rollout"] for r in result.records]
    assert counts[0] == start and counts[-1] == end, counts
    one = [r["step_s"] for r, n in zip(result.records, counts, strict=True) if n == 1][1:]
    two = [r["step_s"] for r, n in zip(result.records, counts, strict=True) if n == 2][2:]
    alone, both = sorted(one)[len(one) // 2], sorted(two)[len(two) // 2]
    print(
        f"autoscaled {start} -> {end} after step {decisions[0]['step']} ({first['reason']}); "
        f"instances by step {counts}; median step {alone:.2f} s with 1, {both:.2f} s with 2"
    )
    if change == "grow":
        assert "rollout/instance1" in result.timeline.intervals  # the new one took batches
        assert alone >= 1.3 * both, (one, two)
