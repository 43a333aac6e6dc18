"""Rewards named by import path: a user's callable is found, a bad path says what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.rewards import FormatReward, make_reward

USER_MODULE = """
from typing import Any


def exact(prompts: Any, completions: Any, *, answer: Any, **_: Any) -> list[float | None]:
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]


class Longer:
    def __init__(self, at_least: int = 2) -> None:
        self.at_least = at_least

    def __call__(self, prompts: Any, completions: Any, **_: Any) -> list[float | None]:
        return [float(len(c) >= self.at_least) for c in completions]


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "userpkg_rewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "rewards.py").write_text(USER_MODULE)
    (pkg / "broken.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userpkg_rewards"


def test_functions_and_classes_by_import_path(user_pkg: str) -> None:
    exact = make_reward(f"{user_pkg}.rewards:exact")
    assert exact(["1 + 1 ="] * 2, ["2", " 3 "], answer=[2, 2]) == [1.0, 0.0]
    longer = make_reward(f"{user_pkg}.rewards:Longer", at_least=3)
    assert longer(["p", "p"], ["12", "123"]) == [0.0, 1.0]
    assert isinstance(make_reward("engines.rewards:FormatReward"), FormatReward)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("nopkg_xyz.rewards:exact", r"no module named 'nopkg_xyz'; put the module's folder on"),
        ("{pkg}.rewards:exakt", r"has no attribute 'exakt'; it defines \['Any', 'Longer'"),
        ("{pkg}.rewards:NOT_CALLABLE", r"is a int, not a callable"),
        ("{pkg}.broken:f", r"importing '\w+.broken' failed: RuntimeError: needs a GPU"),
        ("{pkg}.rewards:", r"must look like 'module.path:function'"),
        ("{pkg}.rewards.exact", r"unknown reward .*did you mean \w+\.rewards:exact\?"),
        (
            "mth",
            r"unknown reward 'mth' \(closest: 'math'\); known rewards: "
            r"\['countdown', 'episode', 'format', 'math', 'reasoning_gym'\]",
        ),
    ],
)
def test_bad_names_say_what_to_change(user_pkg: str, path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_reward(path.format(pkg=user_pkg))


def test_a_function_takes_no_options(user_pkg: str) -> None:
    with pytest.raises(ValueError, match="is a function: it takes no options"):
        make_reward(f"{user_pkg}.rewards:exact", scale=2)
