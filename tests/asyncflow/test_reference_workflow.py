"""The reference (KL) path end to end on the tiny model: the reference stage scores every
sample, its log-probs reach training unchanged through TransferQueue, and the KL is recorded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from adapters import ReferenceAdapter, StageOutput, TrainAdapter
from asyncflow import EngineFactories, RunConfig, run
from engines.protocols import RewardFn
from tests.asyncflow.conftest import small_config
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column


class _RecordingReference(ReferenceAdapter):
    """The built-in reference stage, keeping what it wrote per row."""

    written: ClassVar[dict[int, torch.Tensor]] = {}

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        out = await super().process(meta, cols)
        for i, lp in zip(meta.indexes.tolist(), out.columns["ref_logprobs"], strict=True):
            self.written[i] = lp.clone()
        return out


class _RecordingTrain(TrainAdapter):
    """The built-in train stage, keeping the reference log-probs it trained with per row."""

    seen: ClassVar[dict[int, torch.Tensor]] = {}

    async def train_batch(
        self, meta: BatchMeta, cols: dict[str, Column], advantages: torch.Tensor, loss_scale: float
    ) -> tuple[dict[str, float], int]:
        ref, responses = cols["ref_logprobs"], cols["response_ids"]
        assert isinstance(ref, Ragged) and isinstance(responses, Ragged)
        assert torch.equal(ref.lengths, responses.lengths)  # one log-prob per response token
        for i, lp in zip(meta.indexes.tolist(), ref.unbind(), strict=True):
            self.seen[i] = lp.clone()
        return await super().train_batch(meta, cols, advantages, loss_scale)


def _length_reward(prompts: list[str], completions: list[str], **cols: Any) -> list[float]:
    """Rewards that differ within a group from the first step on (the untrained tiny model
    earns no task reward), so that the policy moves and the KL to the reference grows."""
    return [float(len(c) % 3) for c in completions]


def _length_reward_factory(cfg: RunConfig) -> RewardFn:
    return _length_reward


def test_reference_logprobs_reach_training_and_the_kl_is_recorded(out_dir: Path) -> None:
    _RecordingReference.written.clear()
    _RecordingTrain.seen.clear()
    steps = 6
    cfg = small_config(
        out_dir,
        "reference.enabled=true",
        "reference.kl_coef=0.05",
        "reference.batch_size=4",
        f"train.steps={steps}",
        "train.lr=0.01",  # the policy moves away from the reference within a few steps
    )
    result = run(
        cfg,
        factories=EngineFactories(reward=_length_reward_factory),
        adapters={"reference": _RecordingReference, "train": _RecordingTrain},
    )
    rows = steps * cfg.train.groups_per_step * cfg.rollout.group_size
    written, seen = _RecordingReference.written, _RecordingTrain.seen
    assert len(seen) == rows and set(seen) <= set(written)  # every trained row was scored
    for i, lp in seen.items():  # bit for bit what the reference stage wrote
        assert lp.dtype == torch.float32 and torch.equal(lp, written[i]), i
        assert bool((lp <= 0).all()) and bool(torch.isfinite(lp).all())
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    kl = [x["kl"] for x in lines]
    assert [x["step"] for x in lines] == list(range(steps))
    assert all(math.isfinite(v) and v >= 0 for v in kl), kl
    # step 0 trains the initial policy, which is the reference: KL 0 up to rounding; later
    # steps train a policy that has moved, so the KL the loss pays for is no longer 0
    assert kl[0] < 1e-4 and max(kl[1:]) > 10 * max(kl[0], 1e-7), kl
    assert result.timeline.intervals["reference"]  # the stage ran on its own lane
