"""Config: defaults < file < overrides, typed errors that say what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow import build_components, load_config
from tests.asyncflow.conftest import small_config


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 0.001\nrollout:\n  group_size: 4\n")
    cfg = load_config(f, ["train.steps=9", "task.options={max_operand: 5}"])
    assert cfg.train.steps == 9 and cfg.train.lr == 0.001  # override beats file
    assert cfg.rollout.group_size == 4 and cfg.task.options == {"max_operand": 5}
    assert cfg.train.max_staleness == 1  # default kept


def test_unknown_key_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stepz'\] in train; valid keys"):
        load_config(overrides=["train.stepz=3"])


def test_type_and_range_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"train\.steps: expected int"):
        load_config(overrides=["train.steps=lots"])
    with pytest.raises(ValueError, match=r"train\.max_staleness must be >= 0"):
        load_config(overrides=["train.max_staleness=-1"])
    with pytest.raises(ValueError, match=r"rollout\.migrate_after needs rollout\.long_instances"):
        load_config(overrides=["rollout.migrate_after=512"])
    with pytest.raises(ValueError, match=r"rollout\.weight_sync must be eager or on_demand"):
        load_config(overrides=["rollout.weight_sync=lazy"])
    with pytest.raises(ValueError, match=r"kl_coef > 0 needs reference\.enabled"):
        load_config(overrides=["reference.kl_coef=0.1"])


def test_cli_prints_resolved_config() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "config", "train.steps=3"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "steps: 3" in out and "max_staleness: 1" in out
    bad = subprocess.run(
        [sys.executable, "-m", "asyncflow.cli", "config", "train.nope=1"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "valid keys" in bad.stderr


def test_unknown_engine_option_is_a_clear_error(out_dir: Path) -> None:
    """Caught while building the engines, before vLLM is imported: runs without vLLM."""
    cfg = small_config(out_dir, "rollout.engine=vllm", "rollout.engine_options={max_seqs: 8}")
    with pytest.raises(ValueError, match=r"\['max_seqs'\] are not fields of VLLMEngineConfig"):
        build_components(cfg)


def test_engine_options_cannot_replace_the_model() -> None:
    with pytest.raises(ValueError, match=r"must not set \['model'\]"):
        load_config(overrides=["rollout.engine=vllm", "rollout.engine_options={model: other}"])
