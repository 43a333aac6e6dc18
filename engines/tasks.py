"""Programmatic tasks with verifiable answers: arithmetic and countdown.

A task is an indexed, endless source of :class:`TaskItem` s. Item ``i`` of a task depends only
on the task's config, its seed and ``i`` (each item draws from its own ``random.Random`` seeded
by ``"<seed>:<i>"``), so a data loader can shard or resume by index and two processes built
with the same arguments see the same items.

| field       | type                 | example (arithmetic)    | example (countdown)          |
|-------------|----------------------|-------------------------|------------------------------|
| prompt      | str                  | ``"3 + 4 ="``           | ``"Numbers: 3 5 7. ..."``    |
| answer      | int                  | ``7``                   | ``22`` (the target)          |
| reference   | str                  | ``"7"``                 | ``"(7 - 3) * 5 + 2"``        |
| extra       | dict (msgpack-able)  | ``{}``                  | ``{"numbers": [3, 5, 7, 2]}``|
| turns       | tuple of str         | ``()``                  | ``()``                       |

``TaskItem.row()`` gives the columns a data loader writes (prompt, answer, extra columns);
``reference`` is a correct completion, used by :func:`engines.tiny.warm_start` and examples.
A task that needs other settings than a run's defaults to learn declares them in its
``recipe`` (:class:`engines.recipe.Recipe`).
Prompts and answers read from files come from :class:`engines.file_task.FileTask` (task
``file``): the same interface, a finite set of rows reshuffled every epoch. Tasks whose
episodes run over several turns with an environment (``tool_use``, ``guess_number``: see
:mod:`engines.envs`) name it in ``Task.environment`` and give a correct episode's model turns
in ``turns``.

Procedural tasks from reasoning-gym, scored by their own scorers: task ``reasoning_gym``
(:mod:`engines.reasoning_gym`, an optional extra). A verifiers environment's dataset: task
``verifiers`` (:mod:`engines.agents.verifiers_env`, an optional extra).

Called by the prompt data loader of the workflow, by examples, and by the tiny-model warm start.
"""

from __future__ import annotations

import importlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeAlias

from engines.expressions import evaluate
from engines.names import unknown_name
from engines.recipe import Recipe

__all__ = [
    "TASKS",
    "ArithmeticConfig",
    "ArithmeticTask",
    "CountdownConfig",
    "CountdownTask",
    "Prompt",
    "Task",
    "TaskItem",
    "make_task",
    "task_class",
    "task_columns",
    "task_config_class",
]

_MAX_DRAWS = 1000  # rejection-sampling budget per item before the config is declared infeasible

Prompt: TypeAlias = str | list[dict[str, str]]
"""A prompt: text (one user turn), or chat messages (``{"role": ..., "content": ...}`` dicts)."""


@dataclass(frozen=True)
class TaskItem:
    """One problem: the prompt, its verifiable answer and a correct completion.

    Generated tasks give an ``int`` answer; a file task gives the answer column's value as
    read (a number or a string such as ``"#### 72"``; ``None`` for no answer).
    """

    prompt: Prompt
    answer: Any
    reference: str
    extra: dict[str, Any] = field(default_factory=dict)
    turns: tuple[str, ...] = ()
    """A multi-turn task's correct episode: the model's turns, the environment answering in
    between (the last turn's text is ``reference``); empty for a one-turn task."""

    def row(self) -> dict[str, Any]:
        """The msgpack-able columns of this item: ``prompt``, ``answer`` and the extras."""
        return {"prompt": self.prompt, "answer": self.answer, **self.extra}


class Task(ABC):
    """An index-addressed source of problems (endless unless :meth:`num_items` says)."""

    name: ClassVar[str]
    config_class: ClassVar[type[Any]]
    """The frozen dataclass of the task's options (what :func:`make_task` builds it with)."""
    environment: ClassVar[str | None] = None
    """The environment (``engines.envs``) whose episodes the task's prompts start; None: a
    one-turn task (the response is judged by reward functions)."""
    default_reward: ClassVar[str] = "math"
    """The reward function (``engines.rewards.REWARDS``) of a one-turn run of this task that
    names none (``reward.functions`` null)."""
    recipe: ClassVar[Recipe] = Recipe()
    """The settings the task learns with where they differ from a run's defaults (tokens per
    turn, turns, warm start, steps: :class:`engines.recipe.Recipe`); a run with
    ``task=NAME`` starts from them, and its config file and command line override them."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    @abstractmethod
    def item(self, index: int) -> TaskItem:
        """Item ``index`` (>= 0); the same for the same config, seed and index."""

    @abstractmethod
    def spec(self) -> dict[str, Any]:
        """JSON-able identity of the task (name, config, seed), e.g. for cache keys."""

    def num_items(self) -> int | None:
        """How many items the task gives (``item(i)`` for ``i`` below it); None: endless."""
        return None

    def columns(self) -> tuple[str, ...]:
        """The names of the columns of ``row()`` other than ``prompt``: what a reward reads."""
        return self.config_columns(getattr(self, "config", None))

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        """The row columns besides ``prompt`` that a task with ``config`` writes, known from the
        config alone (no data read): the reward stage is built from it, on any host."""
        return ("answer",)

    def items(self, count: int, start: int = 0) -> list[TaskItem]:
        """Items ``start .. start + count - 1``."""
        if count < 0 or start < 0:
            raise ValueError(f"count and start must be >= 0, got count={count}, start={start}")
        return [self.item(i) for i in range(start, start + count)]

    def __iter__(self) -> Iterator[TaskItem]:
        index = 0
        while True:
            yield self.item(index)
            index += 1

    def _rng(self, index: int) -> random.Random:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        return random.Random(f"{self.name}:{self.seed}:{index}")


@dataclass(kw_only=True, frozen=True)
class ArithmeticConfig:
    """Expressions like ``3 + 4`` over uniformly drawn integer operands."""

    min_operand: int = 0
    """Smallest operand (inclusive)."""
    max_operand: int = 9
    """Largest operand (inclusive)."""
    num_operands: int = 2
    """Operands per expression (>= 2); operators between them are drawn independently."""
    operators: str = "+"
    """Operators to draw from, a subset of ``+-*/``. Divisions are always exact."""
    allow_negative: bool = False
    """Whether an answer may be negative (otherwise such draws are rejected)."""
    prompt_template: str = "{expression} ="
    """Prompt text; ``{expression}`` is replaced by the expression, e.g. ``3 + 4``."""

    def __post_init__(self) -> None:
        if self.min_operand > self.max_operand:
            raise ValueError(
                f"min_operand ({self.min_operand}) must be <= max_operand ({self.max_operand})"
            )
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        if not self.operators or any(op not in "+-*/" for op in self.operators):
            raise ValueError(
                f"operators must be a non-empty subset of '+-*/', got {self.operators!r}"
            )
        if "{expression}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template must contain '{{expression}}', got {self.prompt_template!r}"
            )


class ArithmeticTask(Task):
    """Arithmetic problems whose answer is an integer (non-integer draws are rejected)."""

    name = "arithmetic"
    config_class = ArithmeticConfig

    def __init__(self, config: ArithmeticConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or ArithmeticConfig()

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "config": asdict(self.config)}

    def item(self, index: int) -> TaskItem:
        cfg = self.config
        rng = self._rng(index)
        for _ in range(_MAX_DRAWS):
            operands = [
                rng.randint(cfg.min_operand, cfg.max_operand) for _ in range(cfg.num_operands)
            ]
            ops = [rng.choice(cfg.operators) for _ in range(cfg.num_operands - 1)]
            expression = _join(operands, ops)
            try:
                value = evaluate(expression, allow_unary_minus=True).value
            except ValueError:  # division by zero
                continue
            if value.denominator != 1 or (value < 0 and not cfg.allow_negative):
                continue
            answer = int(value)
            prompt = cfg.prompt_template.format(expression=expression)
            return TaskItem(prompt=prompt, answer=answer, reference=str(answer))
        raise ValueError(
            f"ArithmeticConfig {cfg} yields no integer answer in {_MAX_DRAWS} draws; "
            "widen the operand range, allow negative answers, or drop '/'"
        )


@dataclass(kw_only=True, frozen=True)
class CountdownConfig:
    """Reach a target by combining all the given numbers with ``+ - * /``, each used once."""

    num_numbers: int = 3
    """How many numbers the player gets (>= 2)."""
    min_number: int = 1
    """Smallest number (inclusive, >= 1)."""
    max_number: int = 9
    """Largest number (inclusive)."""
    max_target: int = 100
    """Largest target; targets are positive integers reachable with the numbers."""
    operators: str = "+-*/"
    """Operators the solution may use, a subset of ``+-*/``."""
    prompt_template: str = "Use {numbers} to make {target}."
    """Prompt text with ``{numbers}`` (space-separated) and ``{target}`` placeholders."""

    def __post_init__(self) -> None:
        if self.num_numbers < 2:
            raise ValueError(f"num_numbers must be >= 2, got {self.num_numbers}")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(
                f"need 1 <= min_number <= max_number, got {self.min_number}, {self.max_number}"
            )
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target}")
        if not self.operators or any(op not in "+-*/" for op in self.operators):
            raise ValueError(
                f"operators must be a non-empty subset of '+-*/', got {self.operators!r}"
            )
        for key in ("{numbers}", "{target}"):
            if key not in self.prompt_template:
                raise ValueError(
                    f"prompt_template must contain {key!r}, got {self.prompt_template!r}"
                )


class CountdownTask(Task):
    """Countdown problems; ``answer`` is the target, ``extra["numbers"]`` the numbers."""

    name = "countdown"
    config_class = CountdownConfig

    def __init__(self, config: CountdownConfig | None = None, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config or CountdownConfig()

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "config": asdict(self.config)}

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        return ("answer", "numbers")

    def item(self, index: int) -> TaskItem:
        cfg = self.config
        rng = self._rng(index)
        for _ in range(_MAX_DRAWS):
            numbers = [rng.randint(cfg.min_number, cfg.max_number) for _ in range(cfg.num_numbers)]
            solution = _random_tree(numbers, cfg.operators, rng)
            try:
                value = evaluate(solution, operators=cfg.operators).value
            except ValueError:  # division by zero
                continue
            if value.denominator != 1 or not 1 <= value <= cfg.max_target:
                continue
            target = int(value)
            prompt = cfg.prompt_template.format(
                numbers=" ".join(str(n) for n in numbers), target=target
            )
            return TaskItem(
                prompt=prompt, answer=target, reference=solution, extra={"numbers": numbers}
            )
        raise ValueError(
            f"CountdownConfig {cfg} yields no reachable target in {_MAX_DRAWS} draws; "
            "raise max_target or widen the number range"
        )


def _join(operands: list[int], ops: list[str]) -> str:
    parts = [str(operands[0])]
    for op, operand in zip(ops, operands[1:], strict=True):
        parts.append(f"{op} {operand}")
    return " ".join(parts)


def _random_tree(numbers: list[int], operators: str, rng: random.Random) -> str:
    """A random fully-parenthesized-where-needed expression using each number exactly once."""
    terms = [str(n) for n in rng.sample(numbers, len(numbers))]
    while len(terms) > 1:
        i = rng.randrange(len(terms) - 1)
        op = rng.choice(operators)
        left, right = terms[i], terms[i + 1]
        # Parenthesize compound operands so the string's reading equals the drawn tree.
        left = f"({left})" if " " in left else left
        right = f"({right})" if " " in right else right
        terms[i : i + 2] = [f"{left} {op} {right}"]
    return terms[0]


TASKS: dict[str, str] = {
    ArithmeticTask.name: "engines.tasks:ArithmeticTask",
    CountdownTask.name: "engines.tasks:CountdownTask",
    "file": "engines.file_task:FileTask",
    "tool_use": "engines.envs.tool_use:ToolUseTask",
    "guess_number": "engines.envs.guess_number:GuessNumberTask",
    "reasoning_gym": "engines.reasoning_gym:ReasoningGymTask",
    "verifiers": "engines.agents.verifiers_env:VerifiersTask",
}
"""Task classes by name, as import paths (a task's module is imported only when it is used)."""


def task_class(name: str) -> type[Task]:
    """The class of task ``name``; ``ValueError`` listing the known names if there is none."""
    try:
        module, _, attribute = TASKS[name].partition(":")
    except KeyError:
        raise ValueError(unknown_name("task", name, TASKS)) from None
    cls: type[Task] = getattr(importlib.import_module(module), attribute)
    return cls


def task_config_class(name: str) -> type[Any]:
    """The config dataclass of task ``name`` (its fields are the task's options)."""
    return task_class(name).config_class


def task_columns(name: str, **options: Any) -> tuple[str, ...]:
    """The columns of task ``name``'s rows besides ``prompt`` (what a reward reads), from its
    name and options alone: no data file is read. Equals ``make_task(...).columns()``."""
    cls = task_class(name)
    return cls.config_columns(cls.config_class(**options))


def make_task(name: str, *, seed: int = 0, **options: Any) -> Task:
    """Build task ``name`` with its config fields as keyword options.

    ``make_task("arithmetic", max_operand=20, operators="+-")``,
    ``make_task("file", path="train.jsonl", prompt_key="question")``. Raises ``ValueError``
    for an unknown name or option (listing the known ones) and for a bad option value.
    """
    cls = task_class(name)
    valid = [f.name for f in fields(cls.config_class)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} of task {name!r}; valid options: {valid}")
    build: Callable[..., Task] = cls  # every task class takes (config, *, seed)
    return build(cls.config_class(**options), seed=seed)
