"""The HF generation engine in a child process: the samples of the engine in this process
(same seed, same weights), across the hand-over and weight updates; a dead child is an error."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from asyncflow import load_config
from engines.hf import HFGenerationEngine, encode_prompts
from engines.hf.process import EngineProcessError, HFProcessGenerationEngine
from engines.protocols import Generation, SamplingParams
from transferqueue.aio import within

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.9)


def _prompts(tok: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    return [p for p in encode_prompts(tok, ["3 + 4 =", "What is 12 * 7?"]) for _ in range(4)]


def _same(a: list[Generation], b: list[Generation]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.token_ids, y.token_ids)
        assert torch.equal(x.logprobs, y.logprobs)
        assert torch.equal(x.token_versions, y.token_versions)
        assert (x.finish_reason, x.version) == (y.finish_reason, y.version)


def _noisy(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_the_child_samples_what_this_process_samples(
    tiny_dir: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _prompts(tiny_tokenizer)
    here = HFGenerationEngine(tiny_dir, seed=7, version=0)
    child = HFProcessGenerationEngine(tiny_dir, seed=7, version=0)

    async def calls(engine: HFGenerationEngine | HFProcessGenerationEngine) -> list[Generation]:
        out = list(await engine.generate(prompts, PARAMS))  # before the child is ready
        if isinstance(engine, HFProcessGenerationEngine):
            assert await asyncio.to_thread(engine.wait_ready, 120)
        out += await engine.generate(prompts, PARAMS)  # the hand-over: weights, seed stream
        if isinstance(engine, HFProcessGenerationEngine):
            assert engine.in_child
        state = _noisy(dict(here.model.state_dict()), 1)
        await engine.update_weights(state, 1)
        assert engine.version == 1
        out += await engine.generate(prompts, PARAMS)
        return out

    try:
        _same(asyncio.run(calls(child)), asyncio.run(calls(here)))
        assert child.tokens_decoded == here.tokens_decoded > 0
    finally:
        child.close()
        here.close()


def test_a_dead_child_fails_the_calls_and_a_bad_config_is_refused(
    tiny_dir: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _prompts(tiny_tokenizer)
    child = HFProcessGenerationEngine(tiny_dir, seed=7, version=0)
    try:
        assert child.wait_ready(120)
        asyncio.run(child.generate(prompts, PARAMS))
        assert child.in_child
        os.kill(child._proc.pid, signal.SIGKILL)
        child._proc.wait(timeout=10)
        with pytest.raises(EngineProcessError, match="is gone"):
            asyncio.run(within(child.generate(prompts, PARAMS), 30))
    finally:
        child.close()
    with pytest.raises(ValueError, match="partial"):
        HFProcessGenerationEngine(tiny_dir, partial=True)
    with pytest.raises(ValueError, match=r"rollout\.engine_process=true needs"):
        load_config(None, ["rollout.engine_process=true", "rollout.partial=true"])


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], True),  # the defaults: max_staleness=1, 300 steps, deploy=local
        (["train.max_staleness=0"], False),  # the stages take turns: one process
        (["train.steps=20"], False),  # too short to repay the child's start
        (["rollout.partial=true"], False),
        (["deploy.mode=ray"], False),
        (["train.max_staleness=0", "rollout.engine_process=true"], True),
        (["rollout.engine_process=false"], False),
    ],
)
def test_the_automatic_rule(overrides: list[str], expected: bool) -> None:
    if len(os.sched_getaffinity(0)) < 2 and not any("engine_process" in o for o in overrides):
        expected = False
    assert load_config(None, overrides).engine_process() is expected


def test_a_call_given_up_on_leaves_the_child_serving(
    tiny_dir: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _prompts(tiny_tokenizer)
    child = HFProcessGenerationEngine(tiny_dir, seed=7, version=0)
    try:
        assert child.wait_ready(120)

        async def calls() -> list[Generation]:
            await child.generate(prompts, PARAMS)  # the hand-over
            long = SamplingParams(max_new_tokens=200, temperature=0.9)
            with pytest.raises(TimeoutError):  # cancelled while the child works on it
                await within(child.generate(prompts * 8, long), 0.01)
            return await within(child.generate(prompts, PARAMS), 60)

        assert len(asyncio.run(calls())) == len(prompts)
        assert child._reader.is_alive()
    finally:
        child.close()
