"""``bench.rl --workload agentic --env-failure-rate``: the simulated environment's seeded
infrastructure failures, and a short run of the benchmark that retries and refills them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.rl import SCHEDULE_BY_NAME, Setup, run_schedule
from bench.rl_agentic import failure_counts
from engines.envs import EnvError
from engines.simulated import calibrated
from engines.simulated.environment import SimulatedEnvironment, forget_failures


async def _play(env: SimulatedEnvironment, prompt: str) -> int:
    """Steps until the episode ends; -N when it fails at step N."""
    env.reset({"prompt": prompt})
    for turn in range(1, env.max_turns + 1):
        try:
            result = await env.step("a")
        except EnvError:
            return -turn
        if result.done:
            return turn
    raise AssertionError("the episode did not end")


def test_failures_are_seeded_shared_as_asked_and_a_retry_draws_afresh() -> None:
    def fresh(seed: int) -> SimulatedEnvironment:
        return SimulatedEnvironment(time_scale=1e-6, failure_rate=0.3, seed=seed)

    forget_failures()
    prompts = [f"p{i}" for i in range(400)]
    first = [asyncio.run(_play(fresh(7), p)) for p in prompts]
    failed = [p for p, r in zip(prompts, first, strict=True) if r < 0]
    assert 0.2 < len(failed) / len(prompts) < 0.4  # the share asked for
    second = [asyncio.run(_play(fresh(7), p)) for p in failed]  # the retries
    assert 0.15 < sum(r < 0 for r in second) / len(failed) < 0.45  # a fresh draw, not a replay
    forget_failures()  # a new run: the same seed, the same failures
    assert [asyncio.run(_play(fresh(7), p)) for p in prompts] == first
    clean = SimulatedEnvironment(time_scale=1e-6, seed=7)
    assert all(asyncio.run(_play(clean, p)) > 0 for p in prompts[:50])  # rate 0: none
    with pytest.raises(ValueError, match="failure_rate"):
        SimulatedEnvironment(failure_rate=1.0)


def test_a_short_benchmark_run_retries_and_refills_and_trains_whole_groups(
    tmp_path: Path,
) -> None:
    """Three in ten episode tries fail and none is retried: episodes end ``env_error``,
    their groups are refilled, every step still trains its whole groups; with the default
    retries, the same failures are retried."""
    setup = Setup(gpus=4, groups_per_step=2, group_size=4, steps=3, time_scale=0.002,
                  workload="agentic", env_failure_rate=0.3, env_retries=0)  # fmt: skip
    cal = calibrated()
    sched = SCHEDULE_BY_NAME["async-k1"]
    forget_failures()
    result = run_schedule(sched, setup, cal, tmp_path / "no-retry", gen_gpus=2)
    counts = failure_counts(result.records)
    assert counts["env_error"] > 0 and counts["groups_refilled"] > 0 and counts["retries"] == 0
    assert [rep.samples for rep in result.reports] == [8] * 3  # whole groups, every step
    forget_failures()
    retried = run_schedule(
        sched, Setup(**{**setup.__dict__, "env_retries": None}), cal, tmp_path / "retry", 2
    )
    assert failure_counts(retried.records)["retries"] > 0
    assert [rep.samples for rep in retried.reports] == [8] * 3
