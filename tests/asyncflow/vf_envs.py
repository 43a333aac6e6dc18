"""verifiers environments for the tests, written with the real library as its users write them.

They live in an importable module (not a test module) so that the rollout and the data loader,
wherever they run, load them by path
(``rollout.agent=verifiers:tests.asyncflow.vf_envs:single_turn``).
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

QUESTIONS = [
    {
        "question": f"{a} + {b} =",
        "answer": str(a + b),
        # a correct first turn of the tool env (task.options.reference_key=call: the tiny
        # model's warm start learns to call the tool from it)
        "call": f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>',
    }
    for a in range(6)
    for b in range(4)
]


def _text(parser: Any, completion: Any) -> str:
    return parser.parse_answer(completion) or ""


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def single_turn() -> Any:
    """One answer per question: correct (weight 1), and short (weight 0.5, what the tiny model
    can learn in a few steps)."""
    parser = vf.Parser()

    def correct(completion: Any, answer: str, **kwargs: Any) -> float:
        return float(answer in _text(parser, completion))

    def short(completion: Any, **kwargs: Any) -> float:
        return 1.0 / (1.0 + len(_text(parser, completion)))

    rubric = vf.Rubric(funcs=[correct, short], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(QUESTIONS),
        system_prompt="Answer with the number.",
        parser=parser,
        rubric=rubric,
    )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def tool_env(max_turns: int = 2) -> Any:
    """The ``add`` tool; the model's tool calls go to it and its results back to the model
    until the model answers without one (or ``max_turns``). Reward: the final answer is right
    (1) and short (0.5 / (1 + length)), the first tool call added the right numbers (1)."""
    parser = vf.Parser()

    def correct(completion: Any, answer: str, **kwargs: Any) -> float:
        return float(answer in _text(parser, completion))

    def short(completion: Any, **kwargs: Any) -> float:
        return 1.0 / (1.0 + len(_text(parser, completion)))

    def tool_result_right(completion: Any, answer: str, **kwargs: Any) -> float:
        results = [_field(m, "content") for m in completion if _field(m, "role") == "tool"]
        return float(bool(results) and str(results[0]).strip() == answer)

    rubric = vf.Rubric(
        funcs=[correct, short, tool_result_right], weights=[1.0, 0.5, 1.0], parser=parser
    )
    return vf.ToolEnv(
        dataset=Dataset.from_list(QUESTIONS),
        tools=[add],
        max_turns=max_turns,
        parser=parser,
        rubric=rubric,
    )
