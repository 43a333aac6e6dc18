"""The train stage over a real (embedded) TransferQueue: dynamic sampling's filter and windows,
token-budget micro-batches. The engine records what it is given; every response token is its
group's id, so the test sees which groups each call trained."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

import transferqueue
from adapters import StepReport, TrainAdapter
from adapters.episodes import episode_columns
from adapters.train import FILTER_LIMIT, tied_groups
from asyncflow.metrics import Timeline
from asyncflow.stage_runner import StageError, StageRunner
from engines.episodes import Episode
from engines.protocols import Generation, TrainBatch
from transferqueue.aio import within

N = 4  # rows per group
BOUND_S = 60.0


class _Recorder:
    """A training engine that trains nothing and keeps each call's groups and tokens."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[list[int], int]] = []  # (groups, prompt + response tokens)
        self.steps: list[list[int]] = []
        self._step: list[int] = []

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        groups = sorted({int(r[0]) for r in batch.response_ids})
        tokens = sum(
            int(p.numel() + r.numel())
            for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)
        )
        self.calls.append((groups, tokens))
        self._step += [int(r[0]) for r in batch.response_ids]
        return {"loss": 0.0, "num_samples": float(len(batch))}

    def optimizer_step(self) -> dict[str, float]:
        self.steps.append(sorted(set(self._step)))
        self._step = []
        self.version += 1
        return {"grad_norm": 0.0}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}


def _put(
    tq: transferqueue.TransferQueue,
    rewards: dict[int, list[float]],
    lengths: Any,
    failed: frozenset[tuple[int, int]] = frozenset(),
) -> None:
    """Whole groups: response ``g`` repeated (length from ``lengths(g, i)``), a 3-token
    prompt, the given rewards, the columns the rollout writes (every token of version 0;
    episode ``i`` of group ``g`` ended ``env_error`` where ``(g, i)`` is in ``failed``); then
    the partition is finished."""
    client = tq.client()
    client.declare_tasks(["train"], partition="train")
    responses, groups, reward, reasons = [], [], [], []
    for g, rs in rewards.items():
        for i, r in enumerate(rs):
            responses.append(torch.full((lengths(g, i),), g, dtype=torch.int32))
            groups.append(g)
            reward.append(r)
            reasons.append("env_error" if (g, i) in failed else "done")
    n = len(groups)
    gens = [Generation(r.long(), torch.zeros(len(r)), "stop", version=0) for r in responses]
    episodes = [
        dataclasses.replace(Episode.single(g), end_reason=reason)
        for g, reason in zip(gens, reasons, strict=True)
    ]
    client.put(
        {
            "prompt_ids": [torch.ones(3, dtype=torch.int32)] * n,
            **episode_columns(episodes),
            "reward": torch.tensor(reward, dtype=torch.float32),
            "generated_at": torch.zeros(n, dtype=torch.float64),
        },
        group=np.asarray(groups),
        version=0,
        partition="train",
    )
    client.finish("train")


def _train(tq: transferqueue.TransferQueue, adapter: TrainAdapter) -> None:
    runner = StageRunner("train", adapter, tq.async_client(), Timeline(), partition="train")
    asyncio.run(within(runner.run(), BOUND_S))


def test_tied_groups() -> None:
    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, nan, nan, 0.5, nan, 2.0, 2.0])
    groups = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    # 0: all equal; 1: differ; 2: no finite reward; 3: one finite; 4: equal
    assert tied_groups(rewards, groups) == [0, 2, 3, 4]


def test_filtered_groups_are_acked_counted_never_trained_and_the_window_grows() -> None:
    """B = 2. Groups 1 and 2 tie (all 1.0; all NaN but one), so step 0's window grows to
    0..3; group 4 ties, so step 1 takes 5 and 6; step 2 takes 7 and 8. Every row is
    consumed (the stream ends) and no tied group reaches the engine."""
    varied = [0.0, 1.0, 0.0, 1.0]
    rewards = {g: varied for g in range(9)}
    rewards[1] = [1.0] * N
    rewards[2] = [float("nan")] * 3 + [1.0]
    rewards[4] = [0.0] * N
    engine = _Recorder()
    reports: list[StepReport] = []
    told: list[list[int]] = []

    async def on_step(report: StepReport) -> None:
        reports.append(report)

    async def on_filtered(groups: list[int]) -> None:
        told.append(groups)

    adapter = TrainAdapter(
        engine,  # type: ignore[arg-type]
        group_size=N,
        groups_per_step=2,
        micro_batch_groups=2,
        dynamic_sampling=True,
        on_step=on_step,
        on_filtered=on_filtered,
    )
    with transferqueue.start(num_units=1) as tq:
        _put(tq, rewards, lambda g, i: 2)
        _train(tq, adapter)
        assert (
            tq.client().stats()["controller"]["partitions"]["train"]["tasks"]["train"]["queued"]
            == 0
        )
    assert engine.steps == [[0, 3], [5, 6], [7, 8]]
    assert [r.groups for r in reports] == engine.steps
    assert [r.filtered for r in reports] == [[1, 2], [4], []]
    assert [r.next_group for r in reports] == [4, 7, 9]
    assert [r.samples for r in reports] == [2 * N] * 3  # every step trains B whole groups
    assert sorted(g for batch in told for g in batch) == [1, 2, 4]  # each told once
    trained = {g for groups, _ in engine.calls for g in groups}
    assert trained.isdisjoint({1, 2, 4})


def test_a_group_with_a_failed_environment_is_dropped_whole_and_refilled() -> None:
    """B = 2, no dynamic sampling. One episode of group 1 and one of group 3 ended
    ``env_error``: both groups are dropped whole (their other episodes succeeded, and are not
    trained either), counted, told to ``on_filtered`` (the feeder refills them), and the
    windows grow: step 0 trains 0 and 2, step 1 trains 4 and 5."""
    varied = [0.0, 1.0, 0.0, 1.0]
    rewards = {g: varied for g in range(6)}
    engine = _Recorder()
    reports: list[StepReport] = []
    told: list[list[int]] = []

    async def on_step(report: StepReport) -> None:
        reports.append(report)

    async def on_filtered(groups: list[int]) -> None:
        told.append(groups)

    adapter = TrainAdapter(
        engine,  # type: ignore[arg-type]
        group_size=N,
        groups_per_step=2,
        micro_batch_groups=1,
        on_step=on_step,
        on_filtered=on_filtered,
    )
    with transferqueue.start(num_units=1) as tq:
        _put(tq, rewards, lambda g, i: 2, failed=frozenset({(1, 2), (3, 0)}))
        _train(tq, adapter)
    assert engine.steps == [[0, 2], [4, 5]]
    assert [r.dropped for r in reports] == [[1], [3]] and [r.filtered for r in reports] == [
        [1],
        [3],
    ]
    assert [r.samples for r in reports] == [2 * N] * 2  # whole groups only
    assert sorted(g for batch in told for g in batch) == [1, 3]
    assert {g for groups, _ in engine.calls for g in groups}.isdisjoint({1, 3})
    # the step's episodes, dropped ones included: 3 groups of N, one env_error in each of two
    assert reports[0].episodes["episode_end_reasons"] == {"done": 3 * N - 1, "env_error": 1}


def test_without_dynamic_sampling_tied_groups_are_trained() -> None:
    rewards = {g: [1.0] * N for g in range(4)}
    engine = _Recorder()
    adapter = TrainAdapter(engine, group_size=N, groups_per_step=2)  # type: ignore[arg-type]
    with transferqueue.start(num_units=1) as tq:
        _put(tq, rewards, lambda g, i: 2)
        _train(tq, adapter)
    assert engine.steps == [[0, 1], [2, 3]]


def test_a_step_that_filters_everything_fails_naming_the_option() -> None:
    rewards = {g: [1.0] * N for g in range(FILTER_LIMIT + 2)}
    adapter = TrainAdapter(
        _Recorder(),  # type: ignore[arg-type]
        group_size=N,
        groups_per_step=1,
        dynamic_sampling=True,
    )
    with transferqueue.start(num_units=1) as tq:
        _put(tq, rewards, lambda g, i: 2)
        with pytest.raises(StageError, match=r"train\.dynamic_sampling=false"):
            _train(tq, adapter)


@pytest.mark.parametrize("budget", [16, 40, 1000])
def test_token_budget_micro_batches_never_exceed_the_budget(budget: int) -> None:
    """Groups of long-tailed responses (1 to 13 tokens, prompts of 3): every engine call
    holds at most ``budget`` prompt + response tokens, each step still trains its groups
    whole, and the step reports the largest call."""
    rng = np.random.default_rng(1)
    lens = {(g, i): int(rng.integers(1, 14)) for g in range(6) for i in range(N)}
    rewards = {g: [0.0, 1.0, 0.0, 1.0] for g in range(6)}
    engine = _Recorder()
    reports: list[StepReport] = []

    async def on_step(report: StepReport) -> None:
        reports.append(report)

    adapter = TrainAdapter(
        engine,  # type: ignore[arg-type]
        group_size=N,
        groups_per_step=3,
        micro_batch_groups=3,
        max_tokens_per_micro_batch=budget,
        on_step=on_step,
    )
    with transferqueue.start(num_units=1) as tq:
        _put(tq, rewards, lambda g, i: lens[(g, i)])
        _train(tq, adapter)
    assert engine.steps == [[0, 1, 2], [3, 4, 5]]
    assert all(tokens <= budget for _, tokens in engine.calls), engine.calls
    if budget < 40:
        assert len(engine.calls) > 2  # the budget did split the leases
    for r in reports:
        assert r.metrics["micro_batch_tokens_max"] <= budget
        assert r.metrics["rank_tokens_max_over_mean"] == 1.0
