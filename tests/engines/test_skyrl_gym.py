"""SkyRL-Gym environments from its own registry (``skyrl_gym.make``), unmodified: its
``gsm8k_multi_turn`` (turn-level rewards, a prompt for the answer after each wrong turn) played
by hand, then multi-turn episodes in a workflow run of the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow import run
from asyncflow.config import ConfigError
from asyncflow.config.check import check_config
from engines.envs import StepResult, environment_factory
from tests.asyncflow.conftest import small_config


def test_a_registered_environment_plays_turn_by_turn() -> None:
    env = environment_factory("skyrl_gym:gsm8k_multi_turn", {"extras": {"max_turns": 3}})()
    assert env.reset({"prompt": "What is 3 + 4?", "answer": 7}) is None  # the prompt alone
    wrong = env.step("It is #### 8")
    assert isinstance(wrong, StepResult)
    assert not wrong.done and "ANSWER" in (wrong.observation or "")
    assert wrong.reward == pytest.approx(0.2 / 3)  # its format score: well written, wrong
    assert wrong.info == {"steps": 1.0}  # get_metrics() moved by one step
    no_format = env.step("seven")
    assert (no_format.reward, no_format.done) == (0.0, False)
    right = env.step("#### 7")
    assert (right.reward, right.done, right.observation) == (1.0, True, None)
    close = getattr(env, "close", None)
    assert callable(close)
    close()


def test_a_run_plays_multi_turn_episodes_of_a_registered_environment(tmp_path: Path) -> None:
    cfg = small_config(
        tmp_path / "run",
        "task=arithmetic",
        "env.name=skyrl_gym:gsm8k_multi_turn",
        "env.options={extras: {max_turns: 3}}",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=3",
        "rollout.max_episode_tokens=96",
        "env.max_observation_tokens=48",
        "train.steps=3",
    )
    result = run(cfg)
    assert [rep.step for rep in result.reports] == [0, 1, 2]
    for r in result.records:
        assert set(r["episode_end_reasons"]) <= {"done", "max_turns", "max_tokens"}
        assert r["turns_mean"] > 1.0  # the environment asked again after a wrong turn


def test_an_unknown_id_fails_before_the_run(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "task=arithmetic", "env.name=skyrl_gym:no_such_env")
    with pytest.raises(ConfigError, match="gsm8k_multi_turn"):  # the registered ids listed
        check_config(cfg)
