"""A task and its environment bring the settings they learn with; ``asyncflow config`` says
where each value came from. Precedence, lowest first: defaults < environment's recipe <
task's recipe < config file < command line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from asyncflow import RunConfig, load_config
from asyncflow.cli import main
from asyncflow.config.load import config_to_dict, load_config_sources
from asyncflow.config.sources import RECIPE_KEYS
from engines.envs import StepResult, environment_recipe
from engines.envs.guess_number import GuessNumberTask
from engines.envs.tool_use import ToolUseEnv, ToolUseTask
from engines.recipe import Recipe

ENV_PATH = f"{__name__}:RecipeEnv"


class RecipeEnv:
    """An environment of one turn whose recipe overlaps the tool_use task's."""

    recipe: ClassVar[Recipe] = Recipe(max_new_tokens=11, max_turns=5, warm_start_steps=7)

    def reset(self, row: object) -> None:
        return None

    def step(self, action: str) -> StepResult:
        return StepResult(None, done=True)


def _value(cfg: RunConfig, key: str) -> object:
    obj: object = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(
    ("task", "task_cls"), [("tool_use", ToolUseTask), ("guess_number", GuessNumberTask)]
)
def test_task_alone_applies_its_and_its_environments_recipe(task: str, task_cls: type) -> None:
    cfg, sources = load_config_sources(overrides=[f"task={task}"])
    declared = {**environment_recipe(task).items(), **task_cls.recipe.items()}
    assert declared, "the built-in multi-turn tasks declare what they learn with"
    for name, value in declared.items():
        key = RECIPE_KEYS[name]
        assert _value(cfg, key) == value, key
        assert sources[key] in (f"task {task}", f"environment {task}"), sources[key]
    # everything else is the run's default, and says so
    plain = RunConfig()
    for key, source in sources.items():
        if source == "default":
            assert _value(cfg, key) == _value(plain, key), key


def test_tasks_without_a_recipe_run_on_the_defaults() -> None:
    assert config_to_dict(load_config()) == config_to_dict(RunConfig())
    cfg, sources = load_config_sources(overrides=["task=countdown"])
    assert cfg.rollout == RunConfig().rollout and cfg.train == RunConfig().train
    assert set(sources.values()) == {"default", "command line"}


def test_precedence_default_environment_task_file_command_line(tmp_path: Path) -> None:
    """One key per step of the ladder, each set by every layer up to its own."""
    f = tmp_path / "run.yaml"
    f.write_text(
        "task: tool_use\n"  # the file names the task: its recipe lies below the file
        f"env: {{name: '{ENV_PATH}'}}\n"
        "rollout: {max_turns: 2}\n"  # over the environment's 5
        "train: {steps: 20}\n"  # over the task's 150, under the command line's 30
    )
    cfg, sources = load_config_sources(f, ["train.steps=30"])
    expected = {  # key: (value, source)
        "rollout.max_episode_tokens": (256, "default"),  # nobody sets it (not tool_use's env)
        "rollout.max_new_tokens": (11, f"environment {ENV_PATH}"),
        "model.warm_start_steps": (108, "task tool_use"),  # the task's over the env's 7
        "rollout.max_turns": (2, f"file {f}"),
        "train.steps": (30, "command line"),
        "task.name": ("tool_use", f"file {f}"),
    }
    for key, (value, source) in expected.items():
        assert (_value(cfg, key), sources[key]) == (value, source), key
    # a file's value at the default is still the file's; a command-line task replaces the
    # file's, recipe and all
    other, sources = load_config_sources(f, ["task=arithmetic", "env=none"])
    assert other.model.warm_start_steps == RunConfig().model.warm_start_steps
    assert sources["model.warm_start_steps"] == "default"
    assert other.rollout.max_turns == 2 and sources["rollout.max_turns"] == f"file {f}"


def test_command_line_beats_the_recipe_key_by_key() -> None:
    cfg = load_config(overrides=["task=tool_use", "rollout.max_new_tokens=8", "train={steps: 5}"])
    assert cfg.rollout.max_new_tokens == 8 and cfg.train.steps == 5
    assert cfg.rollout.max_turns == ToolUseEnv.recipe.max_turns  # the rest of the recipe stays
    assert cfg.train.lr == RunConfig().train.lr  # a section given whole keeps its defaults
    # with env=none the calculator's turn settings go; the task's warm start stays
    one_turn = load_config(overrides=["task=tool_use", "env=none"])
    assert one_turn.rollout.max_new_tokens == RunConfig().rollout.max_new_tokens
    assert one_turn.model.warm_start_steps == ToolUseTask.recipe.warm_start_steps


def test_config_command_shows_each_values_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("rollout:\n  max_turns: 2\n  temperature: 0.7\n")
    assert main(["config", str(f), "task=tool_use", "train.steps=9"]) == 0
    out = capsys.readouterr().out
    cfg = load_config(f, ["task=tool_use", "train.steps=9"])
    assert yaml.safe_load(out) == config_to_dict(cfg)  # still the config, as YAML
    comments = {}
    section = ""
    for line in out.splitlines():
        if m := re.fullmatch(r"(\w+):", line):
            section = m.group(1)
        elif m := re.fullmatch(r"  (\w+): (.*?)\s+# (.+)", line):
            comments[f"{section}.{m.group(1)}"] = (m.group(2), m.group(3))
    assert comments["train.steps"] == ("9", "command line")
    assert comments["task.name"] == ("tool_use", "command line")
    assert comments["rollout.max_turns"] == ("2", f"file {f}")
    assert comments["rollout.temperature"] == ("0.7", f"file {f}")  # set, though the default
    assert comments["rollout.max_new_tokens"] == ("24", "environment tool_use")
    assert comments["rollout.max_episode_tokens"] == ("64", "environment tool_use")
    assert comments["model.warm_start_steps"] == ("108", "task tool_use")
    assert comments["train.lr"] == ("0.0002", "default")
    assert re.search(r"^    num_gpus: 0\.0 +# default$", out, re.M)  # nested sections too


def test_help_lists_what_each_task_brings() -> None:
    from asyncflow.config.help import fields_help

    text = " ".join(fields_help().split())
    assert "defaults it brings (task tool_use): model.warm_start_steps=108" in text
    assert "defaults it brings (environment tool_use): rollout.max_new_tokens=24" in text


def test_an_environment_recipe_must_be_a_recipe() -> None:
    assert environment_recipe("tool_use") is ToolUseEnv.recipe
    assert environment_recipe(f"{__name__}:StepResult") == Recipe()  # declares none
    with pytest.raises(ValueError, match="unknown environment 'maze'"):
        environment_recipe("maze")
    with pytest.raises(ValueError, match=r"recipe must be an engines\.recipe\.Recipe, got dict"):
        environment_recipe(f"{__name__}:BadRecipeEnv")
    with pytest.raises(ValueError, match=r"Recipe\.max_turns must be an int >= 0"):
        Recipe(max_turns=-1)


class BadRecipeEnv(RecipeEnv):
    recipe: ClassVar[dict[str, int]] = {"max_turns": 3}  # type: ignore[assignment]


def test_the_short_form_is_the_recipe_the_tool_use_example_spelled_out() -> None:
    """``examples/grpo_tool_use.py`` passed these before its task brought them: the short
    form runs the same config."""
    spelled_out = [
        "task.name=tool_use",
        "model.warm_start_steps=108",
        "rollout.max_new_tokens=24",
        "rollout.max_turns=3",
        "rollout.max_episode_tokens=64",
        "train.steps=150",
        "train.max_staleness=1",
    ]
    short = load_config(overrides=["task=tool_use"])
    assert config_to_dict(short) == config_to_dict(load_config(overrides=spelled_out))
