"""The settings a task or an environment learns with: its :class:`Recipe`.

A multi-turn task cannot learn under a run's one-turn defaults: a calculator call is 18
tokens of the tiny tokenizer, more than the 4 tokens a one-turn arithmetic answer needs. So a
task class (``Task.recipe``) and an environment class (a ``recipe`` class attribute) may say
what they need, in the engines' own terms; a field left None has no opinion.

| field                  | what it sets                                   | run config key     |
|------------------------|------------------------------------------------|--------------------|
| ``max_new_tokens``     | tokens of one model turn at most               | same, ``rollout.`` |
| ``max_turns``          | model turns of an episode at most              | same, ``rollout.`` |
| ``max_episode_tokens`` | tokens of an episode after its prompt at most  | same, ``rollout.`` |
| ``warm_start_steps``   | supervised steps of the tiny model on the task | same, ``model.``   |
| ``train_steps``        | optimizer steps of a run that learns the task  | ``train.steps``    |

Read by the run's config loader (``asyncflow.config.load``), which lays a task's recipe over
its own defaults (an environment's below the task's) and anything a config file or the
command line gives over both; nothing in ``engines`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Recipe"]


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Defaults a task or an environment learns with (None: the run's own default)."""

    max_new_tokens: int | None = None
    """Tokens of one model turn at most (a tool call must fit)."""
    max_turns: int | None = None
    """Model turns of an episode at most."""
    max_episode_tokens: int | None = None
    """Tokens of an episode after its prompt at most (turns and observations)."""
    warm_start_steps: int | None = None
    """Supervised steps of the tiny model on the task's correct episodes before RL."""
    train_steps: int | None = None
    """Optimizer steps of a run that learns the task."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"Recipe.{f.name} must be an int >= 0 or None, got {value!r}")

    def items(self) -> dict[str, Any]:
        """The fields that have an opinion, by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
