"""bench.ab's verdict: the best round of each side, the medians beside it."""

from __future__ import annotations

import math

from bench.ab import _flatten, compare


def test_the_verdict_is_the_best_round_of_each_side() -> None:
    # One slow round on "this" (the host took the core) moves the median, not the verdict.
    other = [100.0, 98.0, 101.0]
    this = [60.0, 99.0, 102.0]
    best, median = compare(other, this)
    assert best == 102.0 / 101.0
    assert median == 99.0 / 100.0
    # A real regression shows in both.
    best, median = compare(other, [80.0, 82.0, 81.0])
    assert best < 0.85 and median < 0.85


def test_a_zero_baseline_is_not_a_ratio() -> None:
    best, median = compare([0.0, 0.0], [1.0, 2.0])
    assert math.isnan(best) and math.isnan(median)


def test_results_flatten_to_named_numbers() -> None:
    flat = _flatten({"GBps": {"raw zmq": {"dense": 1.5}}, "ok": True, "n": 3, "name": "x"})
    assert flat == {"GBps/raw zmq/dense": 1.5, "n": 3.0}
