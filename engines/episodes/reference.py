"""A task's correct episode as tokens: what a supervised warm start trains on.

A multi-turn task gives the model's turns of a correct episode (``TaskItem.turns``); the
observations between them come from running the task's environment on those turns, so the
warm start sees exactly the token layout the rollout produces (:mod:`engines.episodes.format`),
with each model turn closed by EOS.

Called by :func:`engines.tiny.warm_start`.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import torch

from engines.envs.base import EnvFactory, StepResult
from engines.episodes.format import TurnFormat
from engines.tasks import TaskItem

__all__ = ["reference_episode"]


def _wait(value: Any) -> Any:
    return asyncio.run(value) if inspect.isawaitable(value) else value  # type: ignore[arg-type]


def reference_episode(
    item: TaskItem, factory: EnvFactory, turn_format: TurnFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [T] int64, loss_mask [T] bool)`` of ``item``'s correct episode, after its
    prompt. Raises ``ValueError`` if the item has no turns, or the environment ends the
    episode before its last turn or fails to end it after."""
    if not item.turns:
        raise ValueError("reference_episode needs an item with turns (a multi-turn task)")
    eos = turn_format.eos_token_id
    if eos is None:
        raise ValueError("reference_episode needs a tokenizer with an eos token")
    env = factory()
    ids: list[int] = []
    mask: list[bool] = []
    first = _wait(env.reset(item.row()))
    if first is not None:
        obs, _ = turn_format.observation(first, after_eos=False)
        ids += obs
        mask += [False] * len(obs)
    for i, turn in enumerate(item.turns):
        tokens = [*turn_format.encode(turn), eos]
        ids += tokens
        mask += [True] * len(tokens)
        result = _wait(env.step(turn))
        if not isinstance(result, StepResult):
            raise ValueError(f"the environment's step returned {type(result).__name__}")
        last = i == len(item.turns) - 1
        if result.done != last:
            raise ValueError(
                f"the reference episode {list(item.turns)} ends at turn {i} of "
                f"{len(item.turns)} (done={result.done}): the task's turns and its environment "
                "disagree"
            )
        if not last:
            obs, _ = turn_format.observation(result.observation or "", after_eos=True)
            ids += obs
            mask += [False] * len(obs)
    close = getattr(env, "close", None)
    if callable(close):
        _wait(close())
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)
