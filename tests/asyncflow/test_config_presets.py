"""A section's shorthand (``task=NAME``, ``env=NAME``, ``deploy=ray``: the presets) composes
with the section's other fields given on the same command line, in either order, and under a
file: default < task < file < command line, each value labelled with its source."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncflow.cli import main
from asyncflow.config.load import load_config_sources
from asyncflow.config.sections import ConfigError
from asyncflow.config.sources import PRESETS
from engines.envs.base import ENVIRONMENTS
from engines.tasks import TASKS

DOCS = Path(__file__).resolve().parents[2] / "docs"

# each preset's names, and an override of another field of its section (its options where it
# has them); a preset added to the registry without a row here fails the test below
CASES: dict[str, tuple[list[str], str, Any]] = {
    "model": (["tiny", "smollm2"], "warm_start_steps", 3),
    "task": (sorted(TASKS), "options", {"some_option": 8}),
    "env": ([*sorted(ENVIRONMENTS), "none"], "options", {"url": "http://127.0.0.1:1"}),
    "transferqueue": (["embedded", "service"], "num_units", 2),
    "deploy": (["local", "ray"], "num_cpus", 2),
}


def test_every_preset_has_a_case() -> None:
    assert set(CASES) == set(PRESETS), "give each preset of PRESETS its names and an override"


def _cases() -> list[tuple[str, str, str, Any]]:
    return [
        (section, name, key, value)
        for section, (names, key, value) in CASES.items()
        for name in names
    ]


@pytest.mark.parametrize("order", ["preset first", "override first"])
@pytest.mark.parametrize(("section", "name", "key", "value"), _cases())
def test_a_preset_takes_an_override_of_its_section_in_either_order(
    section: str, name: str, key: str, value: Any, order: str
) -> None:
    preset = f"{section}={name}"
    override = f"{section}.{key}={_flow(value)}"
    words = [preset, override] if order == "preset first" else [override, preset]
    cfg, sources = load_config_sources(overrides=words)
    assert getattr(getattr(cfg, section), PRESETS[section]) == name
    assert getattr(getattr(cfg, section), key) == value
    assert sources[f"{section}.{PRESETS[section]}"] == "command line"
    assert sources[f"{section}.{key}"] == "command line"


def test_dotted_keys_into_a_presets_options_add_up() -> None:
    cfg, _ = load_config_sources(
        overrides=["task=file", "task.options.path=p.jsonl", "task.options.prompt_key=q"]
    )
    assert cfg.task.name == "file"
    assert cfg.task.options == {"path": "p.jsonl", "prompt_key": "q"}
    # a whole value replaces what was there; a later preset keeps it
    cfg, _ = load_config_sources(
        overrides=["task.options.path=a", "task.options={high: 8}", "task=guess_number"]
    )
    assert (cfg.task.name, cfg.task.options) == ("guess_number", {"high": 8})


def test_a_file_preset_takes_command_line_options_and_keeps_its_own(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("task: guess_number\nenv: {options: {retries_note: 1}}\n")
    cfg, sources = load_config_sources(f, ["task.options.high=8", "env=guess_number"])
    assert (cfg.task.name, cfg.task.options) == ("guess_number", {"high": 8})
    assert sources["task.name"] == f"file {f}"
    assert sources["task.options"] == "command line"
    assert (cfg.env.name, cfg.env.options) == ("guess_number", {"retries_note": 1})
    assert sources["env.name"] == "command line" and sources["env.options"] == f"file {f}"
    # the preset's recipe stays below the file and the command line
    assert sources["rollout.max_turns"].endswith(" guess_number"), sources["rollout.max_turns"]


def test_a_value_is_not_a_section() -> None:
    with pytest.raises(ConfigError, match=r"override 'train.steps.x=1': 'steps' is 5"):
        load_config_sources(overrides=["train.steps=5", "train.steps.x=1"])


def test_the_issue_command_prints_the_options_from_the_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["config", "task=guess_number", "task.options={high: 8}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  name: guess_number +# command line$", out, re.M)
    assert re.search(r"^  options: \{high: 8\} +# command line$", out, re.M)


def _doc_commands(page: str) -> list[list[str]]:
    """The page's ``asyncflow run`` commands (continued lines joined), as argument lists."""
    text = (DOCS / page).read_text().replace("\\\n", " ")
    return [
        shlex.split(line.split("asyncflow run", 1)[1])
        for line in text.splitlines()
        if line.startswith("asyncflow run")
    ]


def test_the_external_environments_commands_resolve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/environments-external.md's commands, with the files they name: the prompts file
    and the page's own ``mygame/io.py``."""
    page = (DOCS / "environments-external.md").read_text()
    module = re.search(r"```python\n# mygame/io.py\n(.*?)```", page, re.S)
    assert module is not None, "the page shows mygame/io.py"
    (tmp_path / "mygame").mkdir()
    (tmp_path / "mygame" / "__init__.py").write_text("")
    (tmp_path / "mygame" / "io.py").write_text(module.group(1))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "Your move.", "answer": "e4"}\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    commands = [c for c in _doc_commands("environments-external.md") if "task=file" in c]
    assert len(commands) == 2, commands
    for words in commands:
        assert main(["config", *words]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert re.search(r"^  options: \{path: prompts.jsonl\} +# command line$", out, re.M)
        assert re.search(r"^  name: openenv +# command line$", out, re.M)
    sys.modules.pop("mygame.io", None)
    sys.modules.pop("mygame", None)


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)
