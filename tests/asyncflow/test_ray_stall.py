"""A frozen stage host under ``deploy=ray`` (SIGSTOP: alive, holding its sockets and leases,
doing nothing) is named within seconds and replaced through the restart path; the run
finishes every step, each group trained once. Marked ``ray`` and ``slow``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow import EngineFactories, run
from asyncflow.cli import main as cli_main
from tests.asyncflow.conftest import RAY_START, RAY_TEST_TIMEOUT_S, small_config, until_holding
from tests.asyncflow.faulty import slow_generator, stalling_generator_once

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)]

FREEZE_S = 90.0
"""How long the host stays frozen before SIGCONT (if it is still there to wake)."""


def _until_steps(out: Path, steps: int, deadline_s: float = 600.0) -> bool:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return True
        time.sleep(0.2)
    return False


def _until_heard(out: Path, host: str, deadline_s: float = 60.0) -> bool:
    """Wait until the run's ``progress.json`` shows an answer of ``host`` to the stall watch's
    probe (a host frozen before its first answer is named only after the 60 s of a host never
    heard from: the test would measure that bound, not the stall's)."""
    live = out / "progress.json"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads(live.read_text())["hosts"][host].get("pid"):
                return True
        time.sleep(0.1)
    return False


def _freeze_when(
    out: Path,
    after_steps: int,
    suffix: str,
    host: str,
    done: threading.Event,
    seen: dict[str, float],
) -> None:
    """Once ``after_steps`` steps are recorded and the stall watch has heard from ``host``,
    SIGSTOP the host whose actor name ends with ``suffix``; SIGCONT it after
    :data:`FREEZE_S` or when the run ends."""
    import ray

    if not _until_steps(out, after_steps) or not _until_heard(out, host):
        return
    actors: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] for a in actors]
    name = max(n for n in names if n.endswith(suffix))
    actor: Any = ray.get_actor(name)
    where: dict[str, Any] = ray.get(actor.where.remote(), timeout=60)
    pid = int(where["pid"])
    os.kill(pid, signal.SIGSTOP)
    seen["frozen_at"] = time.time()
    seen["pid"] = pid
    done.wait(FREEZE_S)
    with contextlib.suppress(ProcessLookupError):  # (killed and replaced meanwhile)
        os.kill(pid, signal.SIGCONT)
        seen["woken_at"] = time.time()


def _run_frozen(
    cfg: Any, after_steps: int, suffix: str, host: str, caplog: pytest.LogCaptureFixture
) -> tuple[Any, dict[str, float], logging.LogRecord]:
    """Run ``cfg`` while :func:`_freeze_when` freezes ``host``; check that the host was frozen,
    every group trained exactly once within the staleness bound, and a stall was named; the
    result, what the freezer saw, the first stall's record."""
    done = threading.Event()
    seen: dict[str, float] = {}
    out = Path(cfg.output.dir)
    freezer = threading.Thread(
        target=_freeze_when, args=(out, after_steps, suffix, host, done, seen), daemon=True
    )
    freezer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncflow"):
            result = run(cfg)
    finally:
        done.set()
        freezer.join(timeout=30)
    assert "frozen_at" in seen, f"{host} was never frozen"
    b, k = cfg.train.groups_per_step, cfg.train.max_staleness
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(cfg.train.steps * b))  # every group trained exactly once
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k
    stalls = [r for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls, "no stall was named"
    return result, seen, stalls[0]


@pytest.mark.parametrize(
    ("suffix", "stage", "busy"),
    [
        ("-rollout", "rollout", "rollout.max_new_tokens=24"),
        ("-reward-0", "reward", "rollout.max_new_tokens=4"),
    ],
)
def test_a_frozen_stage_host_is_named_and_replaced_within_seconds(
    ray_cluster: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    suffix: str,
    stage: str,
    busy: str,
) -> None:
    """Freeze a stage host (SIGSTOP) after step 12 for 90 s: a WARNING naming its stage and
    the stall comes during the freeze, the host is killed and Ray restarts it, and the run
    finishes every step (no step more than 30 s over the median), every group trained once
    within the staleness bound."""
    out = tmp_path / "run"
    k, steps, freeze_after = 1, 40, 12
    cfg = small_config(
        out,
        "deploy.mode=ray",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        busy,
        RAY_START,
    )
    result, seen, first = _run_frozen(cfg, freeze_after, suffix, stage, caplog)
    text = first.getMessage()
    assert f"stage {stage!r}" in text or f"stage '{stage}'" in text, text
    assert "did not answer its progress probe" in text
    assert f"pid {int(seen['pid'])}" in text
    warned_s = first.created - seen["frozen_at"]
    assert 0 < warned_s < FREEZE_S  # during the freeze
    assert result.extra["restarts"].get(stage, 0) >= 1
    records = result.records
    step_s = sorted(r["step_s"] for r in records)
    median = step_s[len(step_s) // 2]
    worst = max(r["step_s"] for r in records)
    restart_s = sum(r["restart_s"] for r in records)
    print(
        f"{stage} host frozen: named after {warned_s:.1f} s, worst step {worst:.2f} s, median "
        f"{median:.2f} s, restart {restart_s:.2f} s, dropped "
        f"{sum(r['stage_metrics'].get(stage, {}).get('dropped_batches', 0) for r in records)}"
    )
    assert worst <= median + 30.0, [round(r["step_s"], 2) for r in records]


def _pause(
    out: Path, after_steps: int, suffix: str, pause_s: float, seen: dict[str, float]
) -> None:
    """Once ``after_steps`` steps are recorded, SIGSTOP the host whose actor name ends with
    ``suffix`` for ``pause_s``, then SIGCONT it."""
    import ray

    if not _until_steps(out, after_steps) or not until_holding(out, "rollout"):
        return
    actors: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    name = max(a["name"] for a in actors if a["name"].endswith(suffix))
    host: Any = ray.get_actor(name)
    where: dict[str, Any] = ray.get(host.where.remote(), timeout=60)
    os.kill(int(where["pid"]), signal.SIGSTOP)
    seen["frozen_at"] = time.time()
    time.sleep(pause_s)
    os.kill(int(where["pid"]), signal.SIGCONT)
    seen["woken_at"] = time.time()


def test_a_rollout_host_woken_after_its_leases_were_returned_drops_its_batch(
    ray_cluster: None, tmp_path: Path
) -> None:
    """The issue's second half: the rollout host frozen for 12 s (past TransferQueue's
    holder liveness, 5.5 s, so the controller returns its rows; under the stall bound, 60 s
    here, so it is not replaced), then woken: its put of the stale batch fails with
    LeaseExpiredError, the stage drops that batch and goes on, the run completes, every
    group trained once, no restart."""
    out = tmp_path / "run"
    k, steps = 1, 16
    cfg = small_config(
        out,
        "deploy.mode=ray",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        "rollout.max_new_tokens=24",
        "deploy.stall_timeout_s=60",
        RAY_START,
    )
    seen: dict[str, float] = {}
    pauser = threading.Thread(target=_pause, args=(out, 6, "-rollout", 12.0, seen), daemon=True)
    pauser.start()
    # (every generate call 0.5 s longer: the rollout holds its prompts' lease most of the
    # time, so the freeze finds it holding rows whatever the machine's speed)
    result = run(cfg, factories=EngineFactories(generator=slow_generator))
    pauser.join(timeout=60)
    assert "woken_at" in seen
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))
    records = result.records
    assert sum(r["rows_returned"] for r in records) >= 1  # the controller returned its rows
    dropped = sum(r["stage_metrics"].get("rollout", {}).get("dropped_batches", 0) for r in records)
    assert dropped >= 1  # the woken holder dropped its stale batch instead of failing the run
    assert result.extra["restarts"].get("rollout", 0) == 0
    assert result.extra["stalls"] == []
    print(
        f"woken rollout host: dropped {dropped:g} batch(es), worst step "
        f"{max(r['step_s'] for r in records):.2f} s"
    )


def test_a_generator_stuck_in_a_call_is_named_with_its_stacks_and_replaced(
    ray_cluster: None,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A generator whose engine call hangs (30 s, once in the run) while its host still
    answers: one WARNING names it with the Python stacks of its process, collected there
    (the stuck call's own await chain among them), the actor is killed and restarted, the
    rollout generates the batch again, and the run completes, every group trained once."""
    out = tmp_path / "run"
    steps = 10
    cfg = small_config(
        out, "deploy.mode=ray", f"train.steps={steps}", "deploy.stall_timeout_s=5", RAY_START
    )
    factories = EngineFactories(generator=stalling_generator_once)
    with caplog.at_level(logging.WARNING, logger="asyncflow"):
        result = run(cfg, factories=factories)
    b = cfg.train.groups_per_step
    assert [g for rep in result.reports for g in rep.groups] == list(range(steps * b))
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls, "no stall was named"
    text = stalls[0]
    assert "host 'rollout/instance0'" in text and "in generate for" in text
    assert "asyncio.sleep(self.stall_s)" in text  # the stuck call's stack, from its process
    assert "threads of pid" in text
    assert result.extra["stalls"][0]["replaced"] is True
    assert result.extra["restarts"].get("rollout/instance0", 0) == 1
    worst = max(r["step_s"] for r in result.records)
    print(f"generator stuck in a call: worst step {worst:.2f} s")
    assert worst < 30.0  # replaced, not waited out
    assert cli_main(["status", str(out)]) == 0  # the run's folder tells the same afterwards
    shown = capsys.readouterr().out
    print(shown)
    assert f": finished: {steps} of {steps} steps" in shown
    named = [line for line in shown.splitlines() if "on host 'rollout/instance0'" in line]
    assert "stalls so far: " in shown and named, shown
    assert named[0].startswith("  'instance0' on host") and named[0].endswith(", replaced")
    assert "rollout/instance0" in [line.split()[0] for line in shown.splitlines() if line]


def test_a_frozen_trainer_rank_of_a_ddp_group_is_replaced_and_recovers(
    ray_cluster: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Freeze trainer rank 1 of two (ddp) after step 6 for 90 s: rank 0 waits in the step's
    collective; the watch names the silent rank 1 first, kills it, and the dead rank's
    recovery (``ray_ranks``) restarts it with rank 0's state and redoes the step; the run
    finishes every step, each group trained once, no step more than 30 s over the median."""
    out = tmp_path / "run"
    k, steps = 1, 40  # (steps of 0.1 s: the freeze waits for the watch's first answer)
    cfg = small_config(
        out,
        "deploy.mode=ray",
        "train.dp_size=2",
        f"train.steps={steps}",
        f"train.max_staleness={k}",
        RAY_START,
    )
    result, seen, first = _run_frozen(cfg, 6, "-train-rank1", "train/rank1", caplog)
    text = first.getMessage()
    assert "host 'train/rank1'" in text and f"pid {int(seen['pid'])}" in text, text
    assert "killed and replaced" in text
    assert 0 < first.created - seen["frozen_at"] < FREEZE_S
    assert result.extra["restarts"].get("train/rank1", 0) >= 1
    step_s = sorted(r["step_s"] for r in result.records)
    median, worst = step_s[len(step_s) // 2], step_s[-1]
    print(
        f"trainer rank 1 frozen: named after {first.created - seen['frozen_at']:.1f} s, "
        f"worst step {worst:.2f} s, median {median:.2f} s, rank recovery "
        f"{sum(r['rank_recovery_s'] for r in result.records):.2f} s"
    )
    assert worst <= median + 30.0, [round(r["step_s"], 2) for r in result.records]
