"""The bare ZeroMQ round trip (bench/bare.py) and how bench.peer reports our get_meta
against it."""

from __future__ import annotations

import argparse

import pytest

from bench.bare import BareRoundTrip
from bench.peer import WIRE_GOAL, summarize


def test_the_bare_round_trip_answers_with_the_batch_asked() -> None:
    bare = BareRoundTrip()
    try:
        assert bare.call(64).tolist() == list(range(8, 72))  # (lease 1: from 8 on)
        assert len(bare.call(5)) == 5
        per_call = bare.seconds_per_call(64, 0.2)
        assert 0 < per_call < 0.05
    finally:
        bare.close()
    assert not bare.proc.is_alive()


def _meta(samples_per_s: float) -> dict[str, float]:
    return {"samples_per_s": samples_per_s, "samples_per_s_whole": samples_per_s / 2}


def test_peer_summary_divides_our_get_meta_at_the_fewest_rows_by_the_bare_round_trip() -> None:
    args = argparse.Namespace(meta_batch=64)
    raw = {
        "1": {
            "describe": {"ours": {"nbytes": {}}},
            "cycles": {},
            "meta": {
                "1000": {"ours": [_meta(64 / 200e-6), _meta(64 / 250e-6)], "peer": [_meta(6e4)]},
                "100000": {"ours": [_meta(64 / 900e-6)], "peer": [_meta(2e3)]},
            },
            "bare_s": [100e-6, 110e-6, 120e-6],
        }
    }
    wire = summarize(raw, args)["wire"]["1u"]
    assert wire["live"] == 1000
    assert wire["bare_us"] == pytest.approx(110)
    assert wire["ours_us"] == pytest.approx(225)  # (the median of ours at 1k rows)
    assert wire["ratio"] == pytest.approx(225 / 110)
    assert wire["ratio"] > WIRE_GOAL
