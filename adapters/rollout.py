"""``RolloutAdapter``: prompts in, sampled responses and behaviour log-probs out.

| consumes     | produces                                                  | header set         |
|--------------|-----------------------------------------------------------|--------------------|
| prompt_ids   | response_ids (ragged int32), behaviour_logprobs (ragged   | version (weights   |
|              | float32), finish_reason (object)                          | that generated it),|
|              |                                                           | length             |

Any :class:`engines.GenerationEngine` works (HF, vLLM, simulated, your own). Given several
engines (instances), each batch goes to the one a :class:`Router` picks: the least loaded by
default, or, with :class:`LengthAwareRouter`, dedicated instances for prompts the
:class:`LengthRanker` predicts to run long (StreamRL's skewness-aware dispatch). The ranker
learns from every batch's observed response lengths.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from adapters.ranker import LengthRanker
from engines.protocols import GenerationEngine, SamplingParams
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = ["LeastLoadedRouter", "LengthAwareRouter", "RolloutAdapter", "Router"]


class Router(Protocol):
    """Chooses the engine instance for a batch. Called by the rollout adapter per batch."""

    def choose(self, load: Sequence[int], predicted_len: float) -> int:
        """Index of the instance; ``load`` is the samples in flight on each instance."""
        ...


class LeastLoadedRouter:
    """The instance with the fewest samples in flight."""

    def choose(self, load: Sequence[int], predicted_len: float) -> int:
        return int(np.argmin(load))


class LengthAwareRouter:
    """Predicted-long batches go to dedicated instances, the rest to the others.

    A batch is "long" when its predicted response length is at or above the ``quantile`` of
    the recent predictions (a moving threshold, so it follows the workload).
    """

    def __init__(self, long_instances: Sequence[int], *, quantile: float = 0.8, window: int = 512):
        if not long_instances:
            raise ValueError("LengthAwareRouter needs at least one dedicated long instance")
        self.long = sorted(set(long_instances))
        self.quantile = quantile
        self._recent: deque[float] = deque(maxlen=window)
        self.long_batches = 0
        self.batches = 0

    def choose(self, load: Sequence[int], predicted_len: float) -> int:
        self._recent.append(predicted_len)
        threshold = float(np.quantile(np.fromiter(self._recent, float), self.quantile))
        short = [i for i in range(len(load)) if i not in self.long] or self.long
        is_long = len(self._recent) >= 8 and predicted_len >= threshold
        pool = self.long if is_long else short
        self.batches += 1
        self.long_batches += int(is_long)
        return min(pool, key=lambda i: load[i])


class RolloutAdapter(Adapter):
    """Generation engine(s) as the rollout stage."""

    task = "rollout"
    input_fields = ("prompt_ids",)
    output_fields = ("response_ids", "behaviour_logprobs", "finish_reason")

    def __init__(
        self,
        engine: GenerationEngine | Sequence[GenerationEngine],
        params: SamplingParams,
        *,
        batch_size: int = 16,
        router: Router | None = None,
        ranker: LengthRanker | None = None,
        sampler: str = "fifo",
        sampler_options: dict[str, Any] | None = None,
    ) -> None:
        self.engines = list(engine) if isinstance(engine, Sequence) else [engine]
        if not self.engines:
            raise ValueError("RolloutAdapter needs at least one generation engine")
        self.params = params
        self.batch_size = batch_size
        self.router: Router = router or LeastLoadedRouter()
        self.ranker = ranker
        self.sampler = sampler
        self.sampler_options = dict(sampler_options or {})
        self.load = [0] * len(self.engines)

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        prompts = cols["prompt_ids"]
        if not isinstance(prompts, Ragged):
            raise TypeError(f"prompt_ids must be a ragged column, got {type(prompts).__name__}")
        prompt_lens = prompts.lengths.numpy()
        predicted = float(np.mean(np.maximum(meta.lengths - prompt_lens, 0))) if len(meta) else 0
        k = self.router.choose(self.load, predicted)
        self.load[k] += len(meta)
        try:
            gens = await self.engines[k].generate([p.long() for p in prompts.unbind()], self.params)
        finally:
            self.load[k] -= len(meta)
        if len(gens) != len(meta):
            raise RuntimeError(
                f"generation engine returned {len(gens)} samples for {len(meta)} prompts"
            )
        response_lens = np.array([int(g.token_ids.numel()) for g in gens], dtype=np.int64)
        if self.ranker is not None:
            self._observe(meta, prompts, response_lens)
        return StageOutput(
            columns={
                "response_ids": [g.token_ids.to(torch.int32) for g in gens],
                "behaviour_logprobs": [g.logprobs.to(torch.float32) for g in gens],
                "finish_reason": [g.finish_reason for g in gens],
            },
            version=np.array([g.version for g in gens], dtype=np.int64),
            length=prompt_lens + response_lens,
            tokens=int(response_lens.sum()),
            lane=f"instance{k}",
        )

    def _observe(self, meta: BatchMeta, prompts: Ragged, lens: np.ndarray) -> None:
        """One observation per prompt: the mean response length of its samples here."""
        assert self.ranker is not None
        firsts: dict[int, int] = {}
        sums: dict[int, list[int]] = {}
        for pos, g in enumerate(meta.groups.tolist()):
            firsts.setdefault(g, pos)
            sums.setdefault(g, []).append(int(lens[pos]))
        self.ranker.observe(
            [prompts[firsts[g]] for g in firsts], [float(np.mean(sums[g])) for g in firsts]
        )
