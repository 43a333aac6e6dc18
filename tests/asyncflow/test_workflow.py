"""The GRPO workflow end to end on the tiny model: staleness bound, whole groups, errors."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow import StageError, build_components, run
from engines.protocols import Generation, SamplingParams
from tests.asyncflow.conftest import small_config


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_bound_holds_and_every_group_is_trained_once(out_dir: Path, k: int) -> None:
    cfg = small_config(out_dir, f"train.max_staleness={k}", "train.steps=8")
    result = run(cfg)
    n, b = cfg.rollout.group_size, cfg.train.groups_per_step
    assert [r.step for r in result.reports] == list(range(8))
    trained: list[int] = []
    for rep in result.reports:
        assert max(rep.staleness) <= k, f"step {rep.step}: staleness {rep.staleness}"
        assert min(rep.staleness) >= 0
        if k == 0:  # synchronous on-policy: every sample from the current policy
            assert set(rep.sample_versions) == {rep.step}
        # whole groups only, exactly the step's window of admitted groups
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        assert rep.samples == len(rep.groups) * n
        trained += rep.groups
    assert trained == list(range(8 * b))  # nothing dropped, nothing twice
    # admission control: group j admitted only while j < (v_gen + k + 1) * B
    for j, v in result.admission:
        assert j < (v + k + 1) * b
    if k >= 1:  # generation ran ahead of training (the point of asynchrony)
        assert any(j >= b and v == 0 for j, v in result.admission)
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(8))
    assert all("reward" in x and x["staleness_max"] <= k for x in lines)


def test_outputs_written(out_dir: Path) -> None:
    cfg = small_config(
        out_dir, "output.plot=true", "output.loggers=[jsonl,tensorboard]", "train.steps=3"
    )
    run(cfg)
    assert (out_dir / "reward.png").stat().st_size > 1000
    assert (out_dir / "config.yaml").is_file()
    assert json.loads((out_dir / "timeline.json").read_text())["train"]
    assert any((out_dir / "tensorboard").iterdir())
    # The Chrome trace: one process per stage in pipeline order, one thread per lane, and
    # every busy interval of timeline.json as a complete event of its lane.
    trace = json.loads((out_dir / "timeline.trace.json").read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    assert [processes[p] for p in sorted(processes)] == [
        "rollout",
        "reward",
        "train",
        "train steps",
    ]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    plain = json.loads((out_dir / "timeline.json").read_text())
    assert sorted(lanes.values()) == sorted(plain)
    for (pid, tid), lane in lanes.items():
        spans = [e for e in trace if e["ph"] == "X" and (e["pid"], e["tid"]) == (pid, tid)]
        assert len(spans) == len(plain[lane]) > 0
        assert all(e["name"] == processes[pid] == lane.split("/")[0] for e in spans)
    assert len([e for e in trace if e["ph"] == "C" and e["name"] == "reward"]) == 3


def _raising_reward(*args: Any, **kwargs: Any) -> list[float | None]:
    raise ValueError("reward model exploded")


def test_error_in_reward_stage_is_a_clear_error_not_a_hang(out_dir: Path) -> None:
    cfg = small_config(out_dir)
    comps = build_components(cfg)
    comps.reward_fn = _raising_reward
    t0 = time.monotonic()
    with pytest.raises(
        StageError, match="stage 'reward' failed: ValueError: reward model exploded"
    ):
        run(cfg, comps)
    assert time.monotonic() - t0 < 60


class _DyingEngine:
    """A generation engine that fails on its third call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def version(self) -> int:
        return int(self.inner.version)

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("generator lost its device")
        return list(await self.inner.generate(prompts, params))

    async def update_weights(self, state: Any, version: int) -> None:
        await self.inner.update_weights(state, version)


def test_error_in_rollout_stops_every_stage(out_dir: Path) -> None:
    cfg = small_config(out_dir)
    comps = build_components(cfg)
    comps.generators = [_DyingEngine(comps.generators[0])]
    with pytest.raises(StageError, match=r"rollout.*generator lost its device"):
        run(cfg, comps)
