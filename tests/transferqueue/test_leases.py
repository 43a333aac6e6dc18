"""Leases: unacknowledged rows come back; late, unknown and partial acks are typed."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from transferqueue import Client, LeaseExpiredError, UnknownLeaseError


def _put(client: Client, n: int) -> None:
    client.put({"x": torch.arange(n)}, group=np.arange(n))


def test_unacked_lease_is_redelivered_after_deadline(client: Client) -> None:
    _put(client, 8)
    first = client.get_meta("t", ["x"], 8, lease_s=0.3, timeout_s=1)
    assert len(first) == 8
    # nothing else to hand out while the lease is held
    assert len(client.get_meta("t", ["x"], 8, timeout_s=0.1)) == 0
    t0 = time.monotonic()
    again = client.get_meta("t", ["x"], 8, timeout_s=3)
    waited = time.monotonic() - t0
    assert sorted(again.indexes.tolist()) == sorted(first.indexes.tolist())
    assert 0.1 < waited < 2.0
    with pytest.raises(LeaseExpiredError, match="lease_s"):
        client.ack(first)
    client.ack(again)
    stats = client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
    assert stats["done"] == 8 and stats["leased"] == 0


def test_end_of_stream_batch_comes_back_when_its_lease_runs_out(client: Client) -> None:
    # The last batch of a finished stream carries the end mark; a consumer that walks away
    # from it has not ended the stream: the rows go to the next consumer that asks.
    _put(client, 3)
    client.finish("default")
    last = client.get_meta("t", ["x"], 8, lease_s=0.2, timeout_s=1)
    assert len(last) == 3 and last.is_end
    again = client.get_meta("t", ["x"], 8, timeout_s=3)
    assert sorted(again.indexes.tolist()) == sorted(last.indexes.tolist()) and again.is_end
    client.ack(again)
    over = client.get_meta("t", ["x"], 8, timeout_s=1)
    assert len(over) == 0 and over.is_end


def test_put_with_expired_lease_writes_nothing(client: Client) -> None:
    _put(client, 2)
    meta = client.get_meta("t", ["x"], 2, lease_s=0.05, timeout_s=1)
    time.sleep(0.2)
    with pytest.raises(LeaseExpiredError):
        client.put({"y": torch.ones(2)}, meta=meta)
    # the field was never committed: no consumer of "y" sees these rows
    assert len(client.get_meta("u", ["y"], 2, timeout_s=0.1)) == 0


def test_unknown_lease_is_typed(client: Client) -> None:
    _put(client, 2)
    meta = client.get_meta("t", ["x"], 2, timeout_s=1)
    meta.lease_id = 999_999
    with pytest.raises(UnknownLeaseError, match="never issued"):
        client.ack(meta)


def test_ack_is_idempotent_and_release_redelivers_at_once(client: Client) -> None:
    _put(client, 4)
    meta = client.get_meta("t", ["x"], 4, timeout_s=1)
    client.release(meta)
    again = client.get_meta("t", ["x"], 4, timeout_s=0.5)
    assert sorted(again.indexes.tolist()) == sorted(meta.indexes.tolist())
    client.ack(again)
    client.ack(again)  # no-op
    assert len(client.get_meta("t", ["x"], 4, timeout_s=0.05)) == 0


def test_partial_ack_of_a_split_batch(client: Client) -> None:
    client.put({"x": torch.arange(6)}, group=np.arange(6), length=[1, 9, 2, 8, 3, 7])
    meta = client.get_meta("t", ["x"], 6, timeout_s=1, lease_s=0.3)
    left, right = meta.split(2)
    client.ack(left)
    with pytest.raises(UnknownLeaseError, match="not held"):
        client.ack(left.select([0]).__class__(**{**left.__dict__, "acked": False}))
    # the unacked half comes back after the deadline, the acked half never does
    back = client.get_meta("t", ["x"], 6, timeout_s=2)
    assert sorted(back.indexes.tolist()) == sorted(right.indexes.tolist())


def test_put_with_lease_renews_then_acks(client: Client) -> None:
    _put(client, 3)
    meta = client.get_meta("t", ["x"], 3, lease_s=0.4, timeout_s=1)
    time.sleep(0.25)
    client.put({"y": torch.zeros(3)}, meta=meta)  # renews (deadline moves) and acks
    assert meta.acked
    time.sleep(0.3)
    assert len(client.get_meta("t", ["x"], 3, timeout_s=0.1)) == 0
    assert len(client.get_meta("u", ["y"], 3, timeout_s=1)) == 3
