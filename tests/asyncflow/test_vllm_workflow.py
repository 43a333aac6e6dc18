"""The GRPO workflow with vLLM rollout (``rollout.engine=vllm``) and HF training, end to end.

Each test builds its engines from a config, runs a few steps through TransferQueue and checks
that every step trained whole groups within the staleness bound and that the trainer's weights
reached the vLLM engine: the engine's version advanced, and samples of later steps carry the
newer versions vLLM labelled their tokens with. vLLM starts in ~15-35 s on 2 CPU cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncflow import RunConfig, RunResult, Workflow, build_components
from engines.vllm_engine import VLLMGenerationEngine
from tests.asyncflow.conftest import small_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def transfer_dir(tmp_path: Path) -> Iterator[str]:
    """A folder for the weight-transfer files, removed afterwards with whatever an update cut
    short by the end of the run left in it (RAM-backed /dev/shm when it has room)."""
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 << 30
    with tempfile.TemporaryDirectory(dir=shm if roomy else tmp_path) as folder:
        yield folder


async def _run(cfg: RunConfig) -> tuple[RunResult, VLLMGenerationEngine]:
    """Run with engines built here, closed on this loop (vLLM's shutdown needs its loop)."""
    comps = await asyncio.to_thread(build_components, cfg)
    try:
        (engine,) = comps.generators
        assert isinstance(engine, VLLMGenerationEngine)
        result = await Workflow(cfg, comps).run_async()
    finally:
        comps.close()
    assert engine.closed
    return result, engine


def _check(result: RunResult, engine: VLLMGenerationEngine, cfg: RunConfig, out: Path) -> None:
    steps, k = cfg.train.steps, cfg.train.max_staleness
    b, n = cfg.train.groups_per_step, cfg.rollout.group_size
    assert [r.step for r in result.reports] == list(range(steps))
    for rep in result.reports:
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        assert rep.samples == b * n
        assert min(rep.staleness) >= 0, rep.staleness
        assert max(rep.staleness) <= k, rep.staleness
        assert all(0 <= v <= rep.step for v in rep.sample_versions)
    for j, v in result.admission:
        assert j < (v + k + 1 + cfg.prefetch_steps()) * b
    # The updates reached vLLM: its weights moved on, and the last step (groups admitted only
    # once the generator held version >= steps - 1 - k) was sampled by updated weights.
    assert engine.stats["updates"] >= 1
    assert result.extra["weight_updates"] >= 1
    assert engine.version >= steps - 1 - k >= 1
    assert min(result.reports[-1].sample_versions) >= steps - 1 - k
    generator_versions = [r["generator_version"] for r in result.records]
    assert generator_versions == sorted(generator_versions)
    assert generator_versions[-1] >= 1
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    assert all("reward" in x and x["stages"]["rollout"]["tokens_per_s"] >= 0 for x in lines)


def test_tiny_model_with_vllm_rollout(out_dir: Path, transfer_dir: str) -> None:
    cfg = small_config(
        out_dir,
        "rollout.engine=vllm",
        f"rollout.engine_options={{kv_cache_gib: 0.25, transfer_dir: {transfer_dir}}}",
        "rollout.concurrency=2",
        "train.steps=3",
        "train.max_staleness=1",
    )
    result, engine = asyncio.run(_run(cfg))
    assert engine.config.dtype == "float32"  # behaviour log-probs in the trainer's precision
    assert engine.config.max_model_len == 512  # the tiny model's context, not vLLM's 2048
    _check(result, engine, cfg, out_dir)


@pytest.mark.smollm2
def test_smollm2_with_vllm_rollout(out_dir: Path, transfer_dir: str) -> None:
    cfg = small_config(
        out_dir,
        "model.name=smollm2",
        "rollout.engine=vllm",
        f"rollout.engine_options={{kv_cache_gib: 0.5, transfer_dir: {transfer_dir}}}",
        "rollout.max_new_tokens=16",
        "task.options={prompt_template: 'Calculate {expression}. Reply with only the result.'}",
        "train.groups_per_step=1",
        "train.steps=3",
        "train.lr=1.0e-5",
        "train.max_staleness=1",
    )
    result, engine = asyncio.run(_run(cfg))
    _check(result, engine, cfg, out_dir)


@pytest.mark.smollm2
def test_smollm2_example_runs_as_documented(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "examples/grpo_smollm2.py",
            "--output-dir",
            str(tmp_path),
            "train.steps=2",
            "train.groups_per_step=1",
            "rollout.group_size=4",
            "rollout.max_new_tokens=16",
            "output.progress=false",
            "output.loggers=[jsonl]",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mean reward" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert all(isinstance(r["reward"], float) for r in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollout_tokens"] > 0
    assert (tmp_path / "reward.png").is_file()
