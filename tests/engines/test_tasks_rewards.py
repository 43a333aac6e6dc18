"""Tasks give verifiable items; rewards score right answers 1, wrong 0, and never execute text."""

from __future__ import annotations

from fractions import Fraction

import msgpack
import pytest

from engines.expressions import ExpressionError, evaluate
from engines.rewards import (
    CountdownReward,
    FormatReward,
    MathAnswerReward,
    WeightedReward,
    make_reward,
    parse_final_number,
)
from engines.tasks import ArithmeticConfig, ArithmeticTask, CountdownTask, make_task


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_tasks_are_deterministic_and_msgpackable(name: str) -> None:
    a = make_task(name, seed=3).items(20)
    b = make_task(name, seed=3).items(20)
    c = make_task(name, seed=4).items(20)
    assert a == b
    assert a != c
    assert make_task(name, seed=3).item(7) == a[7]  # addressable by index
    for item in a:
        row = item.row()
        assert msgpack.unpackb(msgpack.packb(row)) == row


def test_arithmetic_answers_are_correct() -> None:
    task = ArithmeticTask(ArithmeticConfig(max_operand=20, operators="+-*/", num_operands=3))
    reward = MathAnswerReward()
    for item in task.items(200):
        expression = item.prompt.removesuffix(" =")
        assert evaluate(expression).value == item.answer
        assert item.answer >= 0  # allow_negative is off by default
        assert reward([item.prompt], [item.reference], answer=[item.answer]) == [1.0]


def test_countdown_references_solve_their_items() -> None:
    reward = CountdownReward()
    items = CountdownTask(seed=1).items(100)
    scores = reward(
        [i.prompt for i in items],
        [i.reference for i in items],
        answer=[i.answer for i in items],
        numbers=[i.extra["numbers"] for i in items],
    )
    assert scores == [1.0] * len(items)


def test_invalid_task_configs_name_the_field() -> None:
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticConfig(min_operand=5, max_operand=1)
    with pytest.raises(ValueError, match="operators"):
        ArithmeticConfig(operators="^")
    with pytest.raises(ValueError, match="known tasks"):
        make_task("chess")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("The answer is 19.", Fraction(19)),
        ("x = -5", Fraction(-5)),
        ("7-3", Fraction(3)),
        ("1,024 apples", Fraction(1024)),
        ("-2.5", Fraction(-5, 2)),
        ("no number here", None),
        ("", None),
    ],
)
def test_parse_final_number(text: str, value: Fraction | None) -> None:
    assert parse_final_number(text) == value


def test_math_reward_scores_right_wrong_malformed_and_missing() -> None:
    reward = MathAnswerReward()
    completions = ["7", "So 3 + 4 = 7", "8", "seven", "", "7"]
    answers = [7, "7", 7, 7, 7, None]
    assert reward([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, None]


def test_math_reward_partial_credit_stays_below_one() -> None:
    reward = MathAnswerReward(closeness=0.5)
    scores = reward(["", "", ""], ["10", "9", "100"], answer=[10, 10, 10])
    assert scores[0] == 1.0
    assert scores[1] == pytest.approx(0.5 * 0.9)
    assert scores[2] == 0.0


def test_math_reward_rejects_bad_columns() -> None:
    with pytest.raises(KeyError, match="answer"):
        MathAnswerReward()(["p"], ["1"])
    with pytest.raises(ValueError, match="not a number"):
        MathAnswerReward()(["p"], ["1"], answer=["abc"])


def test_format_reward() -> None:
    reward = FormatReward()
    assert reward(["", "", ""], ["42", " 42 ", "the answer is 42"]) == [1.0, 1.0, 0.0]
    tagged = FormatReward(r"(?s).*<answer>.*</answer>")
    assert tagged([""], ["think... <answer>3</answer>"]) == [1.0]
    with pytest.raises(ValueError, match="regex"):
        FormatReward("(")


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("(7 - 3) * 5 + 2", 1.0),
        ("(7 - 3) * 5 + 2 = 22", 1.0),
        ("thinking...\n2 + 5 * (7 - 3)", 1.0),
        ("(7 - 3) * 5", 0.0),  # does not use 2
        ("(7 - 3) * 5 + 2 + 2", 0.0),  # uses 2 twice
        ("(7 - 3) * 5 + 1", 0.0),  # 1 is not one of the numbers
        ("7 * 3 + 5 - 2", 0.1),  # valid, wrong value: format credit
        ("__import__('os').system('true')", 0.0),
        ("(7 - 3) ** 5 + 2", 0.0),
        ("7 / (3 - 3) + 5 + 2", 0.0),
        ("2.0 + 5 * (7 - 3)", 0.0),
        ("(" * 300 + "2", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_reward(completion: str, score: float) -> None:
    reward = CountdownReward(format_score=0.1)
    assert reward(["p"], [completion], answer=[22], numbers=[[7, 3, 5, 2]]) == [score]


def test_evaluate_is_exact_and_rejects_unsafe_text() -> None:
    assert evaluate("7 / 2 * 2").value == 7
    assert evaluate("(1 + 2) * 3").literals == (1, 2, 3)
    for bad in ["x + 1", "len('a')", "1 if 1 else 2", "True + 1", "-3 + 5", "1" * 300, "[1]"]:
        with pytest.raises(ExpressionError):
            evaluate(bad)
    assert evaluate("-3 + 5", allow_unary_minus=True).value == 2


def test_weighted_reward_combines_and_propagates_none() -> None:
    combined = WeightedReward([(MathAnswerReward(), 1.0), (FormatReward(), 0.25)])
    scores = combined(["", "", ""], ["7", "it is 7", "7"], answer=[7, 7, None])
    assert scores == [1.25, 1.0, None]
    with pytest.raises(ValueError, match="known rewards"):
        make_reward("bleu")
    assert make_reward("math")([""], ["1"], answer=[1]) == [1.0]
