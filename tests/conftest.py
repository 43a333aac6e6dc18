"""Fixtures shared by every test package: one local Ray cluster per pytest session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RAY_CPUS = 8
"""Logical CPU slots of the test cluster: enough for a distributed workflow's actors (2
generators, 2 reward workers, 2 trainer ranks); Ray does not check them against the cores."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """Starts a local Ray cluster once (skips without the ray extra). Its workers import the
    repository's ``tests`` package too, so that engines defined in test modules reach actors."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        ray.init(
            address="local",  # a cluster of its own, never one another process started here
            num_cpus=RAY_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            # no idle workers started ahead for the logical slots: on 2 cores they only cost
            # start-up CPU (actors get their own workers anyway)
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
    yield
    if started:
        ray.shutdown()
