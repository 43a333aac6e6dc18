"""A TransferQueue storage unit dies under a running workflow: the rows it held can never
reach training whole, so the run must end with an error that says so and names the fix,
never wait forever for groups that lost a row. (A stage whose call meets the dead unit fails
first, as a rule; the driver's watch of ``rows_lost`` covers the rows no call touches again.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

import transferqueue
from asyncflow import StageError, run
from tests.asyncflow.conftest import small_config

pytestmark = pytest.mark.service


def _kill_after_first_step(out: Path, pid: int, killed: list[int]) -> None:
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.1)


def test_rows_lost_with_a_unit_end_the_run_with_an_error_naming_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with transferqueue.serve(num_units=2, spread_bytes=0) as svc:  # every put on both units
        cfg = small_config(
            out,
            "deploy.mode=local",
            "transferqueue.mode=connect",
            f"transferqueue.address={svc.address}",
            "train.steps=400",  # far more than run before the kill is noticed
        )
        killed: list[int] = []
        killer = threading.Thread(
            target=_kill_after_first_step, args=(out, svc.pids[1], killed), daemon=True
        )
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(StageError, match="a TransferQueue server died") as e:
            run(cfg)
        killer.join(timeout=10)
        assert killed, "the run ended before a step was recorded"
        assert "--resume" in str(e.value)
        assert time.monotonic() - t0 < 240  # ended, did not wait for the lost groups


def test_the_driver_watch_ends_the_run_once_training_rows_are_lost() -> None:
    """Rows lost while they sat queued (no later call of any stage touches them): the watch
    raises at its next look; other partitions' losses are not the training run's."""
    from asyncflow.workflow import LOST_ROWS_POLL_S, _watch_lost_rows
    from tests.virtual_time import run_virtual

    class _Stats:
        def __init__(self) -> None:
            self.calls = 0

        async def stats(self) -> dict[str, object]:
            self.calls += 1
            lost = 0 if self.calls < 3 else 8
            parts = {"train": {"rows_lost": lost}, "eval": {"rows_lost": 5}}
            return {"controller": {"partitions": parts}}

    async def go() -> float:
        import asyncio

        client = _Stats()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(RuntimeError, match=r"8 rows of partition 'train' lost.*--resume"):
            await _watch_lost_rows(client, "train")  # type: ignore[arg-type]
        assert client.calls == 3
        return asyncio.get_running_loop().time() - t0

    assert run_virtual(go()) == 3 * LOST_ROWS_POLL_S
