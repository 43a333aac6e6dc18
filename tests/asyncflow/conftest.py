"""Small, fast run configs on the real tiny model (built once, cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow import RunConfig, load_config


def small_config(out: Path, *overrides: str) -> RunConfig:
    return load_config(
        overrides=[
            f"output.dir={out}",
            "output.progress=false",
            "output.loggers=[jsonl]",
            "output.plot=false",
            "train.steps=6",
            "train.groups_per_step=2",
            "rollout.group_size=4",
            "rollout.micro_batch_groups=1",
            "rollout.max_new_tokens=4",
            "model.warm_start_steps=0",
            *overrides,
        ]
    )


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
