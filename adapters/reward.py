"""``RewardAdapter``: decoded completions in, one reward per sample out.

| consumes                               | produces                                      |
|----------------------------------------|-----------------------------------------------|
| prompt (object text), response_ids,    | reward (dense float32; NaN where the reward   |
| plus ``columns`` (e.g. answer)         | function gave None: no verdict)               |

The reward function is a plain callable (``engines.protocols.RewardFn``), called in a worker
thread with the prompt texts, the decoded completions, and the extra object columns as
keyword arguments.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from adapters.base import Adapter, StageOutput
from engines.hf.text import decode_responses
from engines.protocols import RewardFn
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

if TYPE_CHECKING:  # (transformers loads where a tokenizer is built)
    from transformers import PreTrainedTokenizerBase

__all__ = ["RewardAdapter"]


class RewardAdapter(Adapter):
    """Reward function as the reward stage."""

    task = "reward"
    output_fields = ("reward",)

    def __init__(
        self,
        reward_fn: RewardFn,
        tokenizer: PreTrainedTokenizerBase,
        *,
        columns: Sequence[str] = ("answer",),
        batch_size: int = 32,
    ) -> None:
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.columns = tuple(columns)
        self.input_fields = ("prompt", "response_ids", *self.columns)
        self.batch_size = batch_size

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        responses = cols["response_ids"]
        prompts = cols["prompt"]
        if not isinstance(responses, Ragged) or not isinstance(prompts, list):
            raise TypeError("reward needs response_ids (ragged) and prompt (object) columns")
        completions = decode_responses(self.tokenizer, responses.unbind())
        extra: dict[str, Any] = {c: cols[c] for c in self.columns}
        rewards = await asyncio.to_thread(self.reward_fn, prompts, completions, **extra)
        if len(rewards) != len(meta):
            raise RuntimeError(f"reward function returned {len(rewards)} values for {len(meta)}")
        values = torch.tensor(
            [math.nan if r is None else float(r) for r in rewards], dtype=torch.float32
        )
        valid = values[~values.isnan()]
        return StageOutput(
            columns={"reward": values},
            metrics={"reward_mean": float(valid.mean()) if valid.numel() else math.nan},
        )
