"""Response-length models of the simulated generation engine.

A length model answers one question: how many tokens would the policy write for ``prompt`` as
its ``index``-th sample? The answer is a pure function of (prompt token ids, index, seed), so
runs are reproducible whatever the order of calls, and the ``n`` samples of one prompt (a GRPO
group) differ through their index.

Both models split the log-length into a part that depends on the prompt only (what an
output-length ranker can learn) and per-sample noise (what nobody can predict)::

    log L = log(median) + prompt_scale * log(P / ref_len) + prompt_sigma * z(prompt) + sigma * e
            \\___________________ prompt-explained ____________________/       \\_ sample _/

    P        prompt length in tokens
    z        content score: sum over the prompt's tokens of a fixed pseudo-random weight per
             token id (mean 0, variance 1), divided by sqrt(P). It is linear in the prompt's
             token counts, so a regression on (log P, hashed bag of tokens) can learn it; it
             is N(0, 1) over prompts of random tokens, narrower over templated prompts whose
             tokens are mostly shared
    e        N(0, 1), drawn from a hash of (prompt, index, seed)

A sample may also run away (repeat itself until cut): with probability ``overlong_p`` its
length is ``max_len``. Lognormal bodies underestimate this tail, which decides how long a
synchronous step waits.

Measured on SmolLM2-135M-Instruct (``bench/calibrate.py``: 48 chat-template prompts of 49-82
tokens x 8 samples, T=0.7, cut at 1024): median 130 tokens, total log-std 0.74 (interquartile),
of which 18% of the log-variance lies between prompts (``prompt_share``) and the rest within a
group (``sigma`` = 0.67); 3.6% of the samples reach the cap (``overlong_p`` = 3.4% beyond the
lognormal body). Longer problems get longer solutions (within the arithmetic and the word
problems, prompt length and mean log response length correlate at about 0.5):
``prompt_scale`` = 1.86 is that slope over 49-82 token prompts, a local fit. For prompts of
another length range (another tokenizer or template) move the model onto a sample of them with
:meth:`LognormalLengths.adapted` (``Calibration.lengths_for`` does it with the measured share),
which recentres the median on them.

How much variance the prompt explains depends on how much ``P`` and ``z`` vary over a prompt
set: :meth:`LognormalLengths.explained_share` reports it (an oracle ranker's R^2 on log
lengths), and ``adapted(prompts, prompt_share=...)`` sets ``prompt_sigma`` to reach a chosen
share. With the defaults, prompts of random tokens at ``ref_len`` have a share of 0.07
(content only); templated prompts of one length, e.g. the tiny tokenizer's arithmetic prompts,
about 0.01 until adapted.

:class:`EmpiricalLengths` replays measured lengths through the same split: a Gaussian copula
maps ``sqrt(share) * z' + sqrt(1 - share) * e`` to a quantile of the measured distribution
(``z'`` the content score standardized over a prompt set by :meth:`EmpiricalLengths.adapted`),
so the marginal distribution is the measured one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from engines.simulated.hashing import normal, prompt_key, token_weights, uniform

__all__ = ["EmpiricalLengths", "LengthModel", "LognormalLengths", "content_score"]

_CONTENT_SALT = 0x5EED_C0DE
_STD_NORMAL = NormalDist()


@runtime_checkable
class LengthModel(Protocol):
    """Response length of sample ``index`` of ``prompt``; called by the simulated engine."""

    @property
    def max_len(self) -> int:
        """Longest response the model gives; a response this long was cut, not finished."""
        ...

    def length(self, prompt: torch.Tensor, index: int) -> int:
        """Tokens in the response (1 .. max_len), deterministic in (prompt, index, seed)."""
        ...


def content_score(prompt: torch.Tensor, salt: int = _CONTENT_SALT) -> float:
    """``z(prompt)``: the sum of the per-token weights over ``sqrt(P)`` (see the module doc)."""
    ids = prompt.reshape(-1).to(torch.int64).numpy()
    if ids.size == 0:
        return 0.0
    return float(token_weights(ids, salt).sum() / math.sqrt(ids.size))


@dataclass(frozen=True, kw_only=True)
class LognormalLengths:
    """Lognormal lengths whose median grows with the prompt (see the module docstring).

    The defaults are the SmolLM2-135M fit recorded by ``bench/calibrate.py``.
    """

    median: float = 130.0
    """Median response length (tokens) of a prompt of ``ref_len`` tokens with ``z = 0``."""
    sigma: float = 0.668
    """Log-std of the per-sample noise (the spread within a GRPO group)."""
    max_len: int = 1024
    """Longest response; longer draws are cut to it (and count as truncated)."""
    prompt_scale: float = 1.86
    """Exponent of the prompt length: the median scales as ``(P / ref_len) ** prompt_scale``."""
    ref_len: float = 63.2
    """Prompt length (tokens) at which the median is ``median``."""
    prompt_sigma: float = 0.184
    """Log-std of the content factor (``prompt_sigma * z``)."""
    overlong_p: float = 0.0339
    """Probability that a sample runs away to ``max_len`` whatever its prompt (SmolLM2: 3.6% of
    the samples reached the 1024-token cap, 3.4% more than the lognormal body predicts). Set 0
    for a pure lognormal; note it scales with ``max_len`` when that is raised."""
    overlong_slope: float = 0.55
    """How the runaway probability follows the prompt: ``overlong_p * exp(overlong_slope * f /
    factor_std) / overlong_norm`` for a prompt whose log factor is ``f`` (0: every prompt runs
    away alike). SmolLM2's groups show runaways clustered on prompts with long answers (fit by
    ``bench/calibration_fit.py``)."""
    factor_std: float = 1.0
    """Standard deviation of the prompt log factor over the prompt set (set by :meth:`adapted`)."""
    overlong_norm: float = 1.0
    """Mean of ``exp(overlong_slope * f / factor_std)`` over the prompt set (set by
    :meth:`adapted`, so that the mean runaway probability stays ``overlong_p``)."""
    center: float = 0.0
    """Subtracted from the prompt's log factor (:meth:`adapted` sets it so that ``median`` is
    the median over a prompt set)."""
    seed: int = 0
    """Seeds the per-sample noise."""
    content_salt: int = _CONTENT_SALT
    """Selects the per-token weights of ``z`` (a property of the simulated "task", not the
    run: keep it fixed to keep which prompts are long)."""

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or self.prompt_sigma < 0:
            raise ValueError(
                f"need median > 0, sigma >= 0, prompt_sigma >= 0; got {self.median}, "
                f"{self.sigma}, {self.prompt_sigma}"
            )
        if not 0 <= self.overlong_p <= 1:
            raise ValueError(f"overlong_p must be in [0, 1], got {self.overlong_p}")
        if self.max_len < 1 or self.ref_len <= 0:
            raise ValueError(f"need max_len >= 1, ref_len > 0; got {self.max_len}, {self.ref_len}")

    def prompt_log_factor(self, prompt: torch.Tensor) -> float:
        """The prompt-explained part of ``log L`` (relative to ``log(median)``)."""
        n = max(int(prompt.numel()), 1)
        factor = self.prompt_scale * math.log(n / self.ref_len)
        if self.prompt_sigma:
            factor += self.prompt_sigma * content_score(prompt, self.content_salt)
        return factor - self.center

    def expected_log_length(self, prompt: torch.Tensor) -> float:
        """The best prediction of ``log L`` from the prompt (an oracle ranker's output)."""
        return math.log(self.median) + self.prompt_log_factor(prompt)

    def length(self, prompt: torch.Tensor, index: int) -> int:
        """Response length of sample ``index`` of ``prompt``."""
        key = prompt_key(prompt)
        if self.overlong_p and uniform(key, index, self.seed, "overlong") < self.runaway_p(prompt):
            return self.max_len
        log_len = self.expected_log_length(prompt)
        if self.sigma:
            log_len += self.sigma * normal(key, index, self.seed, "len")
        return int(min(max(round(math.exp(min(log_len, 30.0))), 1), self.max_len))

    def runaway_p(self, prompt: torch.Tensor) -> float:
        """Probability that a sample of ``prompt`` runs away to ``max_len``."""
        if not self.overlong_slope:
            return self.overlong_p
        z = self.prompt_log_factor(prompt) / self.factor_std
        return min(self.overlong_p * math.exp(self.overlong_slope * z) / self.overlong_norm, 1.0)

    def explained_share(self, prompts: Sequence[torch.Tensor]) -> float:
        """Share of the log-length variance over ``prompts`` that the prompt explains.

        ``Var(prompt factor) / (Var(prompt factor) + sigma^2)``, ignoring the runaways and the
        cut at max_len: the R^2 an oracle ranker would reach on log lengths.
        """
        factors = np.array([self.prompt_log_factor(p) for p in prompts])
        between = float(factors.var()) if len(factors) > 1 else 0.0
        total = between + self.sigma**2
        return between / total if total > 0 else 0.0

    def adapted(
        self, prompts: Sequence[torch.Tensor], *, prompt_share: float | None = None
    ) -> LognormalLengths:
        """A copy tuned to a prompt set: ``median`` becomes the median over ``prompts``.

        With ``prompt_share``, ``prompt_sigma`` is also set so that :meth:`explained_share` on
        ``prompts`` equals it (``sigma`` kept). Where the prompt lengths alone explain more than
        that, ``prompt_scale`` is lowered to meet it and ``prompt_sigma`` is 0.

        Raises:
            ValueError: ``prompts`` is empty, or a positive share is asked of prompts whose
                lengths and contents do not vary.
        """
        if not prompts:
            raise ValueError("adapted() needs at least one prompt")
        model = replace(self, center=0.0)
        if prompt_share is not None:
            if not 0 <= prompt_share < 1:
                raise ValueError(f"prompt_share must be in [0, 1), got {prompt_share}")
            lens = np.array([math.log(max(int(p.numel()), 1) / self.ref_len) for p in prompts])
            a = self.prompt_scale * lens
            z = np.array([content_score(p, self.content_salt) for p in prompts])
            target = prompt_share / (1 - prompt_share) * self.sigma**2
            va, vz = float(a.var()), float(z.var())
            cov = float(((a - a.mean()) * (z - z.mean())).mean())
            if va >= target:
                scale = self.prompt_scale * math.sqrt(target / va) if va > 0 else 0.0
                model = replace(model, prompt_scale=scale, prompt_sigma=0.0)
            elif vz > 0:
                # Var(a + p z) = va + 2 p cov + p^2 vz = target, positive root.
                p = (-cov + math.sqrt(cov * cov - vz * (va - target))) / vz
                model = replace(model, prompt_sigma=max(p, 0.0))
            else:
                raise ValueError(
                    f"cannot reach prompt_share {prompt_share}: the prompts' content scores "
                    "do not vary and their lengths explain too little"
                )
        factors = np.array([model.prompt_log_factor(p) for p in prompts])
        centered = factors - factors.mean()
        std = float(centered.std()) or 1.0
        norm = float(np.exp(self.overlong_slope * centered / std).mean())
        return replace(
            model, center=float(factors.mean()), factor_std=std, overlong_norm=norm or 1.0
        )


class EmpiricalLengths:
    """Replays measured response lengths; the prompt explains ``prompt_share`` of their rank.

    Sample ``index`` of ``prompt`` gets the quantile ``Phi(sqrt(share) * z + sqrt(1 - share) *
    e)`` of ``values`` (``z`` the content score, ``e`` per-sample noise): the marginal
    distribution is the measured one whatever the share.

    Args:
        values: measured lengths (tokens, >= 1).
        max_len: the cap they were measured with (values at it were cut); default their max.
        prompt_share: share of the (normal-score) variance the prompt explains, in [0, 1).
        seed: seeds the per-sample noise.
        content_salt: selects the per-token weights of the content score.
        z_mean: with ``z_std``, standardizes the content score (``z' = (z - z_mean) /
            z_std``); set by :meth:`adapted` so that ``prompt_share`` holds on a given prompt
            set.
        z_std: see ``z_mean``.
    """

    def __init__(
        self,
        values: Sequence[int],
        *,
        max_len: int | None = None,
        prompt_share: float = 0.0,
        seed: int = 0,
        content_salt: int = _CONTENT_SALT,
        z_mean: float = 0.0,
        z_std: float = 1.0,
    ) -> None:
        if not values:
            raise ValueError("EmpiricalLengths needs at least one measured length")
        sorted_values = np.sort(np.asarray(values, dtype=np.int64))
        if sorted_values[0] < 1:
            raise ValueError(f"lengths must be >= 1, got {int(sorted_values[0])}")
        if not 0 <= prompt_share < 1:
            raise ValueError(f"prompt_share must be in [0, 1), got {prompt_share}")
        if z_std <= 0:
            raise ValueError(f"z_std must be > 0, got {z_std}")
        cap = int(sorted_values[-1]) if max_len is None else max_len
        if cap < sorted_values[-1]:
            raise ValueError(f"max_len {cap} is below the longest value {int(sorted_values[-1])}")
        self._values = sorted_values
        self._max_len = cap
        self.prompt_share = prompt_share
        self.seed = seed
        self.content_salt = content_salt
        self.z_mean = z_mean
        self.z_std = z_std

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> EmpiricalLengths:
        """Load a lengths file written by ``bench/calibrate.py``.

        It holds ``lengths`` (list of ints), ``max_new_tokens`` (the cap) and, in ``fit``, the
        measured ``prompt_share``; keyword arguments override them.
        """
        data = json.loads(Path(path).read_text())
        if "lengths" not in data:
            raise ValueError(f"{path} has no 'lengths' list; write it with bench/calibrate.py")
        kwargs: dict[str, Any] = {
            "max_len": data.get("max_new_tokens"),
            "prompt_share": data.get("fit", {}).get("prompt_share", 0.0),
        }
        kwargs.update(overrides)
        return cls(data["lengths"], **kwargs)

    @property
    def max_len(self) -> int:
        return self._max_len

    def adapted(
        self, prompts: Sequence[torch.Tensor], *, prompt_share: float | None = None
    ) -> EmpiricalLengths:
        """A copy whose content score is standardized over ``prompts`` (optionally a new share).

        Then ``prompt_share`` is the share of the normal-score variance the prompt explains on
        those prompts. Raises ``ValueError`` if their content scores do not vary.
        """
        z = np.array([content_score(p, self.content_salt) for p in prompts])
        if z.size < 2 or float(z.std()) <= 0:
            raise ValueError("adapted() needs prompts whose content scores vary")
        return EmpiricalLengths(
            self._values.tolist(),
            max_len=self._max_len,
            prompt_share=self.prompt_share if prompt_share is None else prompt_share,
            seed=self.seed,
            content_salt=self.content_salt,
            z_mean=float(z.mean()),
            z_std=float(z.std()),
        )

    @property
    def values(self) -> np.ndarray:
        """The measured lengths, sorted (a copy)."""
        return self._values.copy()

    def length(self, prompt: torch.Tensor, index: int) -> int:
        """Response length of sample ``index`` of ``prompt``."""
        share = self.prompt_share
        score = math.sqrt(1 - share) * normal(prompt_key(prompt), index, self.seed, "len")
        if share:
            z = (content_score(prompt, self.content_salt) - self.z_mean) / self.z_std
            score += math.sqrt(share) * z
        u = _STD_NORMAL.cdf(score)
        n = len(self._values)
        return int(self._values[min(int(u * n), n - 1)])
