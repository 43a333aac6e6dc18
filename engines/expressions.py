"""Safe evaluation of small arithmetic expressions, for tasks and rule-based rewards.

Text from a model is never handed to ``eval``: it is parsed with :func:`ast.parse` (which only
parses) and the tree is walked here, accepting nothing but integer literals, the four binary
operators and parentheses. Arithmetic is exact (:class:`fractions.Fraction`), so ``7 / 2 * 2``
is 7, not 7.000000001. Input length is capped and its characters checked before parsing, so
that a pathological completion cannot make the parser work hard (nor warn).

Called by :mod:`engines.tasks` (to compute answers of the expressions it draws) and by
:mod:`engines.rewards` (to verify countdown completions).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["MAX_EXPRESSION_CHARS", "Evaluation", "ExpressionError", "evaluate"]

MAX_EXPRESSION_CHARS = 256
"""Longest expression :func:`evaluate` accepts; longer text is rejected before parsing."""

_CHARACTERS = re.compile(r"[0-9_+\-*/().\s]+")
"""What an accepted expression can be made of (floats and ``_`` get a precise error later)."""

_OPERATORS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
}


class ExpressionError(ValueError):
    """The text is not an expression of the accepted form, or has no value (division by 0)."""


@dataclass(frozen=True)
class Evaluation:
    """The exact value of an expression and the integer literals it used, in reading order."""

    value: Fraction
    literals: tuple[int, ...]


def evaluate(
    text: str,
    *,
    operators: str = "+-*/",
    allow_unary_minus: bool = False,
    max_chars: int = MAX_EXPRESSION_CHARS,
) -> Evaluation:
    """Parse and evaluate ``text`` exactly.

    ``operators`` lists the binary operators accepted (a subset of ``+-*/``). Raises
    :class:`ExpressionError` naming the offending part for anything else: names, calls,
    floats, ``**``, comparisons, text longer than ``max_chars``, or a division by zero.
    """
    if len(text) > max_chars:
        raise ExpressionError(
            f"expression has {len(text)} characters, more than max_chars={max_chars}"
        )
    stripped = text.strip()
    if not stripped:
        raise ExpressionError("expression is empty")
    if not _CHARACTERS.fullmatch(stripped):
        # before parsing: names and odd literals ("3ab", "1if") are refused here, and the
        # parser never warns about text a model wrote
        raise ExpressionError(
            f"not an arithmetic expression: {stripped!r} (only digits, + - * /, parentheses "
            "and spaces)"
        )
    try:
        tree = ast.parse(stripped, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionError(f"not an arithmetic expression: {stripped!r} ({exc})") from None
    literals: list[int] = []
    value = _eval_node(tree.body, operators, allow_unary_minus, literals)
    return Evaluation(value=value, literals=tuple(literals))


def _eval_node(
    node: ast.expr, operators: str, allow_unary_minus: bool, literals: list[int]
) -> Fraction:
    if isinstance(node, ast.Constant):
        # bool is a subclass of int; True/False are not numbers in an arithmetic answer.
        if type(node.value) is not int:
            raise ExpressionError(f"only integer literals are allowed, got {node.value!r}")
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and allow_unary_minus:
        return -_eval_node(node.operand, operators, allow_unary_minus, literals)
    if isinstance(node, ast.BinOp):
        symbol = _OPERATORS.get(type(node.op))
        if symbol is None or symbol not in operators:
            raise ExpressionError(
                f"operator {type(node.op).__name__} is not allowed; allowed: {operators!r}"
            )
        left = _eval_node(node.left, operators, allow_unary_minus, literals)
        right = _eval_node(node.right, operators, allow_unary_minus, literals)
        if symbol == "+":
            return left + right
        if symbol == "-":
            return left - right
        if symbol == "*":
            return left * right
        if right == 0:
            raise ExpressionError("division by zero")
        return left / right
    raise ExpressionError(f"{type(node).__name__} is not allowed in an arithmetic expression")
