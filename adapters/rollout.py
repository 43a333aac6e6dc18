"""``RolloutAdapter``: prompts in, sampled responses and behaviour log-probs out.

| consumes     | produces                                                  | header set         |
|--------------|-----------------------------------------------------------|--------------------|
| prompt_ids   | response_ids (ragged int32), behaviour_logprobs (ragged   | version (weights   |
|              | float32), finish_reason (object)                          | that generated it),|
|              |                                                           | length             |

Any :class:`engines.GenerationEngine` works (HF, vLLM, simulated, your own).
"""

from __future__ import annotations

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from engines.protocols import GenerationEngine, SamplingParams
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = ["RolloutAdapter"]


class RolloutAdapter(Adapter):
    """Generation engine as the rollout stage."""

    task = "rollout"
    input_fields = ("prompt_ids",)
    output_fields = ("response_ids", "behaviour_logprobs", "finish_reason")

    def __init__(
        self, engine: GenerationEngine, params: SamplingParams, *, batch_size: int = 16
    ) -> None:
        self.engine = engine
        self.params = params
        self.batch_size = batch_size

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        prompts = cols["prompt_ids"]
        if not isinstance(prompts, Ragged):
            raise TypeError(f"prompt_ids must be a ragged column, got {type(prompts).__name__}")
        gens = await self.engine.generate([p.long() for p in prompts.unbind()], self.params)
        if len(gens) != len(meta):
            raise RuntimeError(
                f"generation engine returned {len(gens)} samples for {len(meta)} prompts"
            )
        response_lens = np.array([int(g.token_ids.numel()) for g in gens], dtype=np.int64)
        return StageOutput(
            columns={
                "response_ids": [g.token_ids.to(torch.int32) for g in gens],
                "behaviour_logprobs": [g.logprobs.to(torch.float32) for g in gens],
                "finish_reason": [g.finish_reason for g in gens],
            },
            version=np.array([g.version for g in gens], dtype=np.int64),
            length=prompts.lengths.numpy() + response_lens,
            tokens=int(response_lens.sum()),
        )
