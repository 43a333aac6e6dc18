"""Padding and per-token log-probabilities shared by the HF engines.

Layout of a scored batch (``P`` = longest prompt, ``T`` = longest response): prompts are
left-padded and responses right-padded, so every response starts at column ``P`` and the logits
that predict it are one contiguous slice for all rows::

    row 0:  pad pad p0 p1 p2 | r0 r1 r2 pad
    row 1:  p0  p1  p2 p3 p4 | r0 r1 r2 r3
            <----- P ------>   <---- T ---->

The same left-padded prompt layout is what the generation engine samples from, so scoring a
generated response repeats the sampler's computation closely (positions come from the mask).

Called by :class:`engines.hf.HFScoringEngine`, :class:`engines.hf.HFTrainingEngine` and
:func:`engines.tiny.warm_start`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

__all__ = ["ResponseLogprobs", "left_pad", "response_logprobs", "right_pad", "split_by_tokens"]


def left_pad(seqs: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D sequences right-aligned: ``(ids [B, L] int64, mask [B, L] int64)``."""
    width = max((int(s.numel()) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        n = int(seq.numel())
        if n:
            ids[i, width - n :] = seq.reshape(-1).long()
            mask[i, width - n :] = 1
    return ids, mask


def right_pad(
    seqs: Sequence[torch.Tensor], pad_value: float | int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D sequences left-aligned: ``(values [B, L] dtype, mask [B, L] bool)``."""
    width = max((int(s.numel()) for s in seqs), default=0)
    values = torch.full((len(seqs), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, seq in enumerate(seqs):
        n = int(seq.numel())
        if n:
            values[i, :n] = seq.reshape(-1).to(dtype)
            mask[i, :n] = True
    return values, mask


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
) -> ResponseLogprobs:
    """``log softmax(logits / temperature)`` of each response token given its prefix.

    Runs one forward pass over the batch in the layout of the module docstring, keeping only
    the logits that predict response tokens. Gradients flow if the caller has them enabled.
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
    logits = out.logits[:, :-1, :].float() / temperature  # [B, T, V]
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
