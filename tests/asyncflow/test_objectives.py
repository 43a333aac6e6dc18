"""Objectives, dynamic sampling and token budgets in whole runs on the tiny model.

A third of the prompts (answer a multiple of 3) get one reward for every sample: their groups
tie and must be filtered, never trained, and replaced (see ``tests.asyncflow.tie_rewards``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow import run
from tests.asyncflow.conftest import small_config
from tests.asyncflow.tie_rewards import REWARD, check_filtered_run


def test_dynamic_sampling_filters_counts_and_replaces(out_dir: Path, deploy: list[str]) -> None:
    """In every deployment (``ray``: two generators, two reward workers, two data-parallel
    trainer ranks splitting each micro-batch by tokens): decoupled PPO with interpolated
    proximal log-probs, dynamic sampling, a token budget; k = 1."""
    cfg = small_config(
        out_dir,
        REWARD,
        "train.steps=8",
        "train.max_staleness=1",
        "train.dynamic_sampling=true",
        "train.loss=decoupled",
        "train.prox_logp=interpolate",
        "train.micro_batch_groups=2",
        "train.max_tokens_per_micro_batch=48",
        *deploy,
    )
    result = run(cfg)
    assert [r["step"] for r in result.records] == list(range(8))
    check_filtered_run(result.records, cfg)
    for r in result.records:
        assert r["micro_batch_tokens_max"] <= 48
        assert r["rank_tokens_max_over_mean"] >= 1.0
        assert r["is_weight_mean"] > 0


@pytest.mark.parametrize(("prox", "k"), [("recompute", 0), ("interpolate", 2)])
def test_decoupled_objective_trains_with_either_proximal_policy(
    out_dir: Path, prox: str, k: int
) -> None:
    """``deploy=local`` with a reference stage under the token budget too: the proximal
    policy recomputed (its log-probs are the step's own: ``prox_logp_gap`` ~ 0) or
    interpolated, synchronous and two steps stale."""
    cfg = small_config(
        out_dir,
        REWARD,
        "train.steps=6",
        f"train.max_staleness={k}",
        "train.dynamic_sampling=true",
        "train.loss=decoupled",
        f"train.prox_logp={prox}",
        "train.max_tokens_per_micro_batch=40",
        "reference.enabled=true",
        "reference.kl_coef=0.01",
    )
    result = run(cfg)
    check_filtered_run(result.records, cfg)
    for r in result.records:
        if prox == "recompute":
            assert r["prox_logp_gap"] < 1e-4
        else:
            assert "prox_logp_gap" not in r
    scored = [r["stage_metrics"].get("reference", {}) for r in result.records]
    calls = [m["call_tokens_max"] for m in scored if "call_tokens_max" in m]
    assert calls and max(calls) <= 40
