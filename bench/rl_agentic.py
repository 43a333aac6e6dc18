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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.simulated import Calibration, LognormalLengths

__all__ = ["AgenticWorkload"]


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
        self, time_scale: float, max_turn_tokens: int, *, agent: bool = False
    ) -> list[str]:
        """Config overrides that make a run's samples these episodes (``agent``: played by
        :class:`engines.simulated.agent.SimulatedAgent` through the OpenAI-compatible endpoint,
        HTTP in the loop, instead of the environment seam)."""
        options: dict[str, Any] = {
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
