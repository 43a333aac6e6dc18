"""``torch_threads``: the ``auto`` rule (``asyncflow.threads``) and what a run applies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncflow import load_config, run
from asyncflow import threads as th
from asyncflow.config.sections import ConfigError
from engines.tiny import build_tiny
from tests.asyncflow.conftest import small_config


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


def test_a_folders_parameters_are_counted_from_its_headers(tiny_folder: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    loaded = sum(p.numel() for p in model.parameters())
    assert th.folder_parameters(tiny_folder) == loaded
    assert th.folder_parameters(tiny_folder / "missing") is None
    # the tiny model's size as the rule knows it, before any folder exists
    assert th.policy_parameters(load_config(None, ["model.name=tiny"])) == loaded


@pytest.mark.parametrize(
    ("overrides", "cores", "ray_host", "expected"),
    [
        (["model.name=tiny", "train.max_staleness=0"], 16, False, 1),  # too small to split
        (["model.name=smollm2", "train.max_staleness=0"], 2, False, 2),  # stages in turn
        (["model.name=smollm2", "train.max_staleness=0"], 16, False, 16),
        (["model.name=smollm2", "train.max_staleness=1"], 2, False, 1),  # halves: overlap
        (["model.name=smollm2", "train.max_staleness=2"], 16, False, 8),
        (["model.name=smollm2", "train.max_staleness=1"], 4, True, 4),  # Ray: its placement
        (["model.name=smollm2", "torch_threads=3"], 16, False, 3),  # pinned
        (["model.name=smollm2", "torch_threads=null"], 16, False, None),  # torch's default
    ],
)
def test_the_auto_rule(overrides: list[str], cores: int, ray_host: bool, expected: int) -> None:
    cfg = load_config(None, overrides)
    assert th.intra_op_threads(cfg, cores=cores, ray_host=ray_host) == expected


@pytest.mark.parametrize("value", ["0", "many", "-2"])
def test_a_bad_value_names_the_field_and_what_it_takes(value: str) -> None:
    with pytest.raises((ConfigError, ValueError), match="torch_threads") as err:
        load_config(None, [f"torch_threads={value}"])
    assert "auto" in str(err.value)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_run_applies_the_rule_and_gives_the_callers_threads_back(
    tiny_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staleness: int
) -> None:
    """A policy over the threshold (here lowered below the tiny model's size) trains with
    every core when its stages take turns, half of them when they overlap; the caller's
    thread count is restored when the run returns."""
    monkeypatch.setattr(th, "AUTO_MIN_PARAMETERS", 100_000)
    cores = th.available_cores()
    before = torch.get_num_threads()
    cfg = small_config(
        tmp_path, f"model.name={tiny_folder}", f"train.max_staleness={staleness}", "train.steps=2"
    )
    result = run(cfg)
    assert result.extra["torch_threads"] == max(1, cores // (1 + staleness))
    assert torch.get_num_threads() == before
    monkeypatch.setattr(th, "AUTO_MIN_PARAMETERS", 10**12)  # the tiny model: one thread
    result = run(small_config(tmp_path / "b", f"model.name={tiny_folder}", "train.steps=2"))
    assert result.extra["torch_threads"] == 1
