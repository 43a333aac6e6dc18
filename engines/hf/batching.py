"""Padding and per-token log-probabilities shared by the HF engines.

Layout of a scored batch (``P`` = longest prompt, ``T`` = longest response): prompts are
left-padded and responses right-padded, so every response starts at column ``P`` and the logits
that predict it are one contiguous slice for all rows::

    row 0:  pad pad p0 p1 p2 | r0 r1 r2 pad
    row 1:  p0  p1  p2 p3 p4 | r0 r1 r2 r3
            <----- P ------>   <---- T ---->

The same left-padded prompt layout is what the generation engine samples from, so scoring a
generated response repeats the sampler's computation closely (positions come from the mask).

**Shared prompts.** GRPO samples a group of responses per prompt, so a batch holds each prompt
several times. When the distinct prompts are at most half the rows (:func:`shares_prompts`),
each distinct prompt runs through the model once and its key/value cache is indexed out to the
rows that share it (differentiably: the gradients of the rows sum into the one pass); then
the responses run against that cache::

    pass 1 (distinct prompts):   pad p0 p1 p2            -> cache, logits predicting r0
    pass 2 (every row):          [cache of its prompt] | r0 r1 r2 pad

The results are those of the single pass up to float rounding (the same positions, mask and
attention), with the prompt tokens computed once per group instead of once per sample: for
the demo's 8 samples of 13 prompt tokens and about 3 response tokens, a third of the tokens.
The generation engine's prefill shares prompts the same way. Sharded (FSDP) training never
shares: every rank must run the same number of passes.

Called by :class:`engines.hf.HFScoringEngine`, :class:`engines.hf.HFTrainingEngine` and
:func:`engines.tiny.warm_start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache, PreTrainedModel

__all__ = [
    "ResponseLogprobs",
    "distinct_rows",
    "left_pad",
    "prefill_shared",
    "response_logprobs",
    "right_pad",
    "shares_prompts",
    "split_by_tokens",
]


def _lengths(seqs: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([int(s.numel()) for s in seqs], dtype=torch.long)


def left_pad(seqs: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D sequences right-aligned: ``(ids [B, L] int64, mask [B, L] int64)``."""
    if not seqs:
        return torch.zeros((0, 0), dtype=torch.long), torch.zeros((0, 0), dtype=torch.long)
    flat = [s.reshape(-1).long() for s in seqs]
    ids = pad_sequence(flat, batch_first=True, padding_value=pad_id, padding_side="left")
    lengths = _lengths(flat)
    width = ids.shape[1]
    mask = (torch.arange(width) >= (width - lengths)[:, None]).long()
    return ids, mask


def right_pad(
    seqs: Sequence[torch.Tensor], pad_value: float | int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D sequences left-aligned: ``(values [B, L] dtype, mask [B, L] bool)``."""
    if not seqs:
        return torch.zeros((0, 0), dtype=dtype), torch.zeros((0, 0), dtype=torch.bool)
    flat = [s.reshape(-1).to(dtype) for s in seqs]
    values = pad_sequence(flat, batch_first=True, padding_value=pad_value)
    mask = torch.arange(values.shape[1]) < _lengths(flat)[:, None]
    return values, mask


def distinct_rows(seqs: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """``(rows, inverse)``: the row of each distinct sequence's first occurrence, in order, and
    for every row the index of its sequence among them (``int64 [B]``): ``seqs[rows[inverse[i]]]``
    equals ``seqs[i]``, element for element."""
    first: dict[tuple[int, bytes], int] = {}
    rows: list[int] = []
    inverse: list[int] = []
    for i, seq in enumerate(seqs):
        flat = seq.reshape(-1)
        key = (int(flat.numel()), flat.long().numpy().tobytes())
        at = first.get(key)
        if at is None:
            at = first[key] = len(rows)
            rows.append(i)
        inverse.append(at)
    return rows, torch.tensor(inverse, dtype=torch.long)


def shares_prompts(distinct: int, rows: int) -> bool:
    """Whether a batch of ``rows`` rows with ``distinct`` distinct prompts runs its prompts once
    each (see the module docstring): when every distinct prompt is shared by two rows on average.
    Below that the second pass's fixed cost outweighs the tokens saved."""
    return rows >= 2 and distinct * 2 <= rows


def prefill_shared(
    model: PreTrainedModel,
    seqs: Sequence[torch.Tensor],
    pad_id: int,
    *,
    logits_to_keep: int = 1,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Run ``seqs`` left-padded through ``model`` with a fresh cache, each distinct sequence once
    when :func:`shares_prompts` says so: ``(output, attention mask [B, L], positions [B, L])``,
    the output's logits and cache indexed out to every row (as if every row had run)."""
    device = next(model.parameters()).device
    rows, inverse = distinct_rows(seqs)
    shared = shares_prompts(len(rows), len(seqs))
    ids, attn = left_pad([seqs[i] for i in rows] if shared else seqs, pad_id)
    ids, attn = ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions,
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    if shared:
        index = inverse.to(device)
        out.past_key_values.batch_select_indices(index)
        out.logits = out.logits[index]
        attn, positions = attn[index], positions[index]
    return out, attn, positions


@dataclass
class ResponseLogprobs:
    """Per-token results for a batch of responses, padded to ``[B, T]``."""

    logprobs: torch.Tensor  # [B, T] float32; grad flows when computed with grad enabled
    mask: torch.Tensor  # [B, T] bool, true on response tokens
    entropy: torch.Tensor | None  # [B, T] float32, detached; None unless asked for


def response_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    with_entropy: bool = False,
    share_prompts: bool = True,
) -> ResponseLogprobs:
    """``log softmax(logits / temperature)`` of each response token given its prefix.

    Runs one forward pass over the batch in the layout of the module docstring, keeping only
    the logits that predict response tokens; or, with ``share_prompts`` and a batch whose
    prompts repeat (:func:`shares_prompts`), one pass over the distinct prompts and one over
    the responses against their cache. Gradients flow if the caller has them enabled.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if any(int(p.numel()) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. BOS) to condition on")
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)  # [B, P]
    resp_ids, resp_mask = right_pad(responses, pad_id, torch.long)  # [B, T]
    width = resp_ids.shape[1]
    if width == 0:
        empty = torch.zeros((len(prompts), 0), dtype=torch.float32, device=device)
        return ResponseLogprobs(empty, resp_mask.to(device), empty if with_entropy else None)
    if share_prompts and shares_prompts(len(distinct_rows(prompts)[0]), len(prompts)):
        logits = _shared_prompt_logits(model, prompts, resp_ids, resp_mask, pad_id)
    else:
        ids = torch.cat([prompt_ids, resp_ids], dim=1).to(device)  # [B, P + T]
        attn = torch.cat([prompt_mask, resp_mask.long()], dim=1).to(device)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        # The logits at columns P-1 .. P+T-2 predict the T response tokens; the last column's
        # logits predict nothing, so keep T+1 and drop one.
        out = model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=width + 1,
        )
        logits = out.logits[:, :-1, :]
    logits = logits.float() / temperature  # [B, T, V]
    targets = resp_ids.to(device)
    logz = torch.logsumexp(logits, dim=-1)  # [B, T]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # [B, T]
    mask = resp_mask.to(device)
    logp = torch.where(mask, logp, 0.0)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            log_probs = logits.detach() - logz.detach().unsqueeze(-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)  # [B, T]
            entropy = torch.where(mask, entropy, 0.0)
    return ResponseLogprobs(logprobs=logp, mask=mask, entropy=entropy)


def _shared_prompt_logits(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    resp_ids: torch.Tensor,
    resp_mask: torch.Tensor,
    pad_id: int,
) -> torch.Tensor:
    """The logits ``[B, T, V]`` predicting each response token, the prompts run once each
    (module docstring): the last prompt position's logits predict token 0, the responses'
    own positions 0 .. T-2 the rest."""
    device = next(model.parameters()).device
    first, prompt_attn, prompt_pos = prefill_shared(model, prompts, pad_id)
    width = resp_ids.shape[1]
    attn = torch.cat([prompt_attn, resp_mask.long().to(device)], dim=1)  # [B, P + T]
    positions = prompt_pos[:, -1:] + 1 + torch.arange(width, device=device)  # [B, T]
    out = model(
        input_ids=resp_ids.to(device),
        attention_mask=attn,
        position_ids=positions,
        past_key_values=first.past_key_values,
        use_cache=True,
        logits_to_keep=width,
    )
    return torch.cat([first.logits[:, -1:, :], out.logits[:, :-1, :]], dim=1)


def split_by_tokens(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    max_tokens: int,
    max_samples: int,
) -> list[slice]:
    """Split ``range(len(prompts))`` into consecutive slices of bounded padded size.

    A slice holds at most ``max_samples`` samples and at most ``max_tokens`` padded tokens
    (``rows * (longest prompt + longest response)``); a single sample larger than the budget
    gets a slice of its own.
    """
    if max_tokens < 1 or max_samples < 1:
        raise ValueError(
            f"max_tokens and max_samples must be >= 1, got {max_tokens}, {max_samples}"
        )
    slices: list[slice] = []
    start, longest_p, longest_r = 0, 0, 0
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        lp, lr = max(longest_p, int(p.numel())), max(longest_r, int(r.numel()))
        rows = i - start + 1
        if rows > 1 and (rows > max_samples or rows * (lp + lr) > max_tokens):
            slices.append(slice(start, i))
            start, lp, lr = i, int(p.numel()), int(r.numel())
        longest_p, longest_r = lp, lr
    if start < len(prompts):
        slices.append(slice(start, len(prompts)))
    return slices
