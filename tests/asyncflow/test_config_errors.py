"""Whatever a task, dataset, environment or reward raises while the check builds it from the
config is one ``bad config`` line naming the option and the library's own message, exit 2; the
traceback only under ``--debug``."""

from __future__ import annotations

from typing import Any

import pytest

from asyncflow.cli import main

HERE = __name__


class ExplodingReward:
    """A reward class whose constructor fails as a library's would."""

    def __init__(self, **options: Any) -> None:
        raise RuntimeError("the grader's model file is missing")

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [0.0] * len(prompts)


class StrictEnv:
    """An environment whose option check asserts, as many libraries' configs do."""

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        assert options.get("size", 1) > 0, "size must be positive"

    def __init__(self, size: int = 1) -> None:
        self.size = size

    def reset(self, row: object) -> None:
        return None

    def step(self, action: str) -> None:
        return None


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("asyncflow: bad config: ")
    return lines[0]


GCD = [
    "task.name=reasoning_gym",
    "task.options.dataset=gcd",
    "task.options.config={min_value: 50, max_value: 10}",
]


@pytest.mark.parametrize("command", ["config", "run"])
def test_a_datasets_own_check_is_one_line_naming_the_option(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("reasoning_gym")
    line = _one_line(capsys, [command, *GCD])
    assert "task.options.config of task 'reasoning_gym'" in line, line
    assert line.endswith("max_value must be > min_value"), line


def test_debug_shows_the_librarys_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("reasoning_gym")
    assert main(["config", *GCD, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "AssertionError: max_value must be > min_value" in err
    assert err.splitlines()[-1].startswith("asyncflow: bad config: task.options.config")


def test_an_unknown_dataset_lists_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("reasoning_gym")
    line = _one_line(capsys, ["config", "task.name=reasoning_gym", "task.options.dataset=gcdd"])
    assert "task.options.dataset of task 'reasoning_gym'" in line, line
    assert "unknown reasoning-gym dataset 'gcdd' (closest: 'gcd'" in line, line
    mix = ["config", "task.name=reasoning_gym", "task.options.datasets={chain_sun: {}}"]
    line = _one_line(capsys, mix)
    assert "task.options.datasets of task" in line and "(closest: 'chain_sum'" in line, line


def test_a_rewards_own_failure_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, ["config", f"reward.functions=[{HERE}:ExplodingReward]"])
    assert line.endswith(
        f"reward.functions: reward '{HERE}:ExplodingReward': RuntimeError: the grader's model "
        "file is missing"
    ), line


def test_an_environments_own_check_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capsys, ["config", f"env={HERE}:StrictEnv", "env.options={size: 0}"])
    assert "env.name / env.options" in line, line
    # (pytest's assertion rewriting adds its explanation to this module's assert message)
    assert "AssertionError: size must be positive" in line, line
