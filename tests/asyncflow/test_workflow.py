"""The GRPO workflow end to end on the tiny model: staleness bound, whole groups, errors.

Every invariant test runs in every deployment: ``local`` (stages as asyncio tasks) over an
embedded TransferQueue or over a TransferQueue service, and ``ray`` (every stage instance a
Ray actor, a data-parallel trainer of two ranks). Custom engines reach
Ray actors through :class:`asyncflow.EngineFactories` of module-level functions.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from asyncflow import EngineFactories, RunConfig, StageError, run
from tests.asyncflow.conftest import deploys_by_k, small_config
from tests.asyncflow.faulty import (
    BadWeights,
    DyingEngine,
    lagging_second_generator,
    raising_reward_factory,
    wrapped_generator,
)

ERROR_BOUND_S = 120.0
"""How long a failed run may take to stop once its stages have started (generous: a loaded
2-core machine); starting them may take up to ``deploy.start_timeout_s`` before that."""


@pytest.mark.parametrize(("deploy", "k"), deploys_by_k(ray_ks=(2,)), indirect=["deploy"])
def test_staleness_bound_holds_and_every_group_is_trained_once(
    out_dir: Path, deploy: list[str], k: int
) -> None:
    """Every ``k`` in process and over the service; on Ray the most asynchronous one (the
    bound for every ``k`` on Ray: ``test_partial_rollouts_within_episodes``)."""
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
    # admission control: group j admitted only while j < (v_pub + k + 1 + p) * B (v_pub:
    # published; p: train.prefetch_steps, 1 when synchronous), and the prefetched step is
    # admitted before its weights are published (its put is off the synchronous chain)
    p = cfg.prefetch_steps()
    assert p == (1 if k == 0 else 0)
    for j, v in result.admission:
        assert j < (v + k + 1 + p) * b
    if k == 0:
        assert any(j >= b and v == 0 for j, v in result.admission)
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


@pytest.mark.parametrize(("deploy", "k"), deploys_by_k(ray_ks=()), indirect=["deploy"])
def test_partial_rollouts_bound_the_oldest_token(out_dir: Path, deploy: list[str], k: int) -> None:
    """``rollout.partial``: a weight update lands in the HF generator's running call at a
    token boundary and decoding goes on with the new weights. Every group is trained once,
    within the bound on its samples' oldest token; with k >= 1 some samples span versions;
    every weight sync is recorded with its transfer and pause times. (On Ray, where the
    generators are actors: ``test_partial_rollouts_within_episodes``, the same rule on
    episodes, one-turn rows being one-turn episodes.)"""
    cfg = small_config(
        out_dir,
        f"train.max_staleness={k}",
        "train.steps=8",
        "rollout.partial=true",
        "rollout.weight_sync=eager",
        "rollout.max_new_tokens=48",  # long enough for updates to land mid-call
        *deploy,
    )
    result = run(cfg)
    b = cfg.train.groups_per_step
    trained: list[int] = []
    for rep in result.reports:
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        for oldest, newest, ended in zip(
            rep.sample_versions, rep.newest_versions, rep.ended_versions, strict=True
        ):
            assert 0 <= rep.step - oldest <= k, f"step {rep.step}: oldest token {oldest}"
            assert oldest <= newest <= rep.step and oldest <= ended <= rep.step
        trained += rep.groups
    assert trained == list(range(8 * b))  # nothing dropped, nothing twice
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    syncs = [s for x in lines for s in x["weight_syncs"]]
    assert syncs and all(s["transfer_s"] >= 0 and s["pause_s"] >= 0 for s in syncs)
    assert all(x["staleness_max"] <= k for x in lines)
    spanned = sum(x["spanned_share"] for x in lines)
    if k == 0:
        assert spanned == 0  # synchronous: no trained sample ran across an update
    else:
        assert spanned > 0 and sum(x["kept_tokens"] for x in lines) > 0


def test_generator_version_metric_is_the_newest_generator_version(out_dir: Path) -> None:
    """One of two generators never takes new weights (the oldest version stays 0): the
    ``generator_version`` of the records follows the other one, the newest."""
    k, steps = 1, 6
    cfg = small_config(
        out_dir,
        "rollout.instances=2",
        "rollout.weight_sync=eager",
        f"train.max_staleness={k}",
        f"train.steps={steps}",
    )
    result = run(cfg, factories=EngineFactories(generator=lagging_second_generator))
    versions = [r["generator_version"] for r in result.records]
    assert versions == sorted(versions)  # the newest version never goes back
    # step t trains groups generated at version >= t - k: the newest generator holds at
    # least that when step t is recorded (the oldest, stuck at 0, would break this at t > k)
    for r in result.records:
        assert r["version"] - r["generator_version"] <= k + 1, r
        assert r["instances"] == {"rollout": 2, "reward": 1, "train": 1}
    assert versions[-1] >= steps - k - 1 > 0


RECORD_KEYS = {
    "step", "reward", "reward_std", "version", "samples", "tokens", "time_s", "step_s",
    "staleness_max", "staleness_mean", "staleness_hist", "generator_version", "stages",
    "queue", "stage_metrics", "restarts", "loss", "kl", "grad_norm", "spanned_share",
    "span_max", "staleness_gen_mean", "staleness_gen_max", "staleness_queue_mean",
    "staleness_queue_max", "weight_syncs", "kept_tokens", "restart_s", "rows_returned",
    "instances",
}  # fmt: skip
"""What every line of metrics.jsonl carries (the run's own fields, then the engine's)."""


def test_outputs_written(out_dir: Path) -> None:
    """A run with a TransferQueue service of its own writes every output, readable: a record
    per step, the reward plot as an image, the timeline and its Chrome trace."""
    steps = 3
    cfg = small_config(
        out_dir,
        "output.plot=true",
        "output.loggers=[jsonl,tensorboard]",
        f"train.steps={steps}",
        "transferqueue.mode=service",
    )
    result = run(cfg)
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    assert lines == json.loads(json.dumps(result.records))  # the file holds what run returned
    per_step = cfg.train.groups_per_step * cfg.rollout.group_size
    for x in lines:
        assert set(x) >= RECORD_KEYS, sorted(RECORD_KEYS - set(x))
        assert x["version"] == x["step"] + 1 and x["samples"] == per_step
        assert 0.0 <= x["reward"] <= 1.0 and x["kl"] == 0.0  # no reference stage: no KL
        assert set(x["stages"]) == {"rollout", "reward", "train"}
        assert all(0.0 <= st["busy"] <= 1.0 for st in x["stages"].values())
        assert sum(x["staleness_hist"].values()) == per_step
    times = [x["time_s"] for x in lines]
    assert times == sorted(times) and times[0] > 0
    # the reward plot decodes as an image with something drawn on it
    image = matplotlib.image.imread(out_dir / "reward.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert float(image.std()) > 0.01
    assert yaml.safe_load((out_dir / "config.yaml").read_text())["train"]["steps"] == steps
    assert any((out_dir / "tensorboard").iterdir())
    # timeline.json: lane -> busy intervals [start, end, samples, tokens] on the records'
    # clock (seconds since the run began): every batch ended before the last step's record
    plain = json.loads((out_dir / "timeline.json").read_text())
    assert {lane.split("/")[0] for lane in plain} == {"rollout", "reward", "train"}
    for lane, ivs in plain.items():
        assert ivs, lane
        for start, end, samples, tokens in ivs:
            assert 0.0 <= start <= end <= times[-1], (lane, start, end)
            assert samples >= 0 and tokens >= 0
    trained = sum(iv[2] for lane, ivs in plain.items() if lane == "train" for iv in ivs)
    assert trained == steps * per_step  # every trained sample on the train lane, once
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
    starting = cfg.deploy.start_timeout_s if cfg.deploy.mode == "ray" else 0.0
    assert time.monotonic() - t0 < starting + ERROR_BOUND_S


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


@pytest.mark.parametrize(("deploy", "k"), deploys_by_k(ray_ks=(0,), ks=(0,)), indirect=["deploy"])
def test_a_colocated_reward_scores_in_the_rollout_and_every_group_is_trained_once(
    out_dir: Path, deploy: list[str], k: int
) -> None:
    """``reward.colocate``: no reward stage, worker or actor; the rollout stage puts each batch
    once with its rewards, and the train stage sees the same thing: every group once, whole,
    on-policy, with rewards the run learns from. The held-out evaluation still scores its rows
    (under Ray in the rollout's host, as there is no reward worker)."""
    cfg = small_config(
        out_dir,
        f"train.max_staleness={k}",
        "train.steps=4",
        "eval.every_steps=2",
        *deploy,
        "reward.instances=1",
        "reward.colocate=true",
    )
    result = run(cfg)
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(4 * b))  # nothing dropped, nothing twice
    for rep in result.reports:
        assert rep.samples == b * cfg.rollout.group_size and set(rep.sample_versions) == {rep.step}
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(4))
    assert all(0.0 <= x["reward"] <= 1.0 for x in lines)
    stages = [x["stage_metrics"] for x in lines if x["stage_metrics"]]
    assert stages and all("reward" not in s for s in stages)  # no reward stage ran
    scored = [s["rollout"]["reward_mean"] for s in stages if "rollout" in s]
    assert scored and all(0.0 <= r <= 1.0 for r in scored)  # the rollout's own scoring
    lanes = set(result.timeline.intervals)
    assert not any(lane == "reward" or lane.startswith("reward/") for lane in lanes), lanes
    assert [x["step"] for x in lines if "eval" in x] == [1, 3]
    assert all(0.0 <= x["eval"]["reward"] <= 1.0 for x in lines if "eval" in x)
