"""Tool use: arithmetic questions the model answers with a calculator tool.

The task (``tool_use``) asks for the product (by default) of two two-digit numbers: more than
a tiny model can compute in its head, easy with the calculator. The environment
(``tool_use``) is the calculator and the judge.

**The tool-call format** (fixed): a turn that contains ``<calc>EXPRESSION</calc>`` calls the
calculator; the environment evaluates the first such expression with the safe evaluator of
:mod:`engines.expressions` (integers, ``+ - * /``, parentheses; never ``eval``) and answers
with the exact value (``1776``, or ``7/2``), or with ``error: ...`` when the expression is not
one it accepts. A turn without a tool call is the final answer: its last number is compared
with the row's ``answer``.

A solved episode, as the model sees it (``|`` marks the turns; the prompt comes first)::

    What is 37 * 48? | <calc>37 * 48</calc> | 1776 | 1776

| turn                     | reward                 | done  | info                          |
|--------------------------|------------------------|-------|-------------------------------|
| a tool call              | ``call_reward`` (0)    | no    | ``tool_calls: 1`` (+ errors)  |
| a final answer           | 1 if right, else 0     | yes   | ``correct: 0 or 1``           |

Called by the episode runner (:mod:`engines.episodes`) for every turn of an episode; the
task by the prompt feeder and the tiny model's warm start (its items' ``turns`` are a correct
episode's model turns).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, ClassVar

from engines.envs.base import StepResult
from engines.expressions import ExpressionError, evaluate
from engines.recipe import Recipe
from engines.rewards import parse_final_number
from engines.tasks import Task, TaskItem

__all__ = ["CALL", "ToolUseConfig", "ToolUseEnv", "ToolUseTask", "format_value"]

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
"""A calculator call in a model turn: the expression between ``<calc>`` and ``</calc>``."""

_MAX_DRAWS = 1000


def format_value(value: Fraction) -> str:
    """The calculator's answer: an integer as is, a fraction as ``a/b``."""
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )


@dataclass(kw_only=True, frozen=True)
class ToolUseConfig:
    """Questions over two operands that the calculator answers."""

    min_operand: int = 10
    """Smallest operand (inclusive)."""
    max_operand: int = 99
    """Largest operand (inclusive)."""
    operators: str = "*"
    """Operators to draw from, a subset of ``+-*``."""
    prompt_template: str = "What is {expression}?"
    """Prompt text; ``{expression}`` is replaced by the expression, e.g. ``37 * 48``."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
            )
        if not self.operators or any(op not in "+-*" for op in self.operators):
            raise ValueError(
                f"operators must be a non-empty subset of '+-*', got {self.operators!r}"
            )
        if "{expression}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template must contain '{{expression}}', got {self.prompt_template!r}"
            )


class ToolUseTask(Task):
    """Arithmetic questions meant for the calculator; ``answer`` is the integer result."""

    name = "tool_use"
    config_class = ToolUseConfig
    environment = "tool_use"
    recipe = Recipe(
        # 108 steps teach the call format and, in about one episode in eight, copying the
        # tool's answer: a reward RL finds at once, and room for it to show (105 steps: about
        # 1%, which synchronous runs missed three times in three)
        warm_start_steps=108,
        train_steps=150,
    )

    def __init__(self, config: ToolUseConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or ToolUseConfig()

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "config": asdict(self.config)}

    def item(self, index: int) -> TaskItem:
        cfg = self.config
        rng = self._rng(index)
        for _ in range(_MAX_DRAWS):
            a = rng.randint(cfg.min_operand, cfg.max_operand)
            b = rng.randint(cfg.min_operand, cfg.max_operand)
            op = rng.choice(cfg.operators)
            expression = f"{a} {op} {b}"
            value = evaluate(expression).value
            if value < 0:
                continue
            answer = int(value)
            return TaskItem(
                prompt=cfg.prompt_template.format(expression=expression),
                answer=answer,
                reference=str(answer),
                turns=(f"<calc>{expression}</calc>", str(answer)),
            )
        raise ValueError(f"ToolUseConfig {cfg} yields no non-negative answer in {_MAX_DRAWS} draws")


class ToolUseEnv:
    """The calculator and the judge of one episode (see the module docstring).

    Args:
        call_reward: reward of a turn whose tool call the calculator could evaluate (at most
            once per episode), a shaping term; 0 by default: only the final answer counts.
        answer_key: the row's column holding the expected answer.
    """

    recipe: ClassVar[Recipe] = Recipe(
        max_new_tokens=24,  # a call, ``<calc>37 * 48</calc>`` and EOS, is 18 tiny-model tokens
        max_turns=3,  # a call, the answer, one turn to spare
        max_episode_tokens=64,  # the turns and the calculator's answer between them
    )
    """What an episode needs: turns long enough for a call, and turns for a call and an
    answer (the defaults of a run with this environment; ``engines.recipe``)."""

    def __init__(self, *, call_reward: float = 0.0, answer_key: str = "answer") -> None:
        self.call_reward = call_reward
        self.answer_key = answer_key
        self._answer: Fraction | None = None
        self._rewarded_call = False

    def reset(self, row: Mapping[str, Any]) -> None:
        answer = row.get(self.answer_key)
        if answer is None:
            raise ValueError(f"tool_use: the row has no {self.answer_key!r} column")
        self._answer = Fraction(answer)
        self._rewarded_call = False

    def step(self, action: str) -> StepResult:
        if self._answer is None:
            raise RuntimeError("tool_use: step() before reset()")
        call = CALL.search(action)
        if call is not None:
            try:
                value = evaluate(call.group(1)).value
            except ExpressionError as e:
                return StepResult(f"error: {e}", info={"tool_calls": 1, "tool_errors": 1})
            reward = 0.0 if self._rewarded_call else self.call_reward
            self._rewarded_call = True
            return StepResult(format_value(value), reward=reward, info={"tool_calls": 1})
        guess = parse_final_number(action)
        correct = guess is not None and guess == self._answer
        return StepResult(None, reward=float(correct), done=True, info={"correct": int(correct)})
