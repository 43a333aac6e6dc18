"""Every example runs as documented (with shorter settings) and writes what it promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_grpo_arithmetic_writes_metrics_per_step(tmp_path: Path) -> None:
    out = _run(
        "examples/grpo_arithmetic.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=6",
        "output.progress=false",
    )
    assert "mean reward" in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(6))
    assert all(isinstance(r["reward"], float) for r in lines)
    assert (tmp_path / "reward.png").is_file()


def test_grpo_from_jsonl_trains_on_the_file_with_the_user_reward(tmp_path: Path) -> None:
    out = _run(
        "examples/grpo_from_jsonl.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=4",
        "output.progress=false",
    )
    assert "4 steps on arithmetic_train.jsonl" in out and "mean reward" in out
    assert "eval/reward on arithmetic_val.jsonl (greedy)" in out
    config = (tmp_path / "config.yaml").read_text()
    assert "my_rewards:exact_answer" in config and "prompt_key: question" in config
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(4))
    # the held-out file is evaluated after the last step (the default every 50 is later)
    assert [r["step"] for r in lines if "eval" in r] == [3]
    assert lines[-1]["eval"]["samples"] == 20  # every held-out line, one greedy answer each
    assert (tmp_path / "policy" / "model.safetensors").is_file()


def test_custom_engine_example(tmp_path: Path) -> None:
    out = _run(
        "examples/custom_engine.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=4",
        "output.progress=false",
    )
    assert "custom engine: 4 steps" in out


@pytest.mark.parametrize("mode", [[], ["--service"]], ids=["embedded", "service"])
def test_transferqueue_quickstart(mode: list[str]) -> None:
    out = _run("examples/transferqueue_quickstart.py", *mode)
    assert "rows still stored: 0" in out
