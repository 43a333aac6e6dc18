"""Shared prompts: a group's prompt runs through the model once, with the results of one pass per
row (log-probs, gradients, sampled tokens) up to float rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import engines.hf.batching as batching
from engines.hf import HFGenerationEngine, encode_prompts
from engines.hf.batching import distinct_rows, response_logprobs, shares_prompts
from engines.protocols import SamplingParams

TEXTS = ["3 + 4 =", "What is 12 * 7?", "1 ="]  # different lengths: left padding matters


def _groups(tok: PreTrainedTokenizerBase, size: int) -> list[torch.Tensor]:
    prompts = encode_prompts(tok, TEXTS)
    return [p.clone() for p in prompts for _ in range(size)]


def _responses(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, 200, (1 + i % 5,), generator=g) for i in range(rows)]


def test_distinct_rows_and_the_rule() -> None:
    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 2])
    rows, inverse = distinct_rows([a, b, a.clone(), b.clone(), torch.tensor([1, 2, 3, 0])])
    assert rows == [0, 1, 4]
    assert inverse.tolist() == [0, 1, 0, 1, 2]
    assert shares_prompts(3, 6) and shares_prompts(1, 2)
    assert not shares_prompts(4, 6) and not shares_prompts(1, 1)


def test_shared_log_probs_and_gradients_equal_one_pass_per_row(
    tiny_model: PreTrainedModel, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _groups(tiny_tokenizer, 4)
    responses = _responses(len(prompts))
    model = tiny_model.train()
    results = {}
    for share in (False, True):
        model.zero_grad()
        scored = response_logprobs(
            model, prompts, responses, temperature=0.7, with_entropy=True, share_prompts=share
        )
        (scored.logprobs * torch.linspace(-1, 1, scored.logprobs.shape[1])).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = (scored, grads)
    (one, g_one), (shared, g_shared) = results[False], results[True]
    assert torch.equal(one.mask, shared.mask)
    torch.testing.assert_close(shared.logprobs, one.logprobs, atol=2e-5, rtol=0)
    assert one.entropy is not None and shared.entropy is not None
    torch.testing.assert_close(shared.entropy, one.entropy, atol=2e-5, rtol=0)
    assert set(g_one) == set(g_shared) and len(g_one) > 0
    for name, grad in g_one.items():
        torch.testing.assert_close(g_shared[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefill_samples_the_tokens_of_one_prefill_per_row(
    tiny_model: PreTrainedModel,
    tiny_tokenizer: PreTrainedTokenizerBase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = _groups(tiny_tokenizer, 8)
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    shared = HFGenerationEngine(copy.deepcopy(tiny_model)).generate_sync(prompts, params)
    monkeypatch.setattr(batching, "shares_prompts", lambda distinct, rows: False)
    alone = HFGenerationEngine(copy.deepcopy(tiny_model)).generate_sync(prompts, params)
    for s, a in zip(shared, alone, strict=True):
        assert torch.equal(s.token_ids, a.token_ids)
        torch.testing.assert_close(s.logprobs, a.logprobs, atol=2e-5, rtol=0)
    # the rows of one group draw their own samples from the shared prompt's cache
    sampled = HFGenerationEngine(tiny_model, seed=1).generate_sync(
        prompts, SamplingParams(max_new_tokens=10, temperature=1.0)
    )
    assert len({tuple(g.token_ids.tolist()) for g in sampled[:8]}) > 1
