"""The built-in environments, their tasks, and the environment registry."""

from __future__ import annotations

import pytest

from engines.envs import ENVIRONMENTS, StepResult, environment_factory, register_environment
from engines.envs.guess_number import GuessNumberEnv, GuessNumberTask, binary_search
from engines.envs.tool_use import ToolUseEnv, ToolUseTask
from engines.tasks import TASKS, make_task, task_columns


def test_tool_use_task_items_are_questions_for_the_calculator() -> None:
    task = make_task("tool_use", seed=3)
    assert isinstance(task, ToolUseTask) and task.environment == "tool_use"
    for i in range(20):
        item = task.item(i)
        assert item == task.item(i)  # a function of (seed, index)
        a, b = (int(x) for x in item.prompt.removeprefix("What is ").rstrip("?").split(" * "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and item.answer == a * b
        assert item.turns == (f"<calc>{a} * {b}</calc>", str(a * b))
        assert item.reference == str(a * b)
    assert task_columns("tool_use") == ("answer",)


def test_tool_use_env_evaluates_calls_safely_and_judges_the_final_answer() -> None:
    env = ToolUseEnv(call_reward=0.25)
    env.reset({"prompt": "What is 37 * 48?", "answer": 1776})
    first = env.step("let me see <calc>37 * 48</calc> please")
    assert first == StepResult("1776", reward=0.25, info={"tool_calls": 1})
    again = env.step("<calc>(7 - 3) / 8</calc>")  # exact arithmetic; call reward only once
    assert again == StepResult("1/2", reward=0.0, info={"tool_calls": 1})
    bad = env.step("<calc>__import__('os').system('true')</calc>")
    assert bad.observation is not None and bad.observation.startswith("error:")
    assert not bad.done and bad.info == {"tool_calls": 1, "tool_errors": 1}
    assert env.step("so it is 1776") == StepResult(None, 1.0, True, {"correct": 1})
    env.reset({"answer": 1776})
    assert env.step("1777") == StepResult(None, 0.0, True, {"correct": 0})
    assert env.step("no number at all").reward == 0.0


def test_guess_number_rewards_fewer_turns() -> None:
    task = GuessNumberTask()
    item = task.item(5)
    assert item.turns == tuple(str(g) for g in binary_search(item.answer, 1, 16))
    assert item.row() == {"prompt": item.prompt, "answer": item.answer, "low": 1, "high": 16}
    env = GuessNumberEnv()
    env.reset({"answer": 11})
    assert env.step("8").observation == "higher"
    assert env.step("I guess 12").observation == "lower"
    assert env.step("hmm").observation == "say a number"
    done = env.step("11")
    assert done.done and done.reward == pytest.approx(0.7)  # right on turn 4
    env.reset({"answer": 3})
    assert env.step("3").reward == 1.0
    with pytest.raises(ValueError, match="answer must be an int"):
        env.reset({"answer": "3"})


def test_registry_names_imports_and_errors() -> None:
    assert set(ENVIRONMENTS) >= {"tool_use", "guess_number"}
    assert {"tool_use", "guess_number"} <= set(TASKS)
    env = environment_factory("tool_use", {"call_reward": 0.5})()
    assert isinstance(env, ToolUseEnv) and env.call_reward == 0.5
    by_path = environment_factory("engines.envs.guess_number:GuessNumberEnv")()
    assert isinstance(by_path, GuessNumberEnv)
    with pytest.raises(ValueError, match=r"unknown environment 'maze'; known environments: \["):
        environment_factory("maze")
    with pytest.raises(ValueError, match="bad options"):
        environment_factory("tool_use", {"reward": 1})
    with pytest.raises(ValueError, match="no module named 'nopkg_zz'"):
        environment_factory("nopkg_zz.envs:Maze")
    with pytest.raises(ValueError, match="has no attribute 'Maze'"):
        environment_factory("engines.envs.tool_use:Maze")
    with pytest.raises(ValueError, match="without"):
        environment_factory("engines.envs.tool_use:ToolUseTask")  # a class, not an environment
    with pytest.raises(ValueError, match="already registered"):
        register_environment("tool_use", "engines.envs.tool_use:ToolUseEnv")
