"""Trackers: W&B (offline) and MLflow (file store) record the very scalars metrics.jsonl holds."""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncflow import run
from asyncflow.loggers import scalars
from asyncflow.metrics import MetricsWriter, Timeline
from tests.asyncflow.conftest import small_config

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of checksummed chunks


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of an offline W&B run, read from its ``run-*.wandb`` log."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B"
    records: list[bytes] = []
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            records.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            records.append(pending + chunk)
    rows = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


@pytest.mark.slow
def test_wandb_and_mlflow_record_the_jsonl_scalars(
    out_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = small_config(
        out_dir,
        "train.steps=3",
        "output.loggers=[jsonl,tensorboard,wandb,mlflow]",
        "output.project=loggers-test",
        "output.run_name=k1",
    )
    run(cfg)
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    expected = {r["step"]: scalars(r) for r in lines}
    assert len(expected) == 3 and all(len(v) > 20 for v in expected.values())
    assert "stages/rollout/busy" in expected[0] and "queue/train/queued" in expected[0]

    [run_file] = (out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    assert [row["_step"] for row in history] == [0, 1, 2]
    for row in history:
        logged = {k: v for k, v in row.items() if not k.startswith("_")}
        assert logged.keys() == expected[row["_step"]].keys()
        for key, value in logged.items():
            assert math.isclose(value, expected[row["_step"]][key], rel_tol=1e-12), key

    client = MlflowClient(tracking_uri=f"sqlite:///{(out_dir / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("loggers-test")
    assert experiment is not None
    [mlrun] = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == "k1" and mlrun.info.status == "FINISHED"
    assert mlrun.data.params["train.steps"] == "3"  # the run's config, as params
    assert set(mlrun.data.metrics) == set().union(*expected.values())
    for key in mlrun.data.metrics:
        points = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, key)}
        want = {step: values[key] for step, values in expected.items() if key in values}
        assert points.keys() == want.keys(), key
        for step, value in want.items():
            assert math.isclose(points[step], value, rel_tol=1e-12, abs_tol=1e-300), key


def test_mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from asyncflow.loggers import MlflowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for the opt-in
    uri = (tmp_path / "mlruns").as_uri()
    records = [
        {"step": s, "reward": 0.25 * s, "stages": {"train": {"busy": 0.5}}} for s in range(3)
    ]
    logger = MlflowLogger(uri, project="p", name="file", config={"train": {"steps": 3}})
    writer = MetricsWriter(tmp_path, total_steps=3, progress=False, loggers=[logger])
    for r in records:
        writer.write(r)
    writer.close()
    client = MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(logger.run_id, "stages/train/busy")
    assert [(m.step, m.value) for m in history] == [(0, 0.5), (1, 0.5), (2, 0.5)]
    rewards = client.get_metric_history(logger.run_id, "reward")
    assert [(m.step, m.value) for m in rewards] == [(0, 0.0), (1, 0.25), (2, 0.5)]


def test_tensorboard_gets_the_same_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncflow.loggers import TensorBoardLogger

    records = [
        {
            "step": s,
            "reward": 0.5 * s,
            "nan": math.nan,
            "flag": True,
            "stages": {"train": {"busy": 0.25}},
        }
        for s in range(3)
    ]
    writer = MetricsWriter(
        tmp_path, total_steps=3, progress=False, loggers=[TensorBoardLogger(tmp_path)]
    )
    for r in records:
        writer.write(r)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"step", "reward", "stages/train/busy"}  # no NaN, bool
    assert [e.value for e in events.Scalars("reward")] == [0.0, 0.5, 1.0]


class _Tracker:
    """A tracker that counts its calls and, if told, fails to close."""

    def __init__(self, fail_close: bool) -> None:
        self.fail_close = fail_close
        self.steps: list[int] = []
        self.closed = False

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True
        if self.fail_close:
            raise RuntimeError("tracker close failed")


def test_every_tracker_is_closed_even_if_one_fails(tmp_path: Path) -> None:
    first, second = _Tracker(fail_close=True), _Tracker(fail_close=False)
    writer = MetricsWriter(tmp_path, total_steps=1, progress=False, loggers=[first, second])
    writer.write({"step": 0, "reward": 1.0})
    with pytest.raises(RuntimeError, match="tracker close failed"):
        writer.close()
    assert first.closed and second.closed and first.steps == second.steps == [0]


def test_chrome_trace_lanes_and_events() -> None:
    timeline = Timeline()
    t0 = timeline.t0
    timeline.record("train", t0 + 1.0, t0 + 1.5, samples=8, tokens=80)
    timeline.record("rollout/1", t0 + 0.5, t0 + 0.75, samples=4, tokens=16)
    timeline.record("rollout/0", t0 + 0.0, t0 + 0.25, samples=4, tokens=12)
    timeline.record("reward", t0 + 0.25, t0 + 0.5, samples=4, tokens=0)
    trace = timeline.to_chrome_trace([{"step": 0, "reward": 0.5, "time_s": 1.5}])
    events = json.loads(json.dumps(trace))["traceEvents"]  # plain JSON, as written
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "rollout", 2: "reward", 3: "train", 4: "train steps"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert threads == {(1, 1): "rollout/0", (1, 2): "rollout/1", (2, 1): "reward", (3, 1): "train"}
    spans = {(e["pid"], e["tid"]): e for e in events if e["ph"] == "X"}
    assert spans[(1, 2)]["ts"] == pytest.approx(0.5e6) and spans[(1, 2)]["dur"] == pytest.approx(
        0.25e6
    )
    assert spans[(3, 1)]["args"] == {"samples": 8, "tokens": 80}
    [counter] = [e for e in events if e["ph"] == "C"]
    assert counter["ts"] == pytest.approx(1.5e6) and counter["args"] == {"reward": 0.5}


class _SlowTracker(_Tracker):
    """A tracker whose ``log`` blocks until released (a hung server), or fails."""

    def __init__(self, fail_log: bool = False) -> None:
        super().__init__(fail_close=False)
        self.release = threading.Event()
        self.fail_log = fail_log

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if self.fail_log:
            raise ValueError(f"tracker refused step {step}")
        assert self.release.wait(10)
        super().log(step, values)


def test_a_slow_tracker_never_holds_the_writer(tmp_path: Path) -> None:
    slow = _SlowTracker()
    writer = MetricsWriter(tmp_path, total_steps=5, progress=False, loggers=[slow])
    t0 = time.perf_counter()
    for step in range(5):
        writer.write({"step": step, "reward": 1.0})
    assert time.perf_counter() - t0 < 2.0  # the tracker is blocked; the writer is not
    assert slow.steps == [] and len(writer.path.read_text().splitlines()) == 5
    slow.release.set()
    writer.close()  # drains the queue in order, then closes
    assert slow.steps == [0, 1, 2, 3, 4] and slow.closed


def test_a_failing_tracker_is_raised_by_the_writer(tmp_path: Path) -> None:
    bad = _SlowTracker(fail_log=True)
    writer = MetricsWriter(tmp_path, total_steps=3, progress=False, loggers=[bad])
    writer.write({"step": 0, "reward": 1.0})
    with pytest.raises(ValueError, match="refused step 0"):
        for step in range(1, 200):  # raised by a later write once the thread has failed
            writer.write({"step": step, "reward": 1.0})
            time.sleep(0.01)
    with pytest.raises(ValueError, match="refused step 0"):
        writer.close()
    assert bad.closed
