"""An RL run over a TransferQueue service whose controller is SIGKILLed mid-run and
restarted with its state (``state_dir``): with ``transferqueue.ride_through_s`` the run goes
on, and every step still trains exactly its window, each group once and whole, within the
staleness bound; without it, the run ends with an error naming the fix."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import transferqueue
from asyncflow import EngineFactories, StageError, run
from asyncflow.config import RunConfig
from asyncflow.workflow import RunResult
from tests.asyncflow.conftest import small_config
from tests.asyncflow.faulty import slow_reward_factory

pytestmark = [pytest.mark.service, pytest.mark.slow]

STEPS, PER_STEP, K = 8, 2, 1
SLACK_S = 180.0


def _run_killing_the_controller(
    tmp_path: Path, ride_through_s: float
) -> tuple[RunConfig, RunResult | BaseException, int]:
    """Run against a service with a state dir; SIGKILL its controller once the first step
    is recorded. Returns the config, the result (or the error) and the restarts seen."""
    out = tmp_path / "run"
    with transferqueue.serve(num_units=2, state_dir=tmp_path / "state") as svc:
        cfg = small_config(
            out,
            "deploy.mode=local",
            "transferqueue.mode=connect",
            f"transferqueue.address={svc.address}",
            f"transferqueue.ride_through_s={ride_through_s}",
            f"train.steps={STEPS}",
            f"train.groups_per_step={PER_STEP}",
            f"train.max_staleness={K}",
        )
        killed = threading.Event()

        def kill_after_first_step() -> None:
            metrics = out / "metrics.jsonl"
            deadline = time.monotonic() + SLACK_S
            while time.monotonic() < deadline:
                if metrics.exists() and metrics.read_text().strip():
                    os.kill(svc.pids[-1], signal.SIGKILL)
                    killed.set()
                    return
                time.sleep(0.05)

        killer = threading.Thread(target=kill_after_first_step, daemon=True)
        killer.start()
        outcome: RunResult | BaseException
        try:
            outcome = run(cfg, factories=EngineFactories(reward=slow_reward_factory))
        except StageError as e:
            outcome = e
        killer.join(timeout=SLACK_S)
        assert killed.is_set(), "the run ended before a step was recorded"
        deadline = time.monotonic() + SLACK_S
        while svc.controller_restarts[0] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        return cfg, outcome, svc.controller_restarts[0]


def test_a_run_rides_through_its_controller_killed_and_restarted(tmp_path: Path) -> None:
    cfg, result, restarts = _run_killing_the_controller(tmp_path, ride_through_s=SLACK_S)
    assert restarts == 1
    assert isinstance(result, RunResult), result
    assert [r.step for r in result.reports] == list(range(STEPS))
    for r in result.reports:
        assert r.groups == list(range(r.step * PER_STEP, (r.step + 1) * PER_STEP))
        assert r.samples == PER_STEP * cfg.rollout.group_size
        assert min(r.staleness) >= 0 and max(r.staleness) <= K
    # the step that met the kill costs the controller's restart and recovery: seconds
    times = sorted(r["step_s"] for r in result.records)
    median, worst = times[len(times) // 2], times[-1]
    print(f"controller process killed: worst step {worst:.2f} s, median {median:.2f} s")
    assert worst <= median + 10.0, [round(t, 2) for t in times]


def test_without_ride_through_a_dead_controller_ends_the_run_naming_the_fix(
    tmp_path: Path,
) -> None:
    _, result, _ = _run_killing_the_controller(tmp_path, ride_through_s=0.0)
    assert isinstance(result, StageError), result
    assert "PeerGoneError" in str(result) and "ride_through_s" in str(result)
