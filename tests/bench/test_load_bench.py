"""``python -m bench.load`` end to end at a small size: every client's rows are read exactly
once, through the same code that measures thousands of clients (docs/transferqueue/
performance.md has those figures)."""

from __future__ import annotations

import pytest

from bench import load


@pytest.mark.service
def test_a_small_load_run_reads_every_row_exactly_once() -> None:
    phases = {"paced": (20.0, 1.0), "saturated": (0.0, 1.0)}
    r = load.run_case(8, 2, 4, phases, "local")
    eo = r["exactly_once"]
    assert eo["written"] >= 8 * 4  # (each client's first cycle at least)
    assert eo["twice"] == eo["missing"] == eo["extra"] == 0, eo
    sat = r["phases"]["saturated"]
    assert sat["cycles"] > 0 and sat["starved_clients"] == 0
    assert r["servers"]["controller"]["fds"] > 8  # (every client holds a connection)
