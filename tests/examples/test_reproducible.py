"""The demo is reproducible where docs/asyncflow/staleness.md says it is: `deploy=local` with
one generator and `max_staleness=0` gives the same rewards at every step and the same trained
weights for the same seed, however the two runs are timed, with the engine in the run's
process or in one of its own (`rollout.engine_process`)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _demo(out: Path, *overrides: str) -> tuple[list[float], str]:
    proc = subprocess.run(
        [sys.executable, "examples/grpo_arithmetic.py", "--output-dir", str(out), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward"] for line in (out / "metrics.jsonl").open()]
    weights = hashlib.sha256((out / "policy" / "model.safetensors").read_bytes()).hexdigest()
    return rewards, weights


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("train.steps=40", "train.max_staleness=0"),
        ("train.steps=40", "train.max_staleness=0", "rollout.engine_process=true"),
    ],
    ids=["in-process", "engine-process"],
)
def test_the_demo_twice_gives_the_same_rewards_and_weights(
    tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    first = _demo(tmp_path / "a", *overrides)
    second = _demo(tmp_path / "b", *overrides)
    steps = int(overrides[0].split("=")[1])
    assert len(first[0]) == steps
    assert first[0] == second[0]  # every step's mean reward, exactly
    assert first[1] == second[1]  # the trained policy, bit for bit
    assert len(set(first[0])) > 1  # it trained on varied batches, not a constant
