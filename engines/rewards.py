"""Rule-based rewards: plain callables with the :class:`engines.protocols.RewardFn` signature.

Each reward is called by the reward adapter (in a worker thread) as
``fn(prompts, completions, **columns)`` with decoded completions (special tokens removed) and
the row's other object columns, and returns one ``float | None`` per sample. A reward that also
reads a column the rollout writes (``finish_reason``: ``stop``, or ``length`` for a completion
cut off at ``rollout.max_new_tokens``) names it in a ``rollout_columns`` attribute
(:func:`rollout_columns`); the reward stage then passes it too.

``None`` means "no verdict" and the sample is left out of training. These rewards return it
only when the *row* gives nothing to judge against (its ``answer`` column is ``None``); a
completion that is malformed (no number, an unsafe or invalid expression) is a verdict: 0.

| reward            | reads columns        | score                                               |
|-------------------|----------------------|-----------------------------------------------------|
| MathAnswerReward  | answer               | 1 if the completion's final number equals answer    |
| FormatReward      | (none)               | 1 if the completion matches a regular expression    |
| CountdownReward   | answer, numbers      | 1 if the expression uses the numbers and hits answer|
| EpisodeReward     | episode_reward       | the environment's return of a multi-turn episode    |
| reasoning_gym     | rg_spec, rg_index,   | the reasoning-gym dataset's own ``score_answer``    |
|                   | finish_reason        | (:mod:`engines.reasoning_gym`)                      |
| WeightedReward    | those of its parts   | weighted sum of its parts                           |

:func:`make_reward` builds one by name (``math``, ``format``, ``countdown``, ``episode``,
``reasoning_gym``) or
imports a user's by import path (``mypkg.rewards:exact``; see :func:`load_reward`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from engines.expressions import ExpressionError, evaluate
from engines.imports import import_path
from engines.names import unknown_name

__all__ = [
    "REWARDS",
    "CountdownReward",
    "EpisodeReward",
    "FormatReward",
    "MathAnswerReward",
    "WeightedReward",
    "load_reward",
    "make_reward",
    "parse_final_number",
    "rollout_columns",
]

# A sign only where it cannot be a minus between operands ("7-3" ends in 3, not -3); a comma
# only as a thousands separator ("3,4" is two numbers).
_NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_MAX_SCAN_CHARS = 4096  # completions are scanned from their tail; a number is never this long


def parse_final_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (``-3``, ``1,024``, ``2.5``), or None if there is none.

    Thousands separators are dropped. Only the last ``4096`` characters are scanned.
    """
    matches = _NUMBER.findall(text[-_MAX_SCAN_CHARS:])
    if not matches:
        return None
    token = matches[-1].replace(",", "")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def _to_fraction(value: Any, column: str) -> Fraction:
    if isinstance(value, bool):
        raise ValueError(f"column {column!r} holds a bool ({value!r}), expected a number")
    if isinstance(value, int | Fraction):
        return Fraction(value)
    if isinstance(value, float) and math.isfinite(value):
        return Fraction(value)
    if isinstance(value, str):
        parsed = parse_final_number(value)
        if parsed is not None:
            return parsed
    raise ValueError(
        f"column {column!r} holds {value!r}, which is not a number; write answers as int, "
        "finite float or numeric str"
    )


def _column(columns: dict[str, Sequence[Any]], key: str, size: int, owner: str) -> Sequence[Any]:
    if key not in columns:
        raise KeyError(f"{owner} needs column {key!r}; the call passed {sorted(columns)}")
    values = columns[key]
    if len(values) != size:
        raise ValueError(f"{owner}: column {key!r} has {len(values)} rows, completions {size}")
    return values


class MathAnswerReward:
    """1.0 if the final number of the completion equals the ``answer`` column, else a lower score.

    ``closeness`` > 0 gives partial credit to a wrong number: ``closeness * max(0, 1 - |pred -
    answer| / scale)`` with ``scale = max(1, |answer|)`` (so always below 1). A completion with
    no number scores 0. A row whose answer is ``None`` gets ``None``.
    """

    def __init__(
        self, *, answer_key: str = "answer", tolerance: float = 1e-6, closeness: float = 0.0
    ) -> None:
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if not 0.0 <= closeness < 1.0:
            raise ValueError(f"closeness must be in [0, 1), got {closeness}")
        self.answer_key = answer_key
        self.tolerance = tolerance
        self.closeness = closeness

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        answers = _column(columns, self.answer_key, len(completions), "MathAnswerReward")
        rewards: list[float | None] = []
        for completion, answer in zip(completions, answers, strict=True):
            if answer is None:
                rewards.append(None)
                continue
            truth = _to_fraction(answer, self.answer_key)
            pred = parse_final_number(completion)
            if pred is None:
                rewards.append(0.0)
                continue
            error = abs(float(pred - truth))
            if error <= self.tolerance:
                rewards.append(1.0)
            else:
                scale = max(1.0, abs(float(truth)))
                rewards.append(self.closeness * max(0.0, 1.0 - error / scale))
        return rewards


class FormatReward:
    """1.0 if the completion matches ``pattern`` (``re.fullmatch`` after stripping), else 0.0.

    The default pattern accepts a completion that is just an integer, the answer format the
    tiny-model demo teaches; pass e.g. ``r"(?s).*<answer>.*</answer>"`` for tagged formats.
    """

    DEFAULT_PATTERN = r"-?\d+"

    def __init__(self, pattern: str = DEFAULT_PATTERN) -> None:
        try:
            self.pattern = re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"FormatReward pattern {pattern!r} is not a valid regex: {exc}"
            ) from None

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        return [1.0 if self.pattern.fullmatch(c.strip()) else 0.0 for c in completions]


class EpisodeReward:
    """The return an environment gave a multi-turn episode (the rollout's ``episode_reward``
    column: the sum of its turn rewards), or None where the episode has no verdict (it ended
    in an environment error or timeout: NaN in the column).

    The default reward of a task with an environment (``engines.envs``); it can be weighed
    with others (``WeightedReward``), which then judge the decoded episode (every turn and
    observation after the prompt) as their completion.
    """

    def __init__(self, *, key: str = "episode_reward") -> None:
        self.key = key

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        values = _column(columns, self.key, len(completions), "EpisodeReward")
        out: list[float | None] = []
        for value in values:
            v = float(value)
            out.append(None if math.isnan(v) else v)
        return out


class CountdownReward:
    """1.0 if the completion is an expression over the row's numbers that equals the target.

    The expression is the last non-empty line of the completion, cut at its first ``=`` (so
    ``"(7 - 3) * 5 + 2 = 22"`` is accepted). It is evaluated by
    :func:`engines.expressions.evaluate` (parsed, never executed): only integer literals,
    ``+ - * /`` and parentheses. With ``use_all`` every number must be used exactly once,
    otherwise at most once. A valid expression with the wrong value scores ``format_score``;
    anything else 0. A row whose target is ``None`` gets ``None``.
    """

    def __init__(
        self,
        *,
        target_key: str = "answer",
        numbers_key: str = "numbers",
        use_all: bool = True,
        format_score: float = 0.0,
    ) -> None:
        if not 0.0 <= format_score < 1.0:
            raise ValueError(f"format_score must be in [0, 1), got {format_score}")
        self.target_key = target_key
        self.numbers_key = numbers_key
        self.use_all = use_all
        self.format_score = format_score

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        targets = _column(columns, self.target_key, len(completions), "CountdownReward")
        numbers = _column(columns, self.numbers_key, len(completions), "CountdownReward")
        return [
            None if target is None else self.score(completion, target, nums)
            for completion, target, nums in zip(completions, targets, numbers, strict=True)
        ]

    def score(self, completion: str, target: Any, numbers: Sequence[int]) -> float:
        """Score one completion against ``target`` using ``numbers``."""
        truth = _to_fraction(target, self.target_key)
        lines = [line for line in completion.strip().splitlines() if line.strip()]
        if not lines:
            return 0.0
        expression = lines[-1].split("=", 1)[0]
        try:
            result = evaluate(expression)
        except ExpressionError:
            return 0.0
        if not _uses_numbers(result.literals, numbers, exactly=self.use_all):
            return 0.0
        return 1.0 if result.value == truth else self.format_score


def _uses_numbers(used: Sequence[int], available: Sequence[int], *, exactly: bool) -> bool:
    remaining = list(available)
    for value in used:
        if value not in remaining:
            return False
        remaining.remove(value)
    return not remaining if exactly else True


RewardCallable = Callable[..., list[float | None]]


class WeightedReward:
    """``sum_i weight_i * reward_i`` per sample.

    If any part has no verdict (``None``) for a sample, the sum has none either: a partial sum
    would silently change the scale of that sample's reward relative to its group.
    """

    def __init__(self, parts: Sequence[tuple[RewardCallable, float]]) -> None:
        if not parts:
            raise ValueError("WeightedReward needs at least one (reward, weight) part")
        for fn, weight in parts:
            if not callable(fn):
                raise TypeError(f"WeightedReward part {fn!r} is not callable")
            if not math.isfinite(weight):
                raise ValueError(f"WeightedReward weight for {fn!r} must be finite, got {weight}")
        self.parts = list(parts)

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        totals: list[float | None] = [0.0] * len(completions)
        for fn, weight in self.parts:
            scores = fn(prompts, completions, **columns)
            if len(scores) != len(completions):
                raise ValueError(
                    f"reward {fn!r} returned {len(scores)} scores for {len(completions)} samples"
                )
            for i, score in enumerate(scores):
                total = totals[i]
                totals[i] = None if total is None or score is None else total + weight * score
        return totals


def rollout_columns(fn: Any) -> tuple[str, ...]:
    """The rollout's columns ``fn`` reads besides the row's: its ``rollout_columns`` attribute,
    or those of a :class:`WeightedReward`'s parts (in order, once each); none by default."""
    if isinstance(fn, WeightedReward):
        names = [c for part, _ in fn.parts for c in rollout_columns(part)]
        return tuple(dict.fromkeys(names))
    return tuple(getattr(fn, "rollout_columns", ()))


def _reasoning_gym(**options: Any) -> RewardCallable:
    from engines.reasoning_gym import ReasoningGymReward  # its library only when called

    return ReasoningGymReward(**options)


REWARDS: dict[str, Callable[..., RewardCallable]] = {
    "math": MathAnswerReward,
    "format": FormatReward,
    "countdown": CountdownReward,
    "episode": EpisodeReward,
    "reasoning_gym": _reasoning_gym,
}
"""Reward factories by name, for configs and command lines."""


def make_reward(name: str, **options: Any) -> RewardCallable:
    """Build reward ``name`` with keyword ``options``.

    ``name`` is a built-in (``math``, ``format``, ``countdown``, ``episode``) or an import path
    ``module.path:attribute`` (see :func:`load_reward`). Raises ``ValueError`` for an unknown
    name or an import path that does not name a callable.
    """
    if ":" in name:
        return load_reward(name, **options)
    try:
        factory = REWARDS[name]
    except KeyError:
        hint = ""
        if "." in name:  # a dotted path without the colon
            module, _, attribute = name.rpartition(".")
            hint = f" (did you mean {module}:{attribute}?)"
        raise ValueError(
            unknown_name(
                "reward", name, REWARDS, other=f", or an import path 'module.path:function'{hint}"
            )
        ) from None
    return factory(**options)


def load_reward(path: str, **options: Any) -> RewardCallable:
    """Import the reward callable named by ``path`` = ``module.path:attribute``.

    The attribute is the reward itself (a function ``(prompts, completions, **columns) ->
    list[float | None]``), or a class, which is instantiated with ``options`` (like the
    built-in rewards). The module must be importable from ``sys.path`` (``PYTHONPATH``).
    Raises ``ValueError`` naming ``path`` and what to change.
    """
    obj = import_path(path, "reward", target="function", example="mypkg.rewards:exact")
    if isinstance(obj, type):
        obj = obj(**options)
    elif options:
        raise ValueError(f"reward {path!r} is a function: it takes no options, got {options}")
    if not callable(obj):
        raise ValueError(
            f"reward {path!r} is a {type(obj).__name__}, not a callable "
            "(prompts, completions, **columns) -> list[float | None]"
        )
    reward: RewardCallable = obj
    return reward
