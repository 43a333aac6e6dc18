"""``ReferenceAdapter``: per-token log-probs of the responses under a frozen reference policy.

| consumes                  | produces                          |
|---------------------------|-----------------------------------|
| prompt_ids, response_ids  | ref_logprobs (ragged float32)     |
"""

from __future__ import annotations

import asyncio

import torch

from adapters.base import Adapter, StageOutput
from engines.protocols import ScoringEngine
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = ["ReferenceAdapter"]


class ReferenceAdapter(Adapter):
    """Scoring engine as the reference stage (for the KL term of the loss)."""

    task = "reference"
    input_fields = ("prompt_ids", "response_ids")
    output_fields = ("ref_logprobs",)

    def __init__(self, engine: ScoringEngine, *, batch_size: int = 16) -> None:
        self.engine = engine
        self.batch_size = batch_size

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        prompts, responses = cols["prompt_ids"], cols["response_ids"]
        if not isinstance(prompts, Ragged) or not isinstance(responses, Ragged):
            raise TypeError("reference needs ragged prompt_ids and response_ids")
        logps = await asyncio.to_thread(
            self.engine.logprobs,
            [p.long() for p in prompts.unbind()],
            [r.long() for r in responses.unbind()],
        )
        return StageOutput(
            columns={"ref_logprobs": [lp.to(torch.float32) for lp in logps]},
            tokens=int(responses.values.numel()),
        )
