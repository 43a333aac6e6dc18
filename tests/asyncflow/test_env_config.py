"""Config of multi-turn runs: the env section, its shorthands, defaults and early errors."""

from __future__ import annotations

import pytest

from asyncflow import load_config
from asyncflow.config import ConfigError
from asyncflow.config.check import check_config
from asyncflow.config.help import fields_help


def test_a_task_with_an_environment_brings_it_and_its_reward() -> None:
    plain = load_config()
    assert plain.environment() is None and plain.reward_functions() == ["math"]
    tool = load_config(overrides=["task=tool_use"])  # task=NAME is task.name=NAME
    assert tool.task.name == "tool_use" and tool.environment() == "tool_use"
    assert tool.reward_functions() == ["episode"]
    off = load_config(overrides=["task=tool_use", "env=none"])  # one-turn on its prompts
    assert off.environment() is None and off.reward_functions() == ["math"]
    mine = load_config(overrides=["env=my.envs:Maze", "reward.functions=[math, episode]"])
    assert mine.environment() == "my.envs:Maze" and mine.reward_functions() == ["math", "episode"]
    assert check_config(tool).environment == "tool_use"


def test_environment_errors_name_the_field_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"env\.name / env\.options: unknown environment 'maze'"):
        check_config(load_config(overrides=["env=maze"]))
    with pytest.raises(ConfigError, match=r"env\.name / env\.options: .*bad options \['speed'\]"):
        check_config(load_config(overrides=["task=tool_use", "env.options={speed: 2}"]))
    with pytest.raises(ValueError, match=r"rollout\.migrate_after .* set rollout\.migrate_after=0"):
        load_config(
            overrides=[
                "task=guess_number",
                "rollout.instances=2",
                "rollout.ranker=true",
                "rollout.long_instances=1",
                "rollout.migrate_after=64",
            ]
        )
    with pytest.raises(ValueError, match=r"env\.timeout_s must be > 0"):
        load_config(overrides=["env.timeout_s=0"])
    with pytest.raises(ValueError, match=r"rollout\.max_turns and rollout\.max_episode_tokens"):
        load_config(overrides=["rollout.max_turns=0"])


def test_help_documents_the_multi_turn_fields() -> None:
    text = fields_help()
    for key in (
        "env.name",
        "env.timeout_s",
        "rollout.max_turns",
        "rollout.max_episode_tokens",
        "task.options of task.name=tool_use",
    ):
        assert key in text, key


def test_an_openenv_session_cap_bounds_the_rollout_workers_environments() -> None:
    """``env.options.max_sessions`` of an OpenEnv server lowers ``env.max_concurrent`` (so
    episodes past the cap wait in the runner, not in ``reset`` against its timeout); other
    environments keep ``env.max_concurrent`` as it is."""
    from asyncflow.build import max_concurrent

    def cap(*overrides: str) -> int | None:
        cfg = load_config(overrides=list(overrides))
        return max_concurrent(cfg.environment() or "", cfg.env)

    url = "env.options={url: 'http://127.0.0.1:1', max_sessions: 2}"
    assert cap("env.name=openenv", url) == 2
    assert cap("env.name=openenv", url, "env.max_concurrent=8") == 2
    assert cap("env.name=openenv", url, "env.max_concurrent=1") == 1
    assert cap("env.name=openenv", "env.options={url: 'http://127.0.0.1:1'}") is None
    assert cap("task=tool_use", "env.max_concurrent=3") == 3
