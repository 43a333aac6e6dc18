"""Small, fast run configs on the real tiny model (built once, cached), in either deployment."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow import RunConfig, load_config

DEPLOYS = [
    "local",
    pytest.param("ray", marks=[pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]),
]
"""Workflow deployments the invariant tests run under (``ray``: a local Ray cluster)."""


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


@pytest.fixture(params=DEPLOYS)
def deploy(request: pytest.FixtureRequest) -> list[str]:
    """Config overrides of the test's deployment (``ray``: two generators, two reward workers
    and a data-parallel trainer of two ranks, on the session's Ray cluster)."""
    if request.param == "local":
        return ["deploy.mode=local"]
    request.getfixturevalue("ray_cluster")
    return [
        "deploy.mode=ray",
        "rollout.instances=2",
        "reward.instances=2",
        "train.dp_size=2",
        "deploy.start_timeout_s=300",
    ]
