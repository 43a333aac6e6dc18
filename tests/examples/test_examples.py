"""Every example runs as documented (with shorter settings) and writes what it promises."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import pytest
import torch

from adapters import TrainAdapter
from asyncflow import load_config
from asyncflow.workflow import Workflow
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

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


def test_grpo_tool_use_writes_episode_metrics_per_step(tmp_path: Path) -> None:
    out = _run(
        "examples/grpo_tool_use.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=4",
        "model.warm_start_steps=20",  # the recipe's 108 steps take ~15 s: the path, shortened
        "output.progress=false",
    )
    assert "mean reward" in out and "tool calls per episode" in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(4))
    for r in lines:
        assert 1.0 <= r["turns_mean"] <= 3.0  # what the environment counts, and nothing else:
        assert set(r["env_counters"]) <= {
            "tool_calls",
            "tool_errors",
            "correct",
            "truncated_observations",
        }
        assert sum(r["episode_end_reasons"].values()) == r["samples"]
    assert (tmp_path / "reward.png").is_file() and (tmp_path / "timeline.json").is_file()
    assert (tmp_path / "policy" / "model.safetensors").is_file()


def test_grpo_reasoning_gym_trains_on_the_librarys_rows_with_a_held_out_eval(
    tmp_path: Path,
) -> None:
    pytest.importorskip("reasoning_gym", reason="needs the reasoning-gym extra")
    out = _run(
        "examples/grpo_reasoning_gym.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=4",
        "eval.every_steps=2",
        "eval.prompts=8",
        "model.warm_start_steps=10",
        "output.progress=false",
    )
    assert "mean reward" in out and "held-out eval reward" in out
    config = (tmp_path / "config.yaml").read_text()
    assert "reasoning_gym" in config and "basic_arithmetic" in config
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(4))
    assert all(0.0 <= r["reward"] <= 1.0 for r in lines)  # the dataset's scores
    assert [r["step"] for r in lines if "eval" in r] == [1, 3]
    assert (tmp_path / "reward.png").is_file() and (tmp_path / "policy").is_dir()


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


def _example(name: str) -> ModuleType:
    """An example file as a module (examples/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _ReadsResponseLen(TrainAdapter):
    """The train stage, also reading the custom reward stage's ``response_len`` column from
    TransferQueue (a later stage, as the example promises), keeping what it saw per row."""

    seen: ClassVar[dict[int, tuple[int, int, torch.Tensor]]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.input_fields = (*self.input_fields, "response_len")

    async def train_batch(
        self, meta: BatchMeta, cols: dict[str, Column], advantages: torch.Tensor, loss_scale: float
    ) -> tuple[dict[str, float], int]:
        lens, responses = cols["response_len"], cols["response_ids"]
        behaviour = cols["behaviour_logprobs"]
        assert isinstance(lens, torch.Tensor) and lens.dtype == torch.int32
        assert isinstance(responses, Ragged) and isinstance(behaviour, Ragged)
        for i, n, ids, lp in zip(
            meta.indexes.tolist(),
            lens.tolist(),
            responses.unbind(),
            behaviour.unbind(),
            strict=True,
        ):
            self.seen[i] = (n, int(ids.numel()), lp.clone())
        return await super().train_batch(meta, cols, advantages, loss_scale)


def test_custom_engine_example_writes_its_columns(tmp_path: Path) -> None:
    """The example's engine and adapter in a synchronous run: the ``response_len`` column the
    custom reward stage writes holds each row's response length, and the behaviour log-probs
    the custom engine records are those of the policy being trained."""
    example = _example("custom_engine.py")
    _ReadsResponseLen.seen.clear()
    steps = 3
    cfg = load_config(
        overrides=[
            f"output.dir={tmp_path}",
            "output.progress=false",
            "output.loggers=[jsonl]",
            "output.plot=false",
            f"train.steps={steps}",
            "train.max_staleness=0",  # every sample from the weights being trained
        ]
    )
    result = Workflow(
        cfg,
        example.custom_components(cfg),
        adapters={"reward": example.RewardWithLength, "train": _ReadsResponseLen},
    ).run()
    seen = _ReadsResponseLen.seen
    assert len(seen) == steps * cfg.train.groups_per_step * cfg.rollout.group_size
    for i, (written, length, logprobs) in seen.items():
        assert written == length >= 1, i
        assert logprobs.shape == (length,) and bool((logprobs <= 0).all()), i
    assert len({n for n, _, _ in seen.values()}) > 1  # lengths vary: not a constant column
    # trainer and engine agree on every sample's log-prob (one step off-policy, the mean log
    # ratio is of the order of 0.01-0.05 here)
    assert all(abs(r["behaviour_log_ratio"]) < 1e-3 for r in result.records), result.records


@pytest.mark.parametrize("mode", [[], ["--service"]], ids=["embedded", "service"])
def test_transferqueue_quickstart(mode: list[str]) -> None:
    out = _run("examples/transferqueue_quickstart.py", *mode)
    assert "rows still stored: 0" in out


@pytest.mark.slow  # ~40 s on 2 loaded cores: OpenEnv's server imports, then the run
def test_openenv_game_trains_against_its_own_server(tmp_path: Path) -> None:
    out = _run(
        "examples/openenv_game.py",
        "--output-dir",
        str(tmp_path),
        "--max-sessions",
        "3",
        "train.steps=3",
        "model.warm_start_steps=5",
        "output.progress=false",
    )
    assert "mean reward" in out and "(max_sessions=3)" in out
    served = int(out.split("the server served ")[1].split()[0])
    peak = int(out.split("at most ")[1].split()[0])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(3))
    assert served >= sum(r["samples"] for r in lines) and 1 <= peak <= 3
    assert all(set(r["episode_end_reasons"]) <= {"done", "max_turns", "max_tokens"} for r in lines)
    assert (tmp_path / "reward.png").is_file() and (
        tmp_path / "policy" / "model.safetensors"
    ).is_file()


def test_grpo_openai_agent_trains_the_agent_through_the_endpoint(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    out = _run(
        "examples/grpo_openai_agent.py",
        "--output-dir",
        str(tmp_path),
        "train.steps=3",
        "model.warm_start_steps=20",  # the recipe's 108 steps take ~15 s: the path, shortened
        "output.progress=false",
    )
    assert "mean reward" in out and "turns per episode" in out
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(3))
    for r in lines:
        assert 1.0 <= r["turns_mean"] <= 3.0  # the agent's calls, one trajectory per episode
        assert sum(r["episode_end_reasons"].values()) == r["samples"]
        assert set(r["episode_end_reasons"]) <= {"done", "max_turns", "max_tokens"}
