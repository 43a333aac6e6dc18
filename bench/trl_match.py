"""What ``bench.trl`` checks and computes on both sides: digests, the reward probe, summaries.

Imported by the parent (``bench.trl``, our virtualenv), by our runner (``bench.trl_ours``)
and by TRL's runner (``bench.trl_runner``, TRL's virtualenv), so it needs the standard library
only (and ``engines.rewards``, plain Python, for the reward wrapper). The runners write one
JSON result each; the parent compares their digests (prompt token ids, reward values on the
probe strings) and fails when they differ, then summarizes each run with
:func:`summarize_run` and the systems with :func:`ratios`.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "ids_digest",
    "probe_completions",
    "ratios",
    "reward_function",
    "rewards_digest",
    "summarize_run",
    "threshold_time",
]


def ids_digest(ids: Sequence[Sequence[int]]) -> str:
    """SHA-256 of every prompt's token ids, in order (lengths included: no two id lists of
    different splits hash alike)."""
    h = hashlib.sha256()
    for row in ids:
        h.update(json.dumps([int(t) for t in row]).encode())
        h.update(b"\n")
    return h.hexdigest()


def rewards_digest(values: Sequence[float | None]) -> str:
    """SHA-256 of reward values (None and NaN alike: no verdict), rounded to 1e-9."""
    norm = [
        None if v is None or (isinstance(v, float) and math.isnan(v)) else round(float(v), 9)
        for v in values
    ]
    return hashlib.sha256(json.dumps(norm).encode()).hexdigest()


def probe_completions(answers: Sequence[Any]) -> list[tuple[str, Any]]:
    """Completion strings, each with the answer it is judged against, that exercise the
    reward: right and wrong numbers, spacing, punctuation, trailing text, no number at all."""
    out: list[tuple[str, Any]] = []
    for ans in answers:
        try:
            n = int(ans)
        except (TypeError, ValueError):
            n = 0
        for text in (
            f"{ans}",
            f" {ans}",
            f"{ans}.",
            f"= {ans}",
            f"{n + 1}",
            f"{n}0",
            f"{ans} or {n - 1}",
            "x",
            "",
        ):
            out.append((text, ans))
    return out


def reward_function(spec: dict[str, Any]) -> Callable[..., list[float | None]]:
    """The reward as TRL's ``GRPOTrainer`` calls it (conversational prompts and completions,
    the dataset's other columns as keyword lists), judged by our reward functions
    (``engines.rewards``, imported here: plain Python) on the texts, as our reward stage
    builds them from ``spec["reward_functions"]`` and ``spec["reward_weights"]``."""
    from engines.rewards import WeightedReward, make_reward

    fns = [make_reward(name) for name in spec["reward_functions"]]
    weights = spec.get("reward_weights")
    if len(fns) == 1 and weights is None:
        fn: Callable[..., Sequence[float | None]] = fns[0]
    else:
        fn = WeightedReward(list(zip(fns, weights or [1.0] * len(fns), strict=True)))
    columns = list(spec["columns"])

    def reward(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
        texts = [c[-1]["content"] for c in completions]
        prompt_texts = [p[-1]["content"] for p in prompts]
        return list(fn(prompt_texts, texts, **{k: kw[k] for k in columns if k in kw}))

    return reward


def threshold_time(
    times: Sequence[float], rewards: Sequence[float], threshold: float, window: int
) -> float | None:
    """The first time at which the mean reward of the last ``window`` steps (full windows
    only) reaches ``threshold``; None if it never does. ``times[i]`` is when step ``i``
    ended."""
    if len(times) != len(rewards):
        raise ValueError(f"times has {len(times)} entries, rewards {len(rewards)}")
    for i in range(window - 1, len(rewards)):
        chunk = [r for r in rewards[i - window + 1 : i + 1] if math.isfinite(r)]
        if chunk and sum(chunk) / len(chunk) >= threshold:
            return times[i]
    return None


def summarize_run(
    run: dict[str, Any], samples_per_step: int, threshold: float, window: int
) -> dict[str, Any]:
    """One run's figures from its result: ``start`` (when its process was spawned, epoch s),
    ``step_times`` (epoch s at the end of each step), ``rewards`` (mean per step),
    ``train_s`` (the system's own training call).

    ``samples_per_s`` is the steady rate between the first and the last step (the first
    step's start-up cost is in ``first_step_s``); ``samples_per_s_train`` counts every step
    over the training call's wall time."""
    t = [x - run["start"] for x in run["step_times"]]
    r = [float(x) for x in run["rewards"]]
    n = len(t)
    if n < 2:
        raise ValueError(f"a run needs at least 2 steps to be summarized, got {n}")
    k = max(1, n // 10)
    finite_first = [x for x in r[:k] if math.isfinite(x)]
    finite_last = [x for x in r[-k:] if math.isfinite(x)]
    return {
        "steps": n,
        "samples_per_s": samples_per_step * (n - 1) / (t[-1] - t[0]),
        "samples_per_s_train": samples_per_step * n / run["train_s"],
        "train_s": run["train_s"],
        "first_step_s": t[0],
        "process_s": t[-1],
        "threshold_s": threshold_time(t, r, threshold, window),
        "reward_first": sum(finite_first) / max(1, len(finite_first)),
        "reward_last": sum(finite_last) / max(1, len(finite_last)),
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def ratios(per_system: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, Any]:
    """Means over seeds per system, and each system's ratios to ``baseline``: samples/s
    (steady and over the training call), time to the first step, and whether the final
    reward lies within the baseline's spread over seeds (min..max, widened by our own)."""
    base = per_system[baseline]
    out: dict[str, Any] = {"means": {}, "ratios": {}}
    for name, runs in per_system.items():
        reached = [x["threshold_s"] for x in runs if x["threshold_s"] is not None]
        out["means"][name] = {
            "samples_per_s": _mean([x["samples_per_s"] for x in runs]),
            "samples_per_s_train": _mean([x["samples_per_s_train"] for x in runs]),
            "first_step_s": _mean([x["first_step_s"] for x in runs]),
            "threshold_s": _mean(reached) if len(reached) == len(runs) else None,
            "reward_first": _mean([x["reward_first"] for x in runs]),
            "reward_last": _mean([x["reward_last"] for x in runs]),
            "reward_last_spread": [
                min(x["reward_last"] for x in runs),
                max(x["reward_last"] for x in runs),
            ],
            "seeds": len(runs),
        }
    b = out["means"][baseline]
    lo, hi = b["reward_last_spread"]
    for name, m in out["means"].items():
        if name == baseline:
            continue
        own_lo, own_hi = m["reward_last_spread"]
        out["ratios"][name] = {
            "samples_per_s": m["samples_per_s"] / b["samples_per_s"],
            "samples_per_s_train": m["samples_per_s_train"] / b["samples_per_s_train"],
            "first_step": m["first_step_s"] / b["first_step_s"],
            "threshold": None
            if m["threshold_s"] is None or b["threshold_s"] is None
            else m["threshold_s"] / b["threshold_s"],
            # overlapping spreads: the final rewards cannot be told apart over these seeds
            # (None with one seed each: a spread of one point says nothing)
            "reward_within_spread": None
            if len(base) < 2 or len(per_system[name]) < 2
            else own_lo <= hi and own_hi >= lo,
            "reward_last_minus_baseline": m["reward_last"] - b["reward_last"],
        }
    if len(base) > 1:
        out["means"][baseline]["samples_per_s_stdev"] = statistics.stdev(
            x["samples_per_s"] for x in base
        )
    return out
