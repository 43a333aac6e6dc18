"""An environment whose work is a timed model: multi-turn episodes for the benchmark.

:class:`SimulatedEnvironment` implements :class:`engines.envs.Environment` (async), for the
agentic workload of ``bench.rl``: an episode lasts ``min_turns`` to ``max_turns`` model turns
(uniform per episode), each environment step takes a modelled time drawn from
:class:`EnvLatency` (lognormal: most steps are quick, a few take far longer, like a tool call
that waits on a slow service or a test suite), then answers an observation of about
``observation_tokens`` tokens. The last step ends the episode with reward 1 with probability
``success_rate``.

With ``failure_rate`` > 0, that share of an episode's tries meets an infrastructure failure:
at one of its steps (drawn uniformly) the environment raises :class:`~engines.envs.EnvError`
after the step's time, as a server that dies mid-episode; the episode runner retries it on a
fresh environment (``env.retries``), then ends it ``env_error`` and its group is refilled.

Every draw is a hash of the episode's prompt and the model's text so far (never of timing or
call order), so the same samples make the same episodes in every schedule, process and run. A
failure's draw also counts the episode's earlier failed tries in this process, so that a
retry is a fresh draw (a transient failure), as deterministic as the rest
(:func:`forget_failures` starts the count again).
Sleeps last ``time_scale`` real seconds per modelled second, as the simulated engines'.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engines.envs.base import EnvError, StepResult
from engines.simulated.hashing import normal, uniform

__all__ = ["EnvLatency", "SimulatedEnvironment", "forget_failures"]

_FAILED: dict[tuple[int, str], int] = {}
"""Failed tries so far per (seed, episode key) in this process: a retry draws afresh."""


def forget_failures() -> None:
    """Forget the failed tries counted so far (called by a benchmark before each run, so that
    every run of one process meets the same failures)."""
    _FAILED.clear()


@dataclass(frozen=True, kw_only=True)
class EnvLatency:
    """Modelled seconds of one environment step: ``median_s * exp(sigma * z)``, at most
    ``max_s`` (``z`` standard normal). ``sigma = 1.5`` puts the 99th percentile at 33x the
    median: the long tail of tools and sandboxes."""

    median_s: float = 2.0
    """Median step time (modelled seconds)."""
    sigma: float = 1.5
    """Log-std of the step time."""
    max_s: float = 120.0
    """Longest step (a tool's own timeout)."""

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0 or self.max_s < self.median_s:
            raise ValueError(
                f"need median_s >= 0, sigma >= 0, max_s >= median_s; got {self.median_s}, "
                f"{self.sigma}, {self.max_s}"
            )

    def draw(self, *key: bytes | int | str) -> float:
        """The step time for ``key`` (the same key, the same time)."""
        return min(self.median_s * math.exp(self.sigma * normal(*key)), self.max_s)

    def mean_s(self) -> float:
        """Expected step time (uncapped lognormal mean; the cap lowers it slightly)."""
        return self.median_s * math.exp(self.sigma**2 / 2)


class SimulatedEnvironment:
    """A modelled multi-turn environment (see the module docstring); options are plain
    numbers so that a config can give them (``env.options``)."""

    def __init__(
        self,
        *,
        time_scale: float = 1.0,
        median_s: float = 2.0,
        sigma: float = 1.5,
        max_s: float = 120.0,
        min_turns: int = 2,
        max_turns: int = 8,
        observation_tokens: int = 32,
        success_rate: float = 0.5,
        failure_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        if time_scale <= 0 or not 1 <= min_turns <= max_turns or observation_tokens < 0:
            raise ValueError(
                f"need time_scale > 0, 1 <= min_turns <= max_turns, observation_tokens >= 0; "
                f"got {time_scale}, {min_turns}, {max_turns}, {observation_tokens}"
            )
        if not 0.0 <= failure_rate < 1.0:
            raise ValueError(f"need 0 <= failure_rate < 1, got {failure_rate}")
        self.failure_rate = failure_rate
        self._fail_at = 0
        self.latency = EnvLatency(median_s=median_s, sigma=sigma, max_s=max_s)
        self.time_scale = time_scale
        self.min_turns, self.max_turns = min_turns, max_turns
        self.observation_tokens = observation_tokens
        self.success_rate = success_rate
        self.seed = seed
        self._key = ""
        self._turn = 0
        self._turns = 0
        self.waited_s = 0.0
        """Modelled seconds this environment's steps took."""

    def reset(self, row: Mapping[str, Any]) -> None:
        self._key = repr(row.get("prompt"))
        self._turn = 0
        self._turns = 0

    async def step(self, action: str) -> StepResult:
        if self._turn == 0:  # the episode's first action tells the samples of a prompt apart
            self._key = f"{self._key}|{action}"
            span = self.max_turns - self.min_turns + 1
            self._turns = self.min_turns + int(uniform(self.seed, "turns", self._key) * span)
            self._fail_at = self._failing_turn()
        self._turn += 1
        wait = self.latency.draw(self.seed, "step", self._key, self._turn)
        self.waited_s += wait
        await asyncio.sleep(wait * self.time_scale)
        if self._turn == self._fail_at:
            failed = (self.seed, self._key)
            _FAILED[failed] = _FAILED.get(failed, 0) + 1
            raise EnvError(f"simulated infrastructure failure at step {self._turn}")
        if self._turn >= self._turns:
            won = uniform(self.seed, "reward", self._key) < self.success_rate
            return StepResult(None, reward=float(won), done=True, info={"tool_calls": 1})
        # about observation_tokens tokens: single digits are one token each in the tiny tokenizer
        digits = int(uniform(self.seed, "obs", self._key, self._turn) * 1e9)
        text = "".join(str((digits >> i) % 10) for i in range(self.observation_tokens))
        return StepResult(text, info={"tool_calls": 1})

    def _failing_turn(self) -> int:
        """The step at which this try fails (0: none), drawn from the episode's key and its
        earlier failed tries."""
        if not self.failure_rate:
            return 0
        tries = _FAILED.get((self.seed, self._key), 0)
        if uniform(self.seed, "fail", self._key, tries) >= self.failure_rate:
            return 0
        return 1 + int(uniform(self.seed, "fail-at", self._key, tries) * self._turns)
