"""A user's reward module: what ``reward.functions=[my_rewards:exact_answer]`` imports.

Any module on ``PYTHONPATH`` works the same way (``mypkg.rewards:exact`` for a package).
A reward is a plain callable: the prompts, the decoded completions and the row's columns (the
data set's answer as ``answer``, plus the ``extra_keys`` columns) in; one ``float | None`` per
completion out (None: no verdict, the sample is left out of training).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def exact_answer(
    prompts: Sequence[Any], completions: Sequence[str], *, answer: Sequence[Any], **_: Any
) -> list[float | None]:
    """1.0 if the completion is exactly the answer (surrounding spaces aside), else 0.0."""
    return [
        None if a is None else float(c.strip() == str(a))
        for c, a in zip(completions, answer, strict=True)
    ]
