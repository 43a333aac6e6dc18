"""bench.load's clients against the peer: ``run_peer_case`` starts the real peer (PyPI
``transferqueue`` in ``bench/.peer-venv``), runs a few clients on shared and own partitions,
and returns ``bench.load``'s figures with every row read exactly once."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.load_peer_run as lpr
from bench.load_peer_run import PeerLoadError, peer_available, run_peer_case


def test_a_missing_peer_virtualenv_is_an_error_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lpr, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(lpr, "PEER_PYTHON", tmp_path / ".peer-venv" / "bin" / "python")
    with pytest.raises(PeerLoadError, match=r"python -m bench\.peer --setup"):
        run_peer_case(2, 1, 4, {"saturated": (0.0, 1.0)})


@pytest.mark.slow  # starts Ray and the peer in its own virtualenv (~40 s)
@pytest.mark.skipif(
    not peer_available(),
    reason="the peer's virtualenv is absent: build it with `python -m bench.peer --setup`",
)
def test_the_peer_serves_load_clients_and_reads_each_row_exactly_once() -> None:
    r = run_peer_case(6, 2, 4, {"paced": (2.0, 2.0), "saturated": (0.0, 2.0)})
    assert "error" not in r, r
    assert (r["deploy"], r["clients"], r["procs"]) == ("peer", 6, 2)
    paced, sat = r["phases"]["paced"], r["phases"]["saturated"]
    # paced: 6 clients x 2 cycles/s x 2 s, give or take the window's edges
    assert 12 <= paced["cycles"] <= 30
    assert sat["cycles"] > paced["cycles"] and sat["starved_clients"] == 0
    assert sat["window_s"] == 2.0 and sat["elapsed_s"] >= 2.0
    assert sat["rows_per_s"] == pytest.approx(sat["cycles"] * 4 / sat["elapsed_s"])
    for call in ("put", "get_meta", "get_data", "ack"):
        assert 0 < sat["latency_ms"][call]["p50"] <= sat["latency_ms"][call]["p99"]
    once = r["exactly_once"]
    assert once["written"] == (paced["cycles"] + sat["cycles"]) * 4
    assert once["twice"] == once["missing"] == once["extra"] == 0
