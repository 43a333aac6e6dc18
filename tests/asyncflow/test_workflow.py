"""The GRPO workflow end to end on the tiny model: staleness bound, whole groups, errors.

Every invariant test runs in both deployments: ``local`` (stages as asyncio tasks) and ``ray``
(every stage instance a Ray actor, a data-parallel trainer of two ranks). Custom engines reach
Ray actors through :class:`asyncflow.EngineFactories` of module-level functions.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest

from asyncflow import EngineFactories, RunConfig, StageError, run
from tests.asyncflow.conftest import small_config
from tests.asyncflow.faulty import (
    BadWeights,
    DyingEngine,
    raising_reward_factory,
    wrapped_generator,
)

ERROR_BOUND_S = {"local": 120.0, "ray": 480.0}
"""How long a failing run may take, start-up included: generous (a loaded 2-core machine
starting Ray actors for every stage), but finite: a hang fails the test."""


@pytest.mark.parametrize("k", [0, 1, 2])
def test_staleness_bound_holds_and_every_group_is_trained_once(
    out_dir: Path, deploy: list[str], k: int
) -> None:
    cfg = small_config(out_dir, f"train.max_staleness={k}", "train.steps=8", *deploy)
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
    # the reward stage's own metric reaches the records (a mean over the rows it scored)
    scored = [x["stage_metrics"]["reward"]["reward_mean"] for x in lines if x["stage_metrics"]]
    assert scored and all(0.0 <= r <= 1.0 for r in scored)
    # the newest generator version never lags the trained version by more than k + 1
    assert all(x["version"] - x["generator_version"] <= k + 1 for x in lines)


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


def _errors_within_bound(cfg: RunConfig, factories: EngineFactories, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(StageError, match=match):
        run(cfg, factories=factories)
    assert time.monotonic() - t0 < ERROR_BOUND_S[cfg.deploy.mode]


def test_error_in_reward_stage_is_a_clear_error_not_a_hang(
    out_dir: Path, deploy: list[str]
) -> None:
    _errors_within_bound(
        small_config(out_dir, *deploy),
        EngineFactories(reward=raising_reward_factory),
        r"stage 'reward.*' failed: .*reward model exploded",
    )


def test_error_in_rollout_stops_every_stage(out_dir: Path, deploy: list[str]) -> None:
    _errors_within_bound(
        small_config(out_dir, *deploy),
        EngineFactories(generator=functools.partial(wrapped_generator, DyingEngine)),
        r"rollout.*generator lost its device",
    )


def test_failing_weight_update_names_the_generator_instead_of_hanging(
    out_dir: Path, deploy: list[str]
) -> None:
    _errors_within_bound(
        small_config(out_dir, *deploy),
        EngineFactories(generator=functools.partial(wrapped_generator, BadWeights)),
        r"stage 'rollout/instance\d.*' failed: .*weights do not fit the model",
    )
