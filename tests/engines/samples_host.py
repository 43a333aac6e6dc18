"""A simulated generation engine in a Ray actor, for the sample store's Ray test (a module of
its own: Ray workers import it as ``tests.engines.samples_host``, which a test module
imported by pytest under another name could not offer)."""

from __future__ import annotations

from typing import Any

import torch

from engines.protocols import SamplingParams
from engines.simulated import (
    DecodeLatency,
    LognormalLengths,
    SampleStore,
    SimulatedGenerationEngine,
)

LATENCY = DecodeLatency(base_s=0.01, per_seq_s=0.0, prefill_s_per_token=0.0)
LENGTHS = LognormalLengths(median=40, sigma=1.2, max_len=150, prompt_scale=0.0, seed=3)


def make_engine(**kwargs: Any) -> SimulatedGenerationEngine:
    """The engine every sample store test uses (``kwargs``: how it shares samples)."""
    return SimulatedGenerationEngine(
        LATENCY, LENGTHS, time_scale=0.01, vocab_size=50, eos_token_id=0, version=0, **kwargs
    )


class SampleHost:
    """One engine sharing ``store``; ``ray.remote`` is applied by the test."""

    def __init__(self, store: SampleStore) -> None:
        self.engine = make_engine(samples=store)

    async def generate(self, prompts: list[torch.Tensor], budget: int) -> list[list[int]]:
        out = await self.engine.generate(prompts, SamplingParams(max_new_tokens=budget))
        return [g.token_ids.tolist() for g in out]
