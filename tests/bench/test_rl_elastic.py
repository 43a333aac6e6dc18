"""``bench.rl --elastic``'s phases: the elastic run's records split where the rollout's
instances change, each phase's throughput over its steady steps (its first steps, the
change's own cost, and the run's first record left out); a count passed on the way (scaling
goes one instance at a time) has no steady steps."""

from __future__ import annotations

from typing import Any

import pytest

from bench.rl_elastic import SETTLE_STEPS, phases


def _records(counts: list[int], step_s: dict[int, float]) -> list[dict[str, Any]]:
    return [
        {"step": i, "instances": {"rollout": n}, "samples": 64, "step_s": step_s[n]}
        for i, n in enumerate(counts)
    ]


def test_phases_split_where_the_instances_change_and_skip_the_change_itself() -> None:
    counts = [2] * 10 + [3] + [4] * 10 + [2] + [1] * 8
    recs = _records(counts, {1: 4.0, 2: 2.0, 3: 1.5, 4: 1.0})
    recs[11]["step_s"] = recs[12]["step_s"] = 9.0  # (the new generator's start: left out)
    table = phases(recs, time_scale=0.01)
    assert [(p["instances"], p["first_step"], p["last_step"]) for p in table] == [
        (2, 0, 9),
        (3, 10, 10),
        (4, 11, 20),
        (2, 21, 21),
        (1, 22, 29),
    ]
    assert [p["steady_steps"] for p in table] == [9 - SETTLE_STEPS, 0, 10 - SETTLE_STEPS, 0, 6]
    by = {p["instances"]: p for p in table if p["steady_steps"]}
    assert by[4]["samples_per_s"] == pytest.approx(64 / 1.0 * 0.01)
    assert by[1]["samples_per_s"] == pytest.approx(64 / 4.0 * 0.01)
