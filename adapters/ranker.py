"""``LengthRanker``: predicts a prompt's response length, learned online (StreamRL's ranker).

Long-tail generation is what makes a synchronous step wait: the step ends when its longest
response does. Knowing which prompts will run long lets the rollout start them first and
give them instances of their own with small batches. The ranker is a small model learned
online from the lengths the rollout observes:

    features  x = [1, log(prompt length), hashed set of prompt tokens (presence, dim buckets)]
    target    y = log(mean response length of the prompt's samples)
    model     ridge regression, refitted from running sums (X^T X, X^T y) every
              ``refit_every`` observations; predict() = exp(x . w)

It costs O(buckets^2) per refit and O(prompt length) per prediction. Until it has seen
``warmup`` prompts it predicts the running mean.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["LengthRanker"]


class LengthRanker:
    """Online ridge regression from prompt token features to log response length."""

    def __init__(
        self,
        *,
        buckets: int = 256,
        ridge: float = 1.0,
        refit_every: int = 16,
        warmup: int = 16,
    ) -> None:
        self.buckets = buckets
        self.ridge = ridge
        self.refit_every = refit_every
        self.warmup = warmup
        dim = 2 + buckets
        self._xtx = np.zeros((dim, dim))
        self._xty = np.zeros(dim)
        self._w: np.ndarray = np.zeros(dim)
        self._n = 0
        self._sum_y = 0.0
        self._since_fit = 0
        self._lock = threading.Lock()  # observe() and predict() come from several stages
        self._errors: list[float] = []

    @property
    def observed(self) -> int:
        return self._n

    def _features(self, prompt: torch.Tensor) -> np.ndarray:
        ids = prompt.reshape(-1).to(torch.int64).numpy()
        x = np.zeros(2 + self.buckets)
        x[0] = 1.0
        x[1] = math.log(max(1, ids.size))
        if ids.size:
            # multiplicative hashing spreads token ids over the buckets; presence, not counts,
            # so a telling token weighs the same in a short and in a long prompt
            h = (ids * 2654435761) % self.buckets
            x[2 + h] = 1.0
        return x

    def predict(self, prompts: Sequence[torch.Tensor]) -> np.ndarray:
        """Predicted response length (tokens, float) per prompt."""
        with self._lock:
            if self._n < self.warmup:
                mean = math.exp(self._sum_y / self._n) if self._n else 1.0
                return np.full(len(prompts), mean)
            x = np.stack([self._features(p) for p in prompts])
            return np.exp(x @ self._w)

    def observe(self, prompts: Sequence[torch.Tensor], lengths: Sequence[float]) -> None:
        """Learn from generated response lengths (one per prompt, e.g. a group's mean)."""
        with self._lock:
            for p, n in zip(prompts, lengths, strict=True):
                x = self._features(p)
                y = math.log(max(1.0, float(n)))
                if self._n >= self.warmup:
                    self._errors.append(abs(float(x @ self._w) - y))
                    self._errors = self._errors[-512:]
                self._xtx += np.outer(x, x)
                self._xty += x * y
                self._sum_y += y
                self._n += 1
                self._since_fit += 1
            if self._since_fit >= self.refit_every:
                self._refit()

    def _refit(self) -> None:
        dim = self._xtx.shape[0]
        reg = self.ridge * np.eye(dim)
        reg[0, 0] = 0.0  # do not shrink the intercept
        self._w = np.linalg.solve(self._xtx + reg, self._xty)
        self._since_fit = 0

    def mean_abs_log_error(self) -> float:
        """Recent mean |log predicted - log observed| (0.69 = off by a factor of 2)."""
        with self._lock:
            return float(np.mean(self._errors)) if self._errors else math.nan
