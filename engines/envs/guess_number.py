"""Guess the number: a multi-step game with feedback after every guess.

The task (``guess_number``) draws a secret integer in ``[low, high]``; the environment
(``guess_number``) reads the last number of each model turn as a guess and answers
``higher`` or ``lower`` until the guess is right. Fewer turns is better: a right guess on turn
``t`` (1-based) earns ``max(min_reward, 1 - turn_penalty * (t - 1))``; an episode that runs out
of turns earns nothing. A turn without a number is answered ``say a number`` (a wasted turn).

    Guess my number from 1 to 16. | 8 | higher | 12 | lower | 10 | higher | 11 -> reward 0.7

The task's ``turns`` are binary search's guesses for the secret (a correct episode for the
tiny model's warm start); the row carries ``low`` and ``high`` besides ``answer``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from engines.envs.base import StepResult
from engines.recipe import Recipe
from engines.rewards import parse_final_number
from engines.tasks import Task, TaskItem

__all__ = ["GuessNumberConfig", "GuessNumberEnv", "GuessNumberTask", "binary_search"]


def binary_search(secret: int, low: int, high: int) -> list[int]:
    """The guesses of binary search (midpoint, rounded down) until it finds ``secret``."""
    if not low <= secret <= high:
        raise ValueError(f"secret {secret} is not in [{low}, {high}]")
    guesses: list[int] = []
    while True:
        mid = (low + high) // 2
        guesses.append(mid)
        if mid == secret:
            return guesses
        if mid < secret:
            low = mid + 1
        else:
            high = mid - 1


@dataclass(kw_only=True, frozen=True)
class GuessNumberConfig:
    """The range the secret is drawn from."""

    low: int = 1
    """Smallest secret (inclusive)."""
    high: int = 16
    """Largest secret (inclusive)."""
    prompt_template: str = "Guess my number from {low} to {high}."
    """Prompt text with ``{low}`` and ``{high}`` placeholders."""

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"need low <= high, got {self.low}, {self.high}")
        for key in ("{low}", "{high}"):
            if key not in self.prompt_template:
                raise ValueError(
                    f"prompt_template must contain {key!r}, got {self.prompt_template!r}"
                )


class GuessNumberTask(Task):
    """Secrets to guess; ``answer`` is the secret, ``low`` and ``high`` its range."""

    name = "guess_number"
    config_class = GuessNumberConfig
    environment = "guess_number"
    # binary search over the default 16 numbers needs up to 5 guesses (a run's default 4
    # turns leave one secret in 16 out of reach of the best policy)
    recipe = Recipe(max_turns=5)

    def __init__(self, config: GuessNumberConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or GuessNumberConfig()

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "config": asdict(self.config)}

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        return ("answer", "low", "high")

    def item(self, index: int) -> TaskItem:
        cfg = self.config
        secret = self._rng(index).randint(cfg.low, cfg.high)
        guesses = [str(g) for g in binary_search(secret, cfg.low, cfg.high)]
        return TaskItem(
            prompt=cfg.prompt_template.format(low=cfg.low, high=cfg.high),
            answer=secret,
            reference=guesses[-1],
            extra={"low": cfg.low, "high": cfg.high},
            turns=tuple(guesses),
        )


class GuessNumberEnv:
    """The game master of one episode (see the module docstring).

    Args:
        turn_penalty: reward lost per turn before the right guess.
        min_reward: the least a right guess earns, however late.
    """

    def __init__(self, *, turn_penalty: float = 0.1, min_reward: float = 0.1) -> None:
        if turn_penalty < 0 or not 0 <= min_reward <= 1:
            raise ValueError(
                f"need turn_penalty >= 0 and 0 <= min_reward <= 1, got {turn_penalty}, {min_reward}"
            )
        self.turn_penalty = turn_penalty
        self.min_reward = min_reward
        self._secret: int | None = None
        self._turns = 0

    def reset(self, row: Mapping[str, Any]) -> None:
        secret = row.get("answer")
        if not isinstance(secret, int) or isinstance(secret, bool):
            raise ValueError(f"guess_number: the row's answer must be an int, got {secret!r}")
        self._secret = secret
        self._turns = 0

    def step(self, action: str) -> StepResult:
        if self._secret is None:
            raise RuntimeError("guess_number: step() before reset()")
        self._turns += 1
        guess = parse_final_number(action)
        if guess is None:
            return StepResult("say a number", info={"no_number": 1})
        if guess == self._secret:
            reward = max(self.min_reward, 1.0 - self.turn_penalty * (self._turns - 1))
            return StepResult(None, reward=reward, done=True, info={"correct": 1})
        return StepResult("higher" if guess < self._secret else "lower")
