"""Per-token versions through the train stage: what a step reports about each sample's
versions (the per-step metrics made of them: tests/asyncflow/test_workflow.py and
test_simulated_workflow.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from adapters import StepReport, TrainAdapter
from engines.protocols import TrainBatch
from transferqueue import BatchMeta, Ragged


class _Trainer:
    """A training engine that only counts: what the train stage's bookkeeping needs."""

    def __init__(self) -> None:
        self.version = 0
        self.batches: list[TrainBatch] = []

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        self.batches.append(batch)
        return {"loss": 0.0}

    def optimizer_step(self) -> dict[str, float]:
        self.version += 1
        return {"grad_norm": 0.0}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}


def _rows(
    group: int, versions: list[list[int]], generated_at: list[float], dispatch: int = 0
) -> tuple[BatchMeta, dict]:
    """Rows of one group as the rollout writes them (``versions`` per token, -1: an
    observation token); the header is the oldest model token's version, else the given
    ``dispatch`` version of the instance (an episode the model wrote nothing of)."""
    n = len(versions)
    idx = np.arange(n) + 10 * group
    oldest = np.array([min((x for x in v if x >= 0), default=dispatch) for v in versions])
    meta = BatchMeta(idx, idx * 0, idx * 0 + group, oldest, idx * 0 + 8, "train")
    cols = {
        "prompt_ids": Ragged.from_tensors([torch.arange(4)] * n),
        "response_ids": Ragged.from_tensors(
            [torch.ones(len(v), dtype=torch.int32) for v in versions]
        ),
        "behaviour_logprobs": Ragged.from_tensors([-torch.ones(len(v)) for v in versions]),
        "reward": torch.tensor([1.0, 0.0][:n]),
        "token_versions": Ragged.from_tensors(
            [torch.tensor(v, dtype=torch.int32) for v in versions]
        ),
        "generated_at": torch.tensor(generated_at, dtype=torch.float64),
        "loss_mask": Ragged.from_tensors([torch.tensor(v) >= 0 for v in versions]),
        "num_turns": torch.ones(n, dtype=torch.int32),
        "end_reason": ["done"] * n,
        "episode_info": [{} for _ in range(n)],
        "episode_stats": [{} for _ in range(n)],
    }
    return meta, cols


def test_a_step_reports_each_samples_oldest_newest_and_ended_version() -> None:
    """Step 1 trains two samples whose oldest token is version 0: one generated across the
    update to version 1 (it ended after step 0: all its staleness was gained generating), one
    that ended before step 0 and waited (all of it gained queued)."""
    reports: list[StepReport] = []

    async def keep(report: StepReport) -> None:
        reports.append(report)

    trainer = _Trainer()
    adapter = TrainAdapter(trainer, group_size=2, groups_per_step=1, on_step=keep)

    async def go() -> None:
        before = time.time()
        await adapter.process(*_rows(0, [[0, 0], [0, 0, 0]], [before, before]))
        await adapter.after_batch()
        after = time.time() + 1.0  # after step 0 ended
        await adapter.process(*_rows(1, [[0, 1, 1], [0, 0]], [after, before]))
        await adapter.after_batch()

    asyncio.run(go())
    first, second = reports
    assert first.ended_versions == [0, 0] and first.staleness == [0, 0]
    assert second.sample_versions == [0, 0] and second.staleness == [1, 1]
    assert second.newest_versions == [1, 0]
    assert second.ended_versions == [1, 0]
    # the per-token versions reach the engine for objectives that weigh tokens by version
    assert [v.tolist() for v in trainer.batches[1].extra["token_versions"]] == [[0, 1, 1], [0, 0]]


def test_observation_tokens_count_in_no_version() -> None:
    """Episodes: observation tokens carry version -1. Step 1 trains an episode whose first turn
    was sampled by version 0 and whose second turn (after an observation) by version 1: it
    spans 0..1; and an episode the environment ended before the model's first token (every
    token an observation; its header is the version of the instance it ran on, 1): its newest
    version is that header, never -1. The -1 tokens reach the engine as they are (the loss
    mask and the proximal interpolation leave them out)."""
    reports: list[StepReport] = []

    async def keep(report: StepReport) -> None:
        reports.append(report)

    trainer = _Trainer()
    adapter = TrainAdapter(trainer, group_size=2, groups_per_step=1, on_step=keep)

    async def go() -> None:
        now = time.time()
        await adapter.process(*_rows(0, [[0, 0], [0, 0]], [now, now]))
        await adapter.after_batch()
        episodes = [[0, 0, -1, -1, 1, 1], [-1, -1, -1]]
        await adapter.process(*_rows(1, episodes, [now + 1.0, now + 1.0], dispatch=1))
        await adapter.after_batch()

    asyncio.run(go())
    second = reports[1]
    assert second.sample_versions == [0, 1]
    assert second.newest_versions == [1, 1]
    sent = trainer.batches[1]
    assert [v.tolist() for v in sent.extra["token_versions"]] == [
        [0, 0, -1, -1, 1, 1],
        [-1, -1, -1],
    ]
    assert sent.loss_mask is not None
    masks = [m.tolist() for m in sent.loss_mask]
    assert masks == [[True, True, False, False, True, True], [False, False, False]]
