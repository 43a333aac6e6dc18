"""Blocking get_meta: wakes when data lands, short at timeout, ends at end of stream."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from transferqueue import Client


def test_get_meta_wakes_when_data_lands(client: Client) -> None:
    result = {}

    def consumer() -> None:
        result["meta"] = client.get_meta("t", ["x"], 4, timeout_s=120)

    th = threading.Thread(target=consumer)
    th.start()
    time.sleep(0.2)
    client.put({"x": torch.arange(2)}, group=0)
    time.sleep(0.1)
    assert th.is_alive()  # 2 of 4 rows: still waiting
    client.put({"x": torch.arange(2)}, group=1)
    th.join(60)  # woke on the put: long before its 120 s timeout
    assert not th.is_alive()
    assert len(result["meta"]) == 4 and result["meta"].reason == "full"


def test_timeout_returns_short_batch_with_reason(client: Client) -> None:
    client.put({"x": torch.arange(3)}, group=0)
    t0 = time.monotonic()
    meta = client.get_meta("t", ["x"], 10, timeout_s=0.3)
    assert 0.25 < time.monotonic() - t0 < 60  # waited its timeout (the bound: not forever)
    assert len(meta) == 3 and meta.reason == "timeout"
    empty = client.get_meta("t", ["x"], 10, timeout_s=0.05)
    assert len(empty) == 0 and empty.reason == "timeout"


def test_end_of_stream_returns_short_batch_then_empty_end(client: Client) -> None:
    client.put({"x": torch.arange(5)}, group=np.arange(5))
    first = client.get_meta("t", ["x"], 4, timeout_s=1)
    assert first.reason == "full"
    client.finish()
    # the last row comes at once, not at the (60 s) timeout: the reason says which;
    # not "end" while `first` is leased (its rows may come back)
    last = client.get_meta("t", ["x"], 4, timeout_s=60)
    assert len(last) == 1 and last.reason == "drain"
    client.ack(first)
    client.ack(last)
    done = client.get_meta("t", ["x"], 4, timeout_s=60)
    assert len(done) == 0 and done.reason == "end"


def test_waiter_gets_end_only_after_other_consumer_acks(client: Client) -> None:
    client.put({"x": torch.arange(2)}, group=0)
    client.finish()
    held = client.get_meta("t", ["x"], 2, timeout_s=1)
    assert held.reason == "end"
    out = {}

    def other() -> None:
        out["meta"] = client.get_meta("t", ["x"], 2, timeout_s=10)

    th = threading.Thread(target=other)
    th.start()
    time.sleep(0.2)
    assert th.is_alive()  # the held rows may still come back: keep waiting
    client.ack(held)
    th.join(60)
    assert not th.is_alive() and len(out["meta"]) == 0 and out["meta"].reason == "end"


def test_stream_iterates_until_end_and_acks(client: Client) -> None:
    client.put({"x": torch.arange(10)}, group=np.arange(10))
    client.finish()
    seen = []
    for meta, cols in client.stream("t", ["x"], 3, timeout_s=5):
        x = cols["x"]
        assert isinstance(x, torch.Tensor)
        seen += x.tolist()
        assert len(meta) <= 3
    assert sorted(seen) == list(range(10))
    stats = client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
    assert stats["done"] == 10 and stats["leased"] == 0
