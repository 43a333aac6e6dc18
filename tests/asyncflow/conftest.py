"""Small, fast run configs on the real tiny model (built once, cached), in either deployment."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import transferqueue
from asyncflow import RunConfig, load_config

RAY_TEST_TIMEOUT_S = 1200
"""Per-test limit of the workflow tests on Ray: they start a dozen actors that each import
torch, minutes on a loaded 2-core machine (the suite's default limit is 300 s)."""

RAY_START = f"deploy.start_timeout_s={RAY_TEST_TIMEOUT_S // 2}"
"""The stage hosts' start-up bound in the Ray workflow tests: a run whose actors have not
started by then is a failure, well inside the test's limit. Seven actors importing torch and
transformers took over 300 s at a load of 9 on 2 cores."""

DEPLOYS = [
    "local",
    pytest.param("local-service", marks=pytest.mark.service),
    pytest.param(
        "ray",
        marks=[pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(RAY_TEST_TIMEOUT_S)],
    ),
]
"""Workflow deployments the invariant tests run under: stages in this process over an
embedded TransferQueue (``local``) or over a TransferQueue service in processes of its own
(``local-service``: every column crosses ZeroMQ or shared memory), and every stage a Ray actor
over TransferQueue on Ray (``ray``: a local Ray cluster)."""


def deploys_by_k(ray_ks: tuple[int, ...], ks: tuple[int, ...] = (0, 1, 2)) -> list[Any]:
    """``(deploy, k)`` parameters for ``parametrize(("deploy", "k"), ..., indirect=["deploy"])``:
    every ``k`` of ``ks`` in the in-process deployments, only ``ray_ks`` on Ray. A Ray run
    costs half a minute of actor start-up on the 2-core machine; where a combined Ray test
    already checks the bound for every ``k`` (the multi-turn episodes with partial rollouts:
    ``tests/asyncflow/test_episode_workflow.py``), the others need not repeat all three."""
    by_deploy = {p.values[0] if hasattr(p, "values") else p: p for p in DEPLOYS}
    params: list[Any] = []
    for name, param in by_deploy.items():
        marks = list(getattr(param, "marks", ()))
        for k in ray_ks if name == "ray" else ks:
            params.append(pytest.param(name, k, marks=marks, id=f"{name}-{k}"))
    return params


def until_holding(out: Path, host: str, deadline_s: float = 60.0) -> bool:
    """Wait until the run's ``progress.json`` (the stall watch's view, rewritten every second)
    shows ``host`` holding a leased unit of work: a fault test that kills or freezes it then
    finds it holding rows."""
    live = out / "progress.json"
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError):
            works = json.loads(live.read_text())["hosts"][host]["works"]
            if any(u["lease"] is not None for w in works for u in w["holding"]):
                return True
        time.sleep(0.1)
    return False


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


@pytest.fixture(scope="session")
def workflow_service() -> Iterator[str]:
    """One TransferQueue service (controller and two units in processes of their own) for the
    session's workflow runs: starting one per run costs seconds of imports."""
    with transferqueue.serve(num_units=2) as svc:
        yield svc.address


@pytest.fixture(params=DEPLOYS)
def deploy(request: pytest.FixtureRequest) -> list[str]:
    """Config overrides of the test's deployment (``ray``: two generators, two reward workers
    and a data-parallel trainer of two ranks, on the session's Ray cluster)."""
    if request.param == "local":
        return ["deploy.mode=local", "transferqueue.mode=embedded"]
    if request.param == "local-service":
        address = request.getfixturevalue("workflow_service")
        with transferqueue.connect(address) as tq:
            tq.reset()  # nothing of an earlier run stays: partitions, tasks, leases
        return [
            "deploy.mode=local",
            "transferqueue.mode=connect",
            f"transferqueue.address={address}",
        ]
    request.getfixturevalue("ray_cluster")
    return [
        "deploy.mode=ray",
        "rollout.instances=2",
        "reward.instances=2",
        "train.dp_size=2",
        RAY_START,
    ]
