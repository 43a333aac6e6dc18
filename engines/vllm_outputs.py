"""From vLLM's completion outputs to :class:`~engines.protocols.Generation`: the sampled tokens'
log-probs, each token's weights version, and a response put together from parts.

Pure Python over duck-typed vLLM objects (importing it needs no vLLM); called by
:class:`engines.vllm_engine.VLLMGenerationEngine` once per finished (or aborted) request.

Per-token versions come from ``CompletionOutput.weight_versions``: runs of output tokens, each
with the label of the weights that sampled them (``finish_weight_update(weight_version=...)``
set the label). A response that a weight update interrupted (``pause_generation(mode="keep")``)
has one run per version. A response can also be put together from parts: a request that an
update aborted is submitted again with its tokens so far appended to its prompt
(``update_mode="partial"`` on a vLLM without keep mode), and :class:`ResponseParts` joins what
each submission returned::

    part 1 (aborted)     t0 t1 t2 t3          versions 4 4 4 4
    part 2 (finished)                t4 t5 t6 versions 5 5 5
    the Generation       t0 ........... t6    versions 4 4 4 4 5 5 5, version 4 (the oldest)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from engines.protocols import Generation

__all__ = ["ResponseParts", "sampled_logprobs", "switch_positions", "token_versions"]


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float]:
    """Log-prob of each sampled token from vLLM's per-position logprobs (flat or dict form)."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although logprobs=0 was requested")
    if len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned logprobs for {len(logprobs)} positions, {len(token_ids)} tokens"
        )
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: parallel lists, one span/position
        values: list[float] = []
        flat_ids, flat_values = logprobs.token_ids, logprobs.logprobs
        for start, end, token in zip(
            logprobs.start_indices, logprobs.end_indices, token_ids, strict=True
        ):
            values.append(_pick(flat_ids, flat_values, range(start, end), token))
        return values
    return [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)]


def _pick(ids: Sequence[int], values: Sequence[float], span: Iterable[int], token: int) -> float:
    for k in span:
        if ids[k] == token:
            return float(values[k])
    raise RuntimeError(f"vLLM returned no logprob for sampled token {token}")


def token_versions(
    spans: Sequence[Any] | None, num_tokens: int, version_of: Callable[[str], int], current: int
) -> list[int]:
    """The weights version of each of ``num_tokens`` output tokens from vLLM's runs of version
    labels (``span.start``, ``span.end``, ``span.version``), in token order; ``version_of``
    maps a label to its version (raising for a label it does not know). No runs (no token, or
    a vLLM that does not label tokens): every token is ``current``'s."""
    runs = sorted((s for s in spans or () if s.end > s.start), key=lambda s: s.start)
    if not runs:
        return [current] * num_tokens
    out: list[int] = []
    for run in runs:
        out += [version_of(run.version)] * (run.end - run.start)
    if len(out) != num_tokens:
        raise RuntimeError(
            f"vLLM labelled {len(out)} output tokens with weight versions, the output has "
            f"{num_tokens}"
        )
    return out


def switch_positions(versions: Sequence[int]) -> list[int]:
    """Where a response's version changes: the tokens it had each time an update interrupted it
    (what aborting and generating it again would have thrown away)."""
    return [t for t in range(1, len(versions)) if versions[t] != versions[t - 1]]


class ResponseParts:
    """The tokens, log-probs and versions of one response so far, from one or more requests."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def add(
        self, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(
                f"a part needs one log-prob and one version per token: {len(token_ids)} tokens, "
                f"{len(logprobs)} log-probs, {len(versions)} versions"
            )
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions

    def clear(self) -> None:
        self.token_ids, self.logprobs, self.versions = [], [], []

    def generation(self, finish_reason: str, current: int) -> Generation:
        """The response as a Generation (``current``: the engine's version, for an empty one)."""
        if finish_reason not in ("stop", "length"):
            raise RuntimeError(f"unexpected vLLM finish_reason {finish_reason!r}")
        return Generation(
            token_ids=torch.tensor(self.token_ids, dtype=torch.int64),
            logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            finish_reason=finish_reason,
            version=current if not self.token_ids else -1,
            token_versions=torch.tensor(self.versions, dtype=torch.int64),
        )
