"""``asyncflow status OUTPUT_DIR``: the table of a run read from its ``progress.json`` and
``metrics.jsonl``, once or ``--watch``ed; against handcrafted files and real local runs."""

from __future__ import annotations

import functools
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow import EngineFactories, run
from asyncflow.cli import main
from asyncflow.status import render, watch
from tests.asyncflow.conftest import small_config
from tests.asyncflow.faulty import StallsOnce, raising_reward_factory, wrapped_generator

LOCAL = ["deploy.mode=local", "transferqueue.mode=embedded"]


def _view(**over: Any) -> dict[str, Any]:
    """A progress.json as the stall watch writes it: a driver whose rollout holds a batch in
    its generate phase, whose train stage waits, and a Ray host frozen and marked stalled."""
    view: dict[str, Any] = {
        "state": "running",
        "error": None,
        "time": time.time(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "period_s": 1.0,
        "total_steps": 60,
        "steps": 12,
        "since_step_s": 4.0,
        "hosts": {
            "driver": {
                "silent_s": 0.0,
                "stalled": False,
                "pid": 4242,
                "node": None,
                "actor": None,
                "works": [
                    {
                        "name": "rollout",
                        "what": "rows of ['prompt_ids'] from task 'rollout'",
                        "done": 40,
                        "median_s": 0.21,
                        "holding": [
                            {
                                "rows": 8,
                                "lease": 17,
                                "held_s": 3.5,
                                "phase": "generate",
                                "phase_s": 3.25,
                            }
                        ],
                        "idle": 0,
                        "idle_s": 0.0,
                    },
                    {
                        "name": "train",
                        "what": "rows of ['reward'] from task 'train'",
                        "done": 12,
                        "median_s": None,
                        "holding": [],
                        "idle": 1,
                        "idle_s": 3.9,
                    },
                ],
            },
            "RolloutActor-0": {"silent_s": 31.0, "stalled": True},
        },
        "stalls": [
            {
                "host": "RolloutActor-0",
                "stage": "rollout",
                "seconds": 31.0,
                "at": 1.0,
                "replaced": True,
                "silent": True,
            }
        ],
    }
    view.update(over)
    return view


def _write(out: Path, view: dict[str, Any], records: int = 2) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "progress.json").write_text(json.dumps(view))
    with (out / "metrics.jsonl").open("w") as f:
        for step in range(records):
            f.write(json.dumps({"step": step, "reward": 0.25 * step, "step_s": 1.5}) + "\n")
        f.write('{"step": 99, "rew')  # a line being written: left out
    return out


def test_the_table_names_each_host_what_it_holds_or_waits_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _write(tmp_path / "run", _view())
    assert main(["status", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith(f"asyncflow status {out}: running: 12 of 60 steps, last step 4.")
    assert lines[1] == "last step 1, reward 0.250, step 1.5 s"  # the last complete record
    assert "stalls so far: 1" in text
    assert "'rollout' on host 'RolloutActor-0': no progress for 31.0 s, silent, replaced" in text
    header = next(line for line in lines if line.startswith("HOST"))
    assert header.split() == ["HOST", "PROCESS", "SILENT", "STAGE", "DONE", "NOW"]
    rollout = next(line for line in lines if line.startswith("driver"))
    assert "pid 4242" in rollout and "40 (0.21 s)" in rollout
    assert "holds 1 unit(s), 8 rows, lease(s) 17; generate for 3.2 s (held 3.5 s)" in rollout
    train = next(line for line in lines if " train " in line)
    assert "waits for rows of ['reward'] from task 'train' for 3.9 s" in train
    frozen = next(line for line in lines if line.startswith("RolloutActor-0"))
    assert "STALLED" in frozen and "never answered" in frozen and "31.0 s" in frozen


def test_a_folder_without_progress_json_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "old").mkdir()
    for folder in (tmp_path / "old", tmp_path / "missing"):
        for extra in ([], ["--watch"]):
            assert main(["status", str(folder), *extra]) == 2
            err = capsys.readouterr().err
            assert err.startswith("asyncflow: no run status: ") and err.count("\n") == 1
    assert main(["status", str(tmp_path / "old")]) == 2
    assert "no progress.json in" in capsys.readouterr().err


def test_watch_stops_when_the_run_says_it_ended(tmp_path: Path) -> None:
    for state, error, code in (("finished", None, 0), ("failed", "StageError: boom", 1)):
        out = _write(tmp_path / state, _view(state=state, error=error))
        sink = io.StringIO()
        assert watch(out, 0.01, 30.0, out=sink) == code
        text = sink.getvalue()
        assert f"asyncflow: the run {state}; stopped watching" in text
        assert text.count("asyncflow status") == 1  # one table, no wait
        if error:
            assert "error: StageError: boom" in text


def test_watch_stops_when_the_file_stops_changing_or_the_driver_is_gone(
    tmp_path: Path,
) -> None:
    out = _write(tmp_path / "frozen", _view())  # this process: alive, but nothing rewrites
    sink = io.StringIO()
    t0 = time.monotonic()
    assert watch(out, 0.05, 0.3, out=sink) == 1
    assert 0.3 <= time.monotonic() - t0 < 5.0
    assert "progress.json has not changed for" in sink.getvalue()
    assert sink.getvalue().count("asyncflow status") >= 3  # refreshed meanwhile
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    out = _write(tmp_path / "gone", _view(pid=gone.pid))
    sink = io.StringIO()
    assert watch(out, 0.05, 30.0, out=sink) == 1
    assert f"the run's driver (pid {gone.pid}) is gone" in sink.getvalue()
    view = json.loads((out / "progress.json").read_text())
    assert "is gone: the run ended without saying so" in render(view, [], out)


def test_a_finished_or_failed_local_run_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real short runs (faster than the watch's first round): the last view is written as the
    run ends, with every stage of the driver and its generator, and a failed run's error."""
    failing = tmp_path / "failing"
    with pytest.raises(Exception, match="reward model exploded"):
        run(small_config(failing, *LOCAL), factories=EngineFactories(reward=raising_reward_factory))
    assert main(["status", str(failing)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"asyncflow status {failing}: failed: 0 of 6 steps")
    assert "error: StageError: " in text and "reward model exploded" in text
    assert "no step recorded yet" in text
    out_dir = tmp_path / "run"
    run(small_config(out_dir, "train.steps=3", *LOCAL))
    assert main(["status", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"asyncflow status {out_dir}: finished: 3 of 3 steps")
    assert "last step 2, reward" in text
    assert "stalls so far: none" in text
    hosts = [line.split()[0] for line in text.splitlines() if line[:1].isalpha()]
    assert "driver" in hosts and "rollout/instance0" in hosts
    for stage in ("rollout", "reward", "train"):
        assert f" {stage} " in text


class _StallsLong(StallsOnce):
    stall_s = 4.0


@pytest.mark.slow
def test_watch_follows_a_running_run_to_its_end(out_dir: Path) -> None:
    """``--watch`` on a real local run whose third engine call takes 4 s: a table shows the
    run running with the engine holding its call in ``generate``, and the watch ends by itself
    with the run (exit 0)."""
    cfg = small_config(out_dir, "train.steps=8", *LOCAL)
    factories = EngineFactories(generator=functools.partial(wrapped_generator, _StallsLong))
    outcome: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: outcome.update(r=run(cfg, factories=factories)))
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while not (out_dir / "progress.json").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sink = io.StringIO()
        code = watch(out_dir, 0.25, 60.0, out=sink)
    finally:
        runner.join(timeout=120)
    assert len(outcome["r"].reports) == 8
    assert code == 0
    tables = sink.getvalue().split("asyncflow status ")[1:]
    running = [t for t in tables if ": running: " in t]
    assert running, sink.getvalue()[:2000]
    held = [t for t in running if "holds 1 unit(s), 4 rows; generate for" in t]
    assert held, running[-1]  # the engine's call in hand, seen while it lasts
    assert ": finished: 8 of 8 steps" in tables[-1]
    assert "the run finished; stopped watching" in sink.getvalue()
