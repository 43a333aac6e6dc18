"""``ReferenceAdapter``: per-token log-probs of the responses under a frozen reference policy.

| consumes                  | produces                          |
|---------------------------|-----------------------------------|
| prompt_ids, response_ids  | ref_logprobs (ragged float32)     |

With ``max_tokens_per_micro_batch`` a leased batch is packed into scoring calls of at most
that many prompt + response tokens (:mod:`engines.packing`; a sample longer than the budget
is scored alone), and the log-probs are written back in the rows' order.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from engines.packing import pack_by_tokens
from engines.protocols import ScoringEngine
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = ["ReferenceAdapter"]


class ReferenceAdapter(Adapter):
    """Scoring engine as the reference stage (for the KL term of the loss)."""

    task = "reference"
    input_fields = ("prompt_ids", "response_ids")
    output_fields = ("ref_logprobs",)

    def __init__(
        self,
        engine: ScoringEngine,
        *,
        batch_size: int = 16,
        max_tokens_per_micro_batch: int | None = None,
    ) -> None:
        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ValueError(
                f"max_tokens_per_micro_batch must be >= 1 or None, got {max_tokens_per_micro_batch}"
            )
        self.engine = engine
        self.batch_size = batch_size
        self.max_tokens = max_tokens_per_micro_batch

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        prompts, responses = cols["prompt_ids"], cols["response_ids"]
        if not isinstance(prompts, Ragged) or not isinstance(responses, Ragged):
            raise TypeError("reference needs ragged prompt_ids and response_ids")
        p = [x.long() for x in prompts.unbind()]
        r = [x.long() for x in responses.unbind()]
        lengths = (prompts.lengths + responses.lengths).numpy()
        if self.max_tokens is None:
            parts = [np.arange(len(p), dtype=np.int64)]
        else:
            parts = pack_by_tokens(lengths, self.max_tokens)
        logps: list[torch.Tensor | None] = [None] * len(p)
        for pos in parts:
            idx = pos.tolist()
            scored = await asyncio.to_thread(
                self.engine.logprobs, [p[i] for i in idx], [r[i] for i in idx]
            )
            for i, lp in zip(idx, scored, strict=True):
                logps[i] = lp.to(torch.float32)
        out = [lp for lp in logps if lp is not None]
        assert len(out) == len(p)
        return StageOutput(
            columns={"ref_logprobs": out},
            tokens=int(responses.values.numel()),
            metrics={
                "call_tokens_max": float(max((int(lengths[q].sum()) for q in parts), default=0))
            },
        )
