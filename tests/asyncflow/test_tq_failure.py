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
    """Rows lost while they sat queued (no call of any stage touches them again): the watch
    raises once the controller reports them, naming the training partition's count only."""
    import asyncio

    import torch

    from asyncflow.workflow import LOST_ROWS_POLL_S, _watch_lost_rows

    bound_s = transferqueue.Liveness().bound_s + LOST_ROWS_POLL_S + 30  # loaded machine slack
    with (
        transferqueue.serve(num_units=2, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        train = c.put({"x": torch.arange(10).view(10, 1)}, partition="train")
        c.put({"x": torch.arange(6).view(6, 1)}, partition="eval")
        on_dead = int((train.units == 1).sum())
        assert 0 < on_dead < 10  # spread over both units

        async def go() -> None:
            client = tq.async_client()
            os.kill(svc.pids[1], signal.SIGKILL)
            expected = rf"{on_dead} rows of partition 'train' lost.*--resume"
            with pytest.raises(RuntimeError, match=expected):
                async with asyncio.timeout(bound_s):
                    await _watch_lost_rows(client, "train")

        asyncio.run(go())
