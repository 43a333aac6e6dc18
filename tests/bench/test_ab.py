"""bench.ab's verdict: the geometric mean of paired rounds, with its confidence interval."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import bench.common
from bench import ab
from bench.ab import _flatten, compare


def test_the_verdict_pairs_rounds_and_cancels_drift() -> None:
    # The machine slows down round after round; "this" is 5% faster in every round. The best
    # and the median of each side mix the drift in; the paired ratio does not.
    other = [100.0, 90.0, 80.0, 70.0]
    this = [105.0, 94.5, 84.0, 73.5]
    c = compare(other, this)
    assert c.ratio == pytest.approx(1.05)
    assert c.low == pytest.approx(1.05) and c.high == pytest.approx(1.05)  # no spread
    assert c.best_ratio == pytest.approx(1.05)
    assert c.median_ratio == pytest.approx(89.25 / 85.0)


def test_the_interval_shows_when_the_rounds_cannot_tell() -> None:
    noisy = compare([100.0, 100.0, 100.0], [80.0, 120.0, 100.0])
    assert noisy.low < 1.0 < noisy.high  # not shown to differ
    slower = compare([100.0, 101.0, 99.0, 100.0], [80.0, 82.0, 79.0, 81.0])
    assert slower.high < 0.85  # a real regression is outside any doubt
    one = compare([100.0], [90.0])
    assert one.ratio == pytest.approx(0.9) and math.isnan(one.low)


def test_bad_rounds_are_refused_or_not_a_ratio() -> None:
    with pytest.raises(ValueError, match="same number of rounds"):
        compare([1.0, 2.0], [1.0])
    assert math.isnan(compare([0.0, 1.0], [1.0, 2.0]).ratio)


def test_results_flatten_to_named_numbers() -> None:
    flat = _flatten({"GBps": {"raw zmq": {"dense": 1.5}}, "ok": True, "n": 3, "name": "x"})
    assert flat == {"GBps/raw zmq/dense": 1.5, "n": 3.0}


def test_pooled_rounds_give_the_verdict_without_the_baselines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rounds 0 --add``: the verdict from earlier rounds; the benchmark's own baseline
    (the same code on both sides) is the noise floor, never the slowest case."""
    rounds = {
        "other": [{"GBps/raw zmq/dense": 2.0, "GBps/tq/dense": 1.0}] * 3,
        "this": [{"GBps/raw zmq/dense": 1.6, "GBps/tq/dense": 0.97}] * 3,
    }
    earlier = tmp_path / "ab-throughput.json"
    earlier.write_text(json.dumps({"module": "bench.throughput", "runs": rounds}))
    monkeypatch.setattr(bench.common, "RESULTS_DIR", tmp_path / "out")
    argv = ["bench.ab", str(tmp_path), "--rounds", "0", "--add", str(earlier)]
    monkeypatch.setattr(sys, "argv", argv)
    assert ab.main() == 0
    out = json.loads((tmp_path / "out" / "ab-throughput.json").read_text())
    assert out["rounds"] == 3
    assert out["worst"] == {"case": "GBps/tq/dense", "ratio": pytest.approx(0.97)}
    assert out["baseline_ratios"] == [pytest.approx(0.8), pytest.approx(0.8)]
    assert "slowest case: GBps/tq/dense" in capsys.readouterr().out
    # rounds of another benchmark are refused, naming both
    monkeypatch.setattr(sys, "argv", [*argv[:-1], str(earlier), "--module", "bench.controller"])
    with pytest.raises(SystemExit, match=r"'bench\.throughput', not of 'bench\.controller'"):
        ab.main()
