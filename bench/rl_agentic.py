"""The agentic workload of ``bench.rl``: multi-turn episodes with a long-tailed environment.

    python -m bench.rl --workload agentic

Every sample is an episode of 2 to 8 model turns (uniform per episode); between two turns the
environment (:class:`engines.simulated.SimulatedEnvironment`) takes a modelled time drawn
from a lognormal (median 2 s, log-std 1.5: the 99th percentile is 33x the median, capped at
120 s), like tool calls that wait on services or test runs, and answers an observation of 32
tokens. A turn's length follows SmolLM2's measured spread (log-std 0.67) around a median of
120 tokens, at most 1024, with the measured share of runaway turns that run to the cap. The
engines are the calibrated simulated ones of every workload; each turn is a generate call
with the whole conversation as its prompt (the simulated engine charges its prefill again:
it models no prefix cache across turns, which costs every schedule alike).

The episode's reward is the environment's (success 50%). Long-tail migration is off (an
episode keeps its instance); the skew-aware schedules keep their ranker and dedicated
instances, which see whole episodes.

    python -m bench.rl --workload agentic --env-failure-rate 0.05

adds infrastructure failures: that share of episode tries fails at one of its steps (the
simulated environment raises ``EnvError``, seeded); the runner retries the episode
(``env.retries``), then its group is dropped and refilled. Each chosen schedule (default
``async-k2``) runs without and with the failures, alternately, on one split (the balanced one
or ``--gen-gpus``); printed: samples/s of both, their ratio, the retries, ``env_error``
episodes and refilled groups (:func:`failure_comparison`; ``rl_agentic_failures.json``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines.simulated import Calibration, LognormalLengths

__all__ = ["AgenticWorkload", "failure_comparison", "failure_counts"]


@dataclass(frozen=True)
class AgenticWorkload:
    """The numbers of the workload (see the module docstring)."""

    turn_median: float = 120.0
    """Median tokens of a model turn."""
    turn_cap: int = 1024
    """Most tokens of a model turn."""
    min_turns: int = 2
    max_turns: int = 8
    env_median_s: float = 2.0
    """Median modelled seconds of an environment step."""
    env_sigma: float = 1.5
    """Log-std of an environment step's time."""
    env_max_s: float = 120.0
    observation_tokens: int = 32

    def turn_lengths(self, cal: Calibration, seed: int) -> LognormalLengths:
        """Per-turn lengths: the measured spread and runaway share, no growth with the
        conversation's length (the prompt of a later turn is the whole conversation)."""
        fit = cal.lengths
        return LognormalLengths(
            median=self.turn_median,
            sigma=fit.sigma,
            max_len=self.turn_cap,
            overlong_p=fit.overlong_p,
            overlong_slope=0.0,
            prompt_scale=0.0,
            seed=seed,
        )

    def mean_turns(self) -> float:
        return (self.min_turns + self.max_turns) / 2

    def overrides(
        self,
        time_scale: float,
        max_turn_tokens: int,
        failure_rate: float = 0.0,
        *,
        agent: bool = False,
    ) -> list[str]:
        """Config overrides that make a run's samples these episodes (``failure_rate``: the
        share of episode tries whose environment fails; ``agent``: played by
        :class:`engines.simulated.agent.SimulatedAgent` through the OpenAI-compatible endpoint,
        HTTP in the loop, instead of the environment seam)."""
        options: dict[str, Any] = {
            "failure_rate": failure_rate,
            "time_scale": time_scale,
            "median_s": self.env_median_s,
            "sigma": self.env_sigma,
            "max_s": self.env_max_s,
            "min_turns": self.min_turns,
            "max_turns": self.max_turns,
            "observation_tokens": self.observation_tokens,
        }
        flow = ", ".join(f"{k}: {v}" for k, v in options.items())
        budget = self.max_turns * (max_turn_tokens + self.observation_tokens + 16)
        # an environment call, or (agent) a whole episode: every turn and step
        timeout_s = max(10.0, 2 * self.env_max_s * time_scale) * (self.max_turns if agent else 1)
        seam = (
            [
                "rollout.agent=engines.simulated.agent:SimulatedAgent",
                f"rollout.agent_options={{{flow}}}",
            ]
            if agent
            else [
                "env.name=engines.simulated.environment:SimulatedEnvironment",
                f"env.options={{{flow}}}",
            ]
        )
        return [
            *seam,
            f"env.timeout_s={timeout_s}",
            f"env.max_observation_tokens={self.observation_tokens + 8}",
            f"rollout.max_turns={self.max_turns}",
            f"rollout.max_episode_tokens={budget}",
            "rollout.turn_gather_s=0",  # the simulated engine batches concurrent calls
            "rollout.migrate_after=0",
        ]


def failure_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """What the failures cost a run, from its step records: episode retries, episodes that
    ended ``env_error``, groups dropped (and refilled by the feeder)."""
    return {
        "retries": int(sum(r["env_retries"] for r in records)),
        "env_error": int(sum(r["episode_end_reasons"].get("env_error", 0) for r in records)),
        "groups_refilled": int(sum(r["groups_dropped"] for r in records)),
    }


def failure_comparison(
    names: list[str],
    rounds: int,
    one_run: Callable[[str, float, str], dict[str, Any]],
    rate: float,
) -> dict[str, Any]:
    """Per schedule: ``rounds`` pairs of runs without and with failures, alternately (both
    see the same machine load), through ``one_run(schedule, failure_rate, tag) -> stats``
    (``bench.rl``: a run and its :func:`failure_counts`). Prints each run, then the ratio
    of the summed samples/s (with failures / without); returns the table."""
    from bench.common import line

    table: dict[str, Any] = {}
    for name in names:
        runs: dict[str, list[dict[str, Any]]] = {"clean": [], "failing": []}
        for i in range(rounds):
            for case, r in (("clean", 0.0), ("failing", rate)):
                stats = one_run(name, r, f"{case}-{i}")
                runs[case].append(stats)
                line(f"{name} env failures {r:g} #{i}", stats["samples_per_s"], "samples/s",
                     **stats["failures"])  # fmt: skip
        clean = sum(s["samples_per_s"] for s in runs["clean"])
        failing = sum(s["samples_per_s"] for s in runs["failing"])
        ratio = failing / clean
        keys = runs["failing"][0]["failures"]
        totals = {k: sum(s["failures"][k] for s in runs["failing"]) for k in keys}
        line(f"{name} failing/clean (rate {rate:g})", ratio, "x", **totals)
        table[name] = {"ratio": ratio, "runs": runs, "failures": totals}
    return table
