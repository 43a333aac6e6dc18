"""HF transformers scoring engine: per-token log-probs of given responses.

Implements :class:`engines.protocols.ScoringEngine`; called by the reference adapter (in a
worker thread, one micro-batch at a time) to compute reference log-probs for the KL term, or to
recompute behaviour log-probs. It uses the generation engine's convention: log-probs of
``softmax(logits / temperature)``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from engines.hf.batching import response_logprobs, split_by_tokens
from engines.hf.loading import ModelSource, load_model

__all__ = ["HFScoringEngine"]


class HFScoringEngine:
    """Scores responses with a frozen HF causal LM.

    Args:
        model: a saved model folder or an in-memory model (shared, not copied).
        temperature: the sampling temperature whose distribution to score (> 0).
        device: where the model runs.
        dtype: dtype for a model loaded from a folder.
        max_tokens_per_batch: padded tokens per forward pass; bigger calls are split.
        max_batch_size: samples per forward pass.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        temperature: float = 1.0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_tokens_per_batch: int = 16384,
        max_batch_size: int = 64,
    ) -> None:
        if temperature <= 0:
            raise ValueError(
                f"temperature must be > 0, got {temperature}; greedy samples are scored at 1.0"
            )
        self._model = load_model(model, dtype=dtype, device=device)
        self._model.eval()
        self.temperature = temperature
        self._max_tokens = max_tokens_per_batch
        self._max_batch = max_batch_size
        self._lock = threading.Lock()

    @property
    def model(self) -> PreTrainedModel:
        """The underlying model."""
        return self._model

    def logprobs(
        self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """``log p(response_t | prompt, response_<t)``: one ``[T_i]`` float32 per sample."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        out: list[torch.Tensor] = []
        with self._lock, torch.inference_mode():
            for part in split_by_tokens(prompts, responses, self._max_tokens, self._max_batch):
                scored = response_logprobs(
                    self._model, prompts[part], responses[part], temperature=self.temperature
                )
                logp = scored.logprobs.cpu()
                for i, resp in enumerate(responses[part]):
                    out.append(logp[i, : int(resp.numel())].clone())
        return out
