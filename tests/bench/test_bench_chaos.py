"""``python -m bench.chaos``, short: a 30-step ``deploy=ray`` run with two faults drawn as the
full benchmark draws them (seed 0: trainer rank 0 killed, then a storage unit of two with
``replicas=2``), the benchmark's own invariant checks (every group once, each step its own
window, whole, within the staleness bound) and its results file; marked ``ray`` and ``slow``,
in a subprocess (the benchmark starts and stops a Ray cluster of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import KINDS, TARGETS, plan

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_hits_every_target_before_any_twice() -> None:
    faults = plan(8, 0, list(KINDS), list(TARGETS))
    assert sorted(f.target for f in faults[: len(TARGETS)]) == sorted(TARGETS)
    assert {f.kind for f in faults} <= set(KINDS)
    assert plan(8, 0, list(KINDS), list(TARGETS)) == faults  # seeded


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_short_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.chaos",
            "--steps",
            "30",
            "--faults",
            "2",
            "--freeze-s",
            "12",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "invariants: held" in proc.stdout
    d = json.loads(out.read_text())
    assert d["failed"] == []
    applied = [f for f in d["faults"] if f["start"]]
    assert [(f["kind"], f["target"]) for f in applied] == [
        (f.kind, f.target) for f in plan(2, 0, list(KINDS), list(TARGETS))
    ]
    for f in applied:
        assert f["pid"] > 0 and f["cost_s"] is not None
