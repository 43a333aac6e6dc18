"""A stage that holds work and makes no progress: a woken holder is harmless, a stall is named.

Local runs (stages as asyncio tasks in the driver) over an embedded TransferQueue; the Ray
versions (a frozen stage host found, named and replaced) are in ``test_ray_stall``, the
watch's judgement alone in ``test_stall_watch``. The drop of a stale batch is in the fast
tier; the runs that wait out a stall are ``slow``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow import EngineFactories, RunConfig, run
from asyncflow.build import build_generator
from engines.protocols import GenerationEngine
from tests.asyncflow.conftest import small_config
from tests.asyncflow.faulty import NeverReturns, StallsOnce, wrapped_generator

LOCAL = ["deploy.mode=local", "transferqueue.mode=embedded"]


def test_a_batch_whose_lease_ran_out_is_dropped_and_the_run_goes_on(
    out_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rollout's third engine call outlasts its lease (4 s over a 1.5 s lease): the
    controller hands the rows out again, and the stale holder's put fails with
    LeaseExpiredError. The rollout drops that batch (one WARNING naming the stage and the
    lease, counted in the step records) and the run completes, every group trained once."""
    cfg = small_config(out_dir, "transferqueue.lease_s=1.5", "train.max_staleness=1", *LOCAL)
    factories = EngineFactories(generator=functools.partial(wrapped_generator, StallsOnce))
    with caplog.at_level(logging.WARNING, logger="asyncflow.stage_runner"):
        result = run(cfg, factories=factories)
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(cfg.train.steps * b))  # every group once, in order
    for rep in result.reports:
        assert rep.samples == b * cfg.rollout.group_size
    drops = [r for r in caplog.records if "dropped a batch" in r.getMessage()]
    assert drops, "the stale batch's drop was not logged"
    assert all(r.levelno == logging.WARNING for r in drops)
    assert "rollout: dropped a batch of" in drops[0].getMessage()
    assert "lease" in drops[0].getMessage()
    counted = sum(
        r["stage_metrics"].get("rollout", {}).get("dropped_batches", 0) for r in result.records
    )
    assert counted == len(drops)
    view = json.loads((out_dir / "progress.json").read_text())  # the watch's live view
    assert set(view["hosts"]) == {"driver", "rollout/instance0"}
    stages = [w["name"] for w in view["hosts"]["driver"]["works"]]
    assert stages == ["rollout", "reward", "train"]


class _StallsLong(StallsOnce):
    stall_s = 5.0


@pytest.mark.slow
def test_an_engine_call_past_its_bound_is_named_once_with_its_stacks(
    out_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rollout's third engine call takes 5 s with ``deploy.stall_timeout_s=3``: one
    WARNING names the engine (the cause: its call holds no lease, so it goes before the
    rollout stage waiting on it, which then gets its bound to move again), the process, the
    call in hand and for how long, with the stack of the stuck call (the engine's sleep among
    them); the run completes (an engine in the driver's process is reported, not replaced)."""
    cfg = small_config(out_dir, "deploy.stall_timeout_s=3", *LOCAL)
    factories = EngineFactories(generator=functools.partial(wrapped_generator, _StallsLong))
    with caplog.at_level(logging.WARNING, logger="asyncflow.stall"):
        result = run(cfg, factories=factories)
    assert len(result.reports) == cfg.train.steps
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert len(stalls) == 1, stalls
    text = stalls[0]
    assert "stage 'instance0' made no progress for" in text
    assert "host 'rollout/instance0'" in text
    assert "bound 3.0 s, deploy.stall_timeout_s" in text
    assert f"pid {os.getpid()}" in text
    assert "instance0: holds 1 unit(s), 4 rows: in generate for" in text
    assert "asyncio.sleep(self.stall_s)" in text  # the stuck call's own stack
    assert "thread 'MainThread'" in text
    assert "not replaced here" in text
    assert [s["host"] for s in result.extra["stalls"]] == ["rollout/instance0"]
    assert result.extra["stalls"][0]["replaced"] is False


@pytest.mark.slow
def test_an_engine_call_that_never_returns_in_the_driver_fails_the_run_with_its_diagnosis(
    out_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rollout's third engine call never returns, the engine in the driver's process
    (``rollout.engine_process=false``: nothing can replace it): the stall is named once, and
    once it lasts five times its bound (the two-minute floor lowered for the test) the run
    fails with a StallError naming the engine, its host and the call it holds, within seconds
    rather than never; progress.json says the run failed and why."""
    monkeypatch.setattr("asyncflow.stall.GIVE_UP_MIN_S", 0.0)
    cfg = small_config(out_dir, "deploy.stall_timeout_s=1", "rollout.engine_process=false", *LOCAL)
    factories = EngineFactories(generator=functools.partial(wrapped_generator, NeverReturns))
    t0 = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="asyncflow.stall"),
        pytest.raises(Exception, match="StallError") as failed,
    ):
        run(cfg, factories=factories)
    took = time.monotonic() - t0
    message = str(failed.value)
    assert "stage 'stall watch' failed" in message
    assert "stage 'instance0' on host 'rollout/instance0'" in message
    assert "instance0: holds 1 unit(s), 4 rows: in generate for" in message
    assert "past 5 s (5 x its stall bound of 1.0 s" in message
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls and "the run fails if it makes no progress for 5 s" in stalls[0]
    assert took < 60.0, took  # (the run's start, a few steps, then 5 s: never unbounded)
    view = json.loads((out_dir / "progress.json").read_text())
    assert view["state"] == "failed" and "StallError" in view["error"]
    print(f"\nan engine call that never returns failed the run after {took:.1f} s")


_BUILT: list[Any] = []


def _kept_generator(cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    """The configured generator, kept in :data:`_BUILT` for the test to find its process
    (started: the run's calls go to its child from the first)."""
    engine = build_generator(cfg, path, index)
    _BUILT.append(engine)
    assert engine.wait_ready(240.0), "the engine process did not start"  # type: ignore[attr-defined]
    return engine


def _freeze_engine(freeze_s: float, seen: dict[str, float], done: threading.Event) -> None:
    """Once the engine runs its calls in its child process, SIGSTOP the child for
    ``freeze_s`` (or until the run ends), then SIGCONT it."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not done.is_set():
        if _BUILT and _BUILT[-1].in_child:
            break
        time.sleep(0.1)
    else:
        return
    time.sleep(1.0)  # (a few steps in the child)
    pid = _BUILT[-1].pid
    os.kill(pid, signal.SIGSTOP)
    seen["pid"], seen["frozen_at"] = pid, time.time()
    done.wait(freeze_s)
    with contextlib.suppress(ProcessLookupError):  # (replaced: killed meanwhile)
        os.kill(pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_frozen_engine_process_is_replaced_and_the_run_goes_on(
    out_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``deploy=local`` with the HF engine in a process of its own, that process frozen
    (SIGSTOP) a second after it took the calls over, for 60 s: the stall is named (the
    engine's host, the child's pid), the engine is replaced by a new process holding the
    weights the old one had, the batch on it is generated again, and the run finishes every
    step, no step 30 s over the median, every group trained once."""
    steps = 40
    cfg = small_config(
        out_dir,
        f"train.steps={steps}",
        "train.max_staleness=1",
        "rollout.engine_process=true",
        "rollout.max_new_tokens=16",
        *LOCAL,
    )
    seen: dict[str, float] = {}
    done = threading.Event()
    _BUILT.clear()
    freezer = threading.Thread(target=_freeze_engine, args=(60.0, seen, done), daemon=True)
    freezer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncflow"):
            result = run(cfg, factories=EngineFactories(generator=_kept_generator))
    finally:
        done.set()
        freezer.join(timeout=30)
    assert "frozen_at" in seen, "the engine process was never frozen"
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(steps * b))
    stalls = [r for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls
    text = stalls[0].getMessage()
    assert "host 'rollout/instance0'" in text and f"pid {int(seen['pid'])}" in text
    assert result.extra["stalls"][0]["replaced"] is True
    warned_s = stalls[0].created - seen["frozen_at"]
    step_s = sorted(r["step_s"] for r in result.records)
    median, worst = step_s[len(step_s) // 2], step_s[-1]
    print(
        f"engine process frozen: named after {warned_s:.1f} s, worst step {worst:.2f} s, "
        f"median {median:.2f} s"
    )
    assert worst <= median + 30.0, [round(s, 2) for s in step_s]
