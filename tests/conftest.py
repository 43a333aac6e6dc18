"""Fixtures and hooks shared by every test package.

**Optional extras** gate tests by marker, in one place.

A test marked ``vllm`` or ``smollm2`` needs that extra (see the README's "vLLM and SmolLM2"
section). Where the extra is absent the test is skipped, so the plain test command passes
without it; where ``ASYNCFLOW_TEST_REQUIRE`` names the extra (comma-separated, e.g.
``vllm,smollm2``, as CI sets it for its extras step) the test fails instead, and so does any
other skip of a test carrying a required marker: CI cannot pass with them silently skipped.

Test modules therefore import neither optional package at module level and carry no
``importorskip``: tests that need no extra run everywhere.

**Ray**: one local cluster per pytest session (:func:`ray_cluster`).

**Parallel runs**: the README's test command runs the suite in two pytest-xdist workers
(``-n 2 --dist loadgroup``). Every test that uses Ray goes to one xdist group
(:func:`pytest_collection_modifyitems`), so one worker runs all of them, one after another, on
its session's cluster, while the other runs the rest: never two Ray clusters at once. A test
that observes anything machine-wide (``/dev/shm``, ports) must count only what it made itself.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]  # tests/test_extras_gate.py runs this file's hooks on a sample

REQUIRE_ENV = "ASYNCFLOW_TEST_REQUIRE"
EXTRAS = ("vllm", "smollm2")


@functools.cache
def _absent(extra: str) -> str | None:
    """Why ``extra`` cannot be used here (its install hint), or None when it can."""
    if extra == "vllm":
        from engines.vllm_engine import INSTALL_HINT

        return None if importlib.util.find_spec("vllm") is not None else INSTALL_HINT
    from engines import smollm2

    return None if smollm2.is_available() else smollm2.INSTALL_HINT


@functools.cache
def _required() -> frozenset[str]:
    names = {n.strip() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip()}
    unknown = names - set(EXTRAS)
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names unknown extras {sorted(unknown)}; known: {list(EXTRAS)}"
        )
    return frozenset(names)


def pytest_configure(config: pytest.Config) -> None:
    _required()  # a misspelt extra is a usage error before anything runs


def pytest_report_header(config: pytest.Config) -> str | None:
    required = _required()
    return (
        f"{REQUIRE_ENV}: {','.join(sorted(required))} (their tests fail, never skip)"
        if required
        else None
    )


RAY_GROUP = "ray"
"""The xdist group of every test that uses Ray."""

RAY_FIXTURES = frozenset({"ray_cluster", "ray_tq"})


def _uses_ray(item: pytest.Item) -> bool:
    """Marked ``ray``, or asking for a fixture that starts (or needs) the Ray cluster."""
    return item.get_closest_marker("ray") is not None or bool(
        RAY_FIXTURES & set(getattr(item, "fixturenames", ()))
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups off the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _uses_ray(item):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))


UNGROUPED = pytest.StashKey[str]()
"""On a Ray test xdist left out of its group: why it must not run."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker under ``--dist loadgroup``, check that xdist put the Ray tests in
    their group (it appends ``@ray`` to their ids): with pytest 9.2 it silently does not
    (pytest-xdist issue 1386), and two workers would then start Ray clusters side by side.
    Such tests fail at setup, before any fixture starts Ray, saying so (an error raised here
    would only crash the worker, its message lost)."""
    config = session.config
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    suffix = f"@{RAY_GROUP}"
    for item in session.items:
        if _uses_ray(item) and not item.nodeid.endswith(suffix):
            item.stash[UNGROUPED] = (
                f"pytest-xdist did not put this Ray test in its group under --dist loadgroup "
                f"with pytest {pytest.__version__}, so two workers could start Ray clusters "
                "side by side: install the versions pyproject.toml's dev extra names "
                '(pip install -e ".[dev,ray]"), or run without -n'
            )


def _marked(item: pytest.Item) -> list[str]:
    return [extra for extra in EXTRAS if item.get_closest_marker(extra) is not None]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if UNGROUPED in item.stash:
        pytest.fail(item.stash[UNGROUPED], pytrace=False)
    for extra in _marked(item):
        hint = _absent(extra)
        if hint is None:
            continue
        if extra in _required():
            pytest.fail(
                f"the {extra} extra is absent but {REQUIRE_ENV} requires it: {hint}", pytrace=False
            )
        pytest.skip(f"needs the {extra} extra: {hint}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Turn any skip of a test with a required marker into a failure (a skip inside the test
    or a ``skipif`` mark would otherwise hide that it never ran), and an ``xfail`` too when the
    required extra is absent (the xfail mark would otherwise swallow the failed setup)."""
    report = yield
    required = [extra for extra in _marked(item) if extra in _required()]
    if not required or not report.skipped:
        return report
    if hasattr(report, "wasxfail"):
        missing = [extra for extra in required if _absent(extra) is not None]
        if not missing:
            return report
        del report.wasxfail
        reason = f"the {missing} extra is absent"
    else:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
    report.outcome = "failed"
    report.longrepr = f"skipped although {REQUIRE_ENV} requires {required}: {reason}"
    return report


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
            _system_config={
                "enable_worker_prestart": False,
                "prestart_worker_first_driver": False,
                # Ray's default niceness (15) starves the actors whenever the other pytest
                # worker runs anything: the Ray tests took twice their quiet time in CI
                "worker_niceness": 0,
            },
        )
    yield
    if started:
        ray.shutdown()
