"""Fits behind ``bench/calibrate.py``: straight lines, training cost, response lengths.

Pure functions of measured numbers (no engine, no timing), so they can be tested and reused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

__all__ = ["fit_lengths", "fit_line", "fit_training"]


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    ss = float(((y - y.mean()) ** 2).sum())
    return 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else 1.0


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """Least-squares ``y = intercept + slope * x`` with its R^2."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    a = np.stack([np.ones_like(x), x], 1)
    (intercept, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    r2 = _r2(y, a @ np.array([intercept, slope]))
    return {"intercept": float(intercept), "slope": float(slope), "r2": r2}


def fit_training(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares ``seconds = per_token_s * tokens + per_sample_s * samples`` (both >= 0)."""
    a = np.array([[p["tokens"], p["samples"]] for p in points], dtype=float)
    y = np.array([p["seconds"] for p in points], dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    if coef[1] < 0:  # overhead per sample not resolvable: tokens only
        coef = np.array([float((a[:, 0] @ y) / (a[:, 0] @ a[:, 0])), 0.0])
    elif coef[0] < 0:
        coef = np.array([0.0, float((a[:, 1] @ y) / (a[:, 1] @ a[:, 1]))])
    r2 = _r2(y, a @ coef)
    return {"per_token_s": float(coef[0]), "per_sample_s": float(coef[1]), "r2": r2}


def fit_lengths(
    lengths: list[int], groups: list[int], prompt_lens: list[int], cap: int
) -> dict[str, Any]:
    """Lognormal fit of response lengths, split into prompt-explained and per-sample parts.

    ``log L = log(median) + prompt_scale * log(P / ref_len) + prompt_sigma * z + sigma * e``,
    the model of :class:`engines.simulated.LognormalLengths`. The median and the total log-std
    are robust to the responses cut at ``cap`` (median and interquartile range of log L); the
    share of log-variance between prompts (the intra-class correlation over groups) splits the
    total into the per-sample ``sigma`` and the prompt part, of which the prompt-length slope
    takes what it explains and ``prompt_sigma`` (content) the rest. ``overlong_p`` is the share
    of responses cut at ``cap`` beyond what the lognormal body predicts (runaway generations).
    """
    y = np.log(np.asarray(lengths, dtype=float))
    g = np.asarray(groups)
    q25, q75 = np.quantile(y, [0.25, 0.75])
    sigma_total = float((q75 - q25) / 1.349)
    ids = np.unique(g)
    means = np.array([y[g == k].mean() for k in ids])
    sizes = np.array([(g == k).sum() for k in ids])
    within = float(np.mean([y[g == k].var(ddof=1) for k in ids if (g == k).sum() > 1]))
    between = max(float(means.var(ddof=1)) - within / float(sizes.mean()), 0.0)
    icc = between / (between + within) if between + within > 0 else 0.0
    plen = np.array([prompt_lens[int(np.flatnonzero(g == k)[0])] for k in ids], dtype=float)
    slope_fit = fit_line(np.log(plen).tolist(), means.tolist())
    slope = slope_fit["slope"]
    between_total = icc * sigma_total**2
    content = max(between_total - slope**2 * float(np.log(plen).var(ddof=1)), 0.0)
    arr = np.asarray(lengths)
    median = float(np.median(arr))
    truncated = float((arr >= cap).mean())
    body_cut = 1.0 - NormalDist().cdf(math.log(cap / median) / sigma_total) if sigma_total else 0.0
    return {
        "samples": len(lengths),
        "groups": int(ids.size),
        "median": median,
        "mean": float(arr.mean()),
        "quantiles": {
            str(q): float(np.quantile(arr, q)) for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)
        },
        "max": int(arr.max()),
        "truncated_fraction": truncated,
        "log_mean": float(y.mean()),
        "log_std": float(y.std(ddof=1)),
        "sigma_total": sigma_total,
        "within_prompt_log_var": within,
        "between_prompt_log_var": between,
        "prompt_share": icc,
        "sigma": float(math.sqrt(max(sigma_total**2 - between_total, 0.0))),
        "prompt_scale": float(slope),
        "prompt_scale_r2": slope_fit["r2"],
        "prompt_len_range": [int(plen.min()), int(plen.max())],
        "prompt_sigma": float(math.sqrt(content)),
        "ref_len": float(np.exp(np.log(plen).mean())),
        "overlong_p": max(truncated - body_cut, 0.0),
        "overlong_slope": fit_overlong_slope(y, g, cap),
        "max_len": cap,
    }


def fit_overlong_slope(log_lengths: np.ndarray, groups: np.ndarray, cap: int) -> float:
    """How runaways cluster on prompts with long answers: the maximum-likelihood ``s`` of
    ``p_g = p * exp(s * z_g) / mean(exp(s * z))`` (binomial per group), with ``z_g`` the
    standardized mean log length of group ``g``'s uncut samples.

    ``z_g`` measures the prompt factor with noise, which biases ``s`` towards 0 (the fit
    understates the clustering).
    """
    cut = log_lengths >= math.log(cap) - 1e-9
    ids = [k for k in np.unique(groups) if (~cut[groups == k]).any()]
    if len(ids) < 3 or not cut.any():
        return 0.0
    z = np.array([log_lengths[(groups == k) & ~cut].mean() for k in ids])
    z = (z - z.mean()) / (z.std() or 1.0)
    hits = np.array([cut[groups == k].sum() for k in ids], dtype=float)
    trials = np.array([(groups == k).sum() for k in ids], dtype=float)
    rate = hits.sum() / trials.sum()

    def loglik(s: float) -> float:
        p = np.clip(rate * np.exp(s * z) / np.exp(s * z).mean(), 1e-9, 1 - 1e-9)
        return float((hits * np.log(p) + (trials - hits) * np.log(1 - p)).sum())

    grid = np.linspace(-2.0, 2.0, 401)
    return float(grid[int(np.argmax([loglik(s) for s in grid]))])
