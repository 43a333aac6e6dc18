"""The command line: --help lists every field; a bad config is one line from run and config."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncflow.cli import main
from asyncflow.config import RunConfig
from asyncflow.config.help import field_docs

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "data" / "arithmetic_train.jsonl"


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            keys += _leaf_keys(type(value), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


@pytest.mark.parametrize("command", ["run", "config"])
def test_help_lists_every_field_with_type_default_and_doc(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    docs = field_docs()
    assert [d.key for d in docs] == _leaf_keys(RunConfig)  # every field, none twice
    undocumented = [d.key for d in docs if not d.doc]
    assert not undocumented, f"fields without a docstring: {undocumented}"
    for d in docs:
        assert f"  {d.key} ({d.type}) = {d.default}\n" in out
    assert "  train.steps (int) = 300\n      Optimizer steps of the run." in out
    assert "  output.loggers (list[str]) = ['jsonl', 'tensorboard']" in out
    assert "  rollout.top_p (float) = 1.0" in out and "  train.is_cap (float | None) = 2.0" in out
    # and the options of each task, the file task's column names among them
    assert "task.options of task.name=file:\n  path (str) = (required)\n" in out
    assert "  prompt_key (str) = 'prompt'\n      Column holding the prompt" in out
    assert "  extra_keys (Sequence[str]) = ()" in out


def _files(tmp_path: Path) -> dict[str, str]:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  steps: 3\n   lr: 0.1\n")
    listed = tmp_path / "list.yaml"
    listed.write_text("- train\n- steps\n")
    return {"BAD_YAML": str(bad_yaml), "LIST_YAML": str(listed), "TMP": str(tmp_path)}


# (arguments, what the one line must say); each case from `asyncflow config` and `asyncflow run`
BAD = {
    "unknown key": (
        ["train.stepz=3"],
        r"unknown key\(s\) \['stepz'\] in train; valid keys: \[.*\]; did you mean 'steps'\?",
    ),
    "unknown section": (
        ["trian.steps=3"],
        r"unknown key\(s\) \['trian'\] in config; valid keys: .*did you mean 'train'",
    ),
    "wrong type": (["train.steps=lots"], r"train\.steps: expected int, got 'lots'; write e\.g\."),
    "wrong list item": (["reward.weights=[1, x]"], r"reward\.weights: \[1, 'x'\] does not match"),
    "out of range": (["train.max_staleness=-1"], r"train\.max_staleness must be >= 0, got -1"),
    "out of range 2": (["rollout.top_p=1.5"], r"rollout\.top_p in \(0, 1\], got .* 1\.5"),
    "unknown engine": (["rollout.engine=tgi"], r"rollout\.engine must be hf, vllm or simulated"),
    "engine no model": (["rollout.engine=simulated"], r"rollout\.engine=simulated has no model"),
    "unknown reward": (["reward.functions=[mth]"], r"reward\.functions: unknown reward 'mth'"),
    "bad import path": (
        ["reward.functions=[nopkg_zz.rewards:exact]"],
        r"reward\.functions: reward 'nopkg_zz\.rewards:exact': no module named 'nopkg_zz'",
    ),
    "missing attribute": (
        ["reward.functions=[engines.rewards:nope]"],
        r"'engines\.rewards' has no attribute 'nope'; it defines",
    ),
    "unknown task": (["task.name=chess"], r"task\.name: unknown task 'chess'; known tasks: \['ar"),
    "misspelt task": (["task=arithmetc"], r"unknown task 'arithmetc' \(closest: 'arithmetic'\)"),
    "misspelt env": (["env=guess_numbr"], r"unknown environment 'guess_numbr' \(closest: 'gue"),
    "misspelt reward": (["reward.functions=[mth]"], r"unknown reward 'mth' \(closest: 'math'\)"),
    "bad task option": (
        ["task.options={max_operant: 5}"],
        r"task\.options of task 'arithmetic': unknown option\(s\) \['max_operant'\]",
    ),
    "bad task value": (
        ["task.options={min_operand: 5, max_operand: 2}"],
        r"task\.options of task 'arithmetic': min_operand \(5\) must be <= max_operand",
    ),
    "missing data file": (
        ["task.name=file", "task.options={path: {TMP}/none.jsonl}"],
        r"task\.options of task 'file': data path '.*none\.jsonl' does not exist",
    ),
    "wrong column": (
        ["task.name=file", f"task.options={{path: {TRAIN}, prompt_key: prompt}}"],
        r"has no column 'prompt' \(prompt_key\); its columns are \['question', 'answer'\]",
    ),
    "too few epochs": (
        ["task.name=file", f"task.options={{path: {TRAIN}, prompt_key: question, epochs: 1}}"],
        r"train\.steps=300 x train\.groups_per_step=8 needs 2400 prompts but the task gives 80",
    ),
    "bad model": (["model.name={TMP}/nomodel"], r"model\.name='.*nomodel' is neither 'tiny'"),
    "bad dtype": (["model.dtype=float8"], r"model\.dtype must be float32, bfloat16 or float16"),
    "old key": (["output.tensorboard=false"], r"output\.tensorboard was replaced by output\.logg"),
    "unknown logger": (["output.loggers=[jsonl,neptune]"], r"unknown logger\(s\) \['neptune'\]"),
    "override without =": (["train.steps=3", "steps"], r"override 'steps' must look like"),
    "bad override YAML": (["task.options={a: "], r"override 'task\.options=\{a: ': the value is"),
    "missing file": (["{TMP}/nope.yaml"], r"config file '.*nope\.yaml' not found; pass an exist"),
    "malformed YAML": (["{BAD_YAML}"], r"bad\.yaml: malformed YAML \(.* at line 3, column 6\)"),
    "YAML not a mapping": (["{LIST_YAML}"], r"the top level of a config file must be a mapping"),
}


@pytest.mark.parametrize("command", ["config", "run"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_is_one_line_naming_the_fix(
    case: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, pattern = BAD[case]
    argv = [command]
    for arg in args:
        for name, value in _files(tmp_path).items():
            arg = arg.replace("{" + name + "}", value)
        argv.append(arg)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("asyncflow: bad config: ")
    assert re.search(pattern, lines[0]), lines[0]


def test_config_accepts_what_run_accepts_and_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    options = f"task.options={{path: {TRAIN}, prompt_key: question, epochs: 30}}"
    assert main(["config", "task.name=file", options, "reward.functions=[math, format]"]) == 0
    out = capsys.readouterr().out
    assert "name: file" in out and "prompt_key: question" in out
    assert yaml.safe_load(out)["reward"]["functions"] == ["math", "format"]


@pytest.mark.parametrize("command", ["config", "run"])
def test_no_traceback_from_a_real_process(command: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", command, str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("asyncflow: bad config:")
