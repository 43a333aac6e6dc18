"""One episode's trajectory: every token after the prompt, and what each token is.

The layout, per token of the sequence that follows the prompt (``T`` tokens)::

    index          0    1    2    3  |  4    5    6    7    8  |  9   10
    who            model turn 0      |  observation            |  model turn 1
    token_ids      <    c    ...  eos|  \\n  <|user|> 1776 ... |  1776 eos
    loss_mask      1    1    1    1  |  0    0    0    0    0  |  1    1
    logprobs       -.1  -.3  ...  -.2|  0    0    0    0    0  |  -.4  -.1
    versions       3    3    3    3  | -1   -1   -1   -1   -1  |  4    4
    turn_offsets   [0, 9]: where each model turn starts

``versions`` holds, per token, the policy version that sampled it (-1: not sampled: an
observation or template token). Tokens of one turn carry the version of the weights that
generated them; an engine that takes new weights in the middle of a turn (partial rollouts)
records several versions within it, in the same column. The episode's ``version`` is its
oldest token's: what the staleness bound is checked against.

A one-turn response is an episode with one turn and no observation (the single-turn rollout
writes it through the same columns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.protocols import Generation

__all__ = ["END_REASONS", "Episode", "EpisodeBuilder", "token_versions"]

END_REASONS = ("done", "max_turns", "max_tokens", "timeout", "env_error")
"""Why an episode ended: the environment said done (or, with no environment, the response
ended); ``max_turns`` turns were taken; the token budget ran out; the episode outlived its
wall-clock budget (the policy's failure: trained with the timeout reward); the environment's
infrastructure failed on every try (raised, hung past its bound or answered something
malformed: never trained, its group is dropped)."""

FAILED = ("env_error",)
"""End reasons that leave an episode without a verdict (its return is NaN, see
:attr:`Episode.episode_reward`): its group is dropped, never trained."""


def token_versions(gen: Generation) -> torch.Tensor:
    """Per-token versions of one generation (``Generation.token_versions``): one version
    throughout, or, when a weight update interrupted the turn (partial rollouts), the older
    version up to the switch and the newer one after it."""
    return gen.token_versions.to(torch.int64)


@dataclass
class Episode:
    """A finished episode (see the module docstring for the per-token columns)."""

    token_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool: true on the model's own tokens
    logprobs: torch.Tensor  # [T] float32 behaviour log-probs, 0 off the mask
    versions: torch.Tensor  # [T] int64, -1 off the mask
    turn_offsets: torch.Tensor  # [turns] int64: where each model turn starts
    turn_rewards: torch.Tensor  # [turns] float32; NaN: no reward (no environment, or it failed)
    end_reason: str
    finish_reason: str  # of the last model turn: "stop" or "length"
    info: dict[str, float] = field(default_factory=dict)
    """Numbers of the environment's ``StepResult.info``, summed over the turns."""
    error: str | None = None
    """What went wrong, for ``env_error`` and ``timeout`` endings."""
    final_reward: float | None = None
    """The return set by the runner instead of the turns' sum (a ``timeout``: the timeout
    reward); None: the sum of ``turn_rewards``."""
    stats: dict[str, Any] = field(default_factory=dict)
    """How the episode's time went (the runner's :class:`EpisodeStats` as a dict: per-call
    latencies of ``reset``/``step``, time waiting on the engine and on the environment,
    retries); empty for an episode no runner ran."""
    prompt_ids: torch.Tensor | None = None
    """[P] int64: the prompt the tokens follow, when it is not the row's own (an agent's
    first call, :mod:`engines.agents`); None: the row's ``prompt_ids``."""

    def __post_init__(self) -> None:
        shape = self.token_ids.shape
        for name in ("loss_mask", "logprobs", "versions"):
            if getattr(self, name).shape != shape:
                raise ValueError(f"Episode.{name} {tuple(getattr(self, name).shape)} != {shape}")
        if self.turn_offsets.shape != self.turn_rewards.shape:
            raise ValueError("Episode.turn_offsets and turn_rewards must have one entry per turn")
        if self.end_reason not in END_REASONS:
            raise ValueError(f"end_reason must be one of {END_REASONS}, got {self.end_reason!r}")

    @property
    def num_turns(self) -> int:
        return int(self.turn_offsets.numel())

    @property
    def model_tokens(self) -> int:
        """Tokens the model generated (what training learns from)."""
        return int(self.loss_mask.sum())

    @property
    def version(self) -> int:
        """The oldest version among the model's tokens (-1: the model wrote nothing)."""
        sampled = self.versions[self.loss_mask]
        return int(sampled.min()) if sampled.numel() else -1

    @property
    def episode_reward(self) -> float:
        """The return: the sum of the turn rewards (a turn the environment never judged, cut
        by the token budget, counts 0), or ``final_reward`` where the runner set one (a
        ``timeout``); NaN, "no verdict", when the environment failed (``env_error``) or there
        was none."""
        if self.end_reason in FAILED:
            return math.nan
        if self.final_reward is not None:
            return self.final_reward
        if bool(self.turn_rewards.isnan().any()):
            return math.nan
        return float(self.turn_rewards.sum())

    @classmethod
    def single(cls, gen: Generation) -> Episode:
        """A one-turn response as an episode (no environment: its turn reward is NaN)."""
        n = int(gen.token_ids.numel())
        return cls(
            token_ids=gen.token_ids.long(),
            loss_mask=torch.ones(n, dtype=torch.bool),
            logprobs=gen.logprobs.float(),
            versions=token_versions(gen),
            turn_offsets=torch.zeros(1, dtype=torch.int64),
            turn_rewards=torch.full((1,), math.nan),
            end_reason="done" if gen.finish_reason == "stop" else "max_tokens",
            finish_reason=gen.finish_reason,
        )


class EpisodeBuilder:
    """Appends turns and observations; :meth:`finish` gives the :class:`Episode`.

    ``judged``: an environment judges the turns (each turn's reward starts at 0 until it
    does); without one the turn rewards are NaN.
    """

    def __init__(self, *, judged: bool = True) -> None:
        self._unjudged = 0.0 if judged else math.nan
        self._ids: list[torch.Tensor] = []
        self._mask: list[torch.Tensor] = []
        self._logprobs: list[torch.Tensor] = []
        self._versions: list[torch.Tensor] = []
        self._offsets: list[int] = []
        self._rewards: list[float] = []
        self._info: dict[str, float] = {}
        self._finish = "stop"
        self.length = 0
        """Tokens so far (after the prompt)."""

    def sequence(self) -> torch.Tensor:
        """The tokens so far, [length] int64."""
        if not self._ids:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(self._ids)

    def add_turn(self, gen: Generation) -> None:
        n = int(gen.token_ids.numel())
        self._offsets.append(self.length)
        self._rewards.append(self._unjudged)
        self._ids.append(gen.token_ids.long())
        self._mask.append(torch.ones(n, dtype=torch.bool))
        self._logprobs.append(gen.logprobs.float())
        self._versions.append(token_versions(gen))
        self._finish = gen.finish_reason
        self.length += n

    def add_observation(self, ids: list[int]) -> None:
        n = len(ids)
        self._ids.append(torch.tensor(ids, dtype=torch.int64))
        self._mask.append(torch.zeros(n, dtype=torch.bool))
        self._logprobs.append(torch.zeros(n, dtype=torch.float32))
        self._versions.append(torch.full((n,), -1, dtype=torch.int64))
        self.length += n

    def reward(self, value: float, info: dict[str, object]) -> None:
        """The environment's answer to the last turn: its reward and counters."""
        self._rewards[-1] = float(value)
        for k, v in info.items():
            if isinstance(v, int | float):  # bools count as 0 / 1; other values are not summed
                self.count(k, float(v))

    def count(self, name: str, amount: float = 1.0) -> None:
        """Add to one of the episode's counters (``Episode.info``)."""
        self._info[name] = self._info.get(name, 0.0) + amount

    def finish(
        self, end_reason: str, error: str | None = None, *, final_reward: float | None = None
    ) -> Episode:
        def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)

        return Episode(
            token_ids=cat(self._ids, torch.int64),
            loss_mask=cat(self._mask, torch.bool),
            logprobs=cat(self._logprobs, torch.float32),
            versions=cat(self._versions, torch.int64),
            turn_offsets=torch.tensor(self._offsets, dtype=torch.int64),
            turn_rewards=torch.tensor(self._rewards, dtype=torch.float32),
            end_reason=end_reason,
            finish_reason=self._finish,
            info=dict(self._info),
            error=error,
            final_reward=final_reward,
        )
