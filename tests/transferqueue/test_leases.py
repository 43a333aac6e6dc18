"""Leases: unacknowledged rows come back; late, unknown and partial acks are typed.

The deadline arithmetic is tested on the controller with a clock the test sets (exact, no
waiting). The tests through a client, in every deployment, run on real time: a lease that must
hold while the test acts on it lasts ``HOLD_S`` (far longer than any step of the test takes on a
loaded machine), a wait for rows to come back ends on their return (``WAIT_S`` is only a
bound), and what is asserted about time is order (the rows came back no sooner than their
deadline), never how long anything took.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import transferqueue
from transferqueue import BatchMeta, Client, LeaseExpiredError, UnknownLeaseError
from transferqueue.client.holder import FRESH_LEASE_S
from transferqueue.controller.core import Controller
from transferqueue.schema import FieldSpec

HOLD_S = 2.0
"""A lease the test relies on still holding while it acts on its rows."""
SHORT_S = 0.2
"""A lease the test waits out."""
WAIT_S = 60.0
"""Bound of a wait that ends on an event (rows coming back), long before this."""


def _put(client: Client, n: int) -> None:
    client.put({"x": torch.arange(n)}, group=np.arange(n))


def test_unacked_lease_is_redelivered_after_deadline(client: Client) -> None:
    _put(client, 8)
    t0 = time.monotonic()  # before the lease is granted: its deadline is after t0 + SHORT_S
    first = client.get_meta("t", ["x"], 8, lease_s=SHORT_S, timeout_s=WAIT_S)
    assert len(first) == 8
    again = client.get_meta("t", ["x"], 8, timeout_s=WAIT_S)  # blocks until they come back
    assert time.monotonic() - t0 >= SHORT_S  # never before the deadline
    assert sorted(again.indexes.tolist()) == sorted(first.indexes.tolist())
    assert again.reason == "full"
    with pytest.raises(LeaseExpiredError, match="lease_s"):
        client.ack(first)
    client.ack(again)
    stats = client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
    assert stats["done"] == 8 and stats["leased"] == 0


def test_leased_rows_go_to_nobody_else_while_the_lease_holds(client: Client) -> None:
    _put(client, 8)
    first = client.get_meta("t", ["x"], 8, lease_s=HOLD_S, timeout_s=WAIT_S)
    assert len(first) == 8
    assert len(client.get_meta("t", ["x"], 8, timeout_s=0)) == 0
    client.ack(first)  # still within the lease: accepted
    assert len(client.get_meta("t", ["x"], 8, timeout_s=0)) == 0


def test_end_of_stream_batch_comes_back_when_its_lease_runs_out(client: Client) -> None:
    # The last batch of a finished stream carries the end mark; a consumer that walks away
    # from it has not ended the stream: the rows go to the next consumer that asks.
    _put(client, 3)
    client.finish("default")
    last = client.get_meta("t", ["x"], 8, lease_s=SHORT_S, timeout_s=WAIT_S)
    assert len(last) == 3 and last.is_end
    again = client.get_meta("t", ["x"], 8, timeout_s=WAIT_S)
    assert sorted(again.indexes.tolist()) == sorted(last.indexes.tolist()) and again.is_end
    client.ack(again)
    over = client.get_meta("t", ["x"], 8, timeout_s=1)
    assert len(over) == 0 and over.is_end


def test_put_with_expired_lease_writes_nothing(client: Client) -> None:
    _put(client, 2)
    meta = client.get_meta("t", ["x"], 2, lease_s=0.05, timeout_s=WAIT_S)
    time.sleep(0.2)  # the deadline (granted before the reply came) has passed
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
    meta = client.get_meta("t", ["x"], 6, timeout_s=WAIT_S, lease_s=HOLD_S)
    left, right = meta.split(2)
    client.ack(left)
    with pytest.raises(UnknownLeaseError, match="not held"):
        client.ack(left.select([0]).__class__(**{**left.__dict__, "acked": False}))
    # the unacked half comes back after the deadline, the acked half never does
    back = client.get_meta("t", ["x"], len(right), timeout_s=WAIT_S)
    assert sorted(back.indexes.tolist()) == sorted(right.indexes.tolist())
    assert len(client.get_meta("t", ["x"], 6, timeout_s=0)) == 0


def test_put_with_lease_renews_then_acks(client: Client) -> None:
    _put(client, 3)
    t0 = time.monotonic()
    meta = client.get_meta("t", ["x"], 3, lease_s=HOLD_S, timeout_s=WAIT_S)
    client.put({"y": torch.zeros(3)}, meta=meta, ack=False, lease_s=WAIT_S)  # renews only
    assert not meta.acked
    time.sleep(max(0.0, t0 + HOLD_S + 0.1 - time.monotonic()))  # past the first deadline
    assert len(client.get_meta("t", ["x"], 3, timeout_s=0)) == 0  # renewed: still held
    client.put({"z": torch.zeros(3)}, meta=meta)  # renews and acks
    assert meta.acked
    assert len(client.get_meta("t", ["x"], 3, timeout_s=0)) == 0
    assert len(client.get_meta("u", ["y", "z"], 3, timeout_s=WAIT_S)) == 3


# -- the deadline arithmetic, on the controller's clock ---------------------------------------
class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _controller(clock: _Clock, rows: int = 8) -> Controller:
    ctl = Controller(1, clock=clock)
    ctl.rows.register_fields({"x": FieldSpec.dense("int64")}, "p")
    meta = ctl.writes.allocate(rows, "p", groups=np.arange(rows))
    ctl.writes.commit(meta.indexes, ["x"])
    return ctl


def _take(ctl: Controller, lease_s: float = 10.0) -> list[int]:
    """The sorted indexes task ``t`` gets now, then the lease id (``[0]``: nothing)."""
    meta, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=8, lease_s=lease_s, short_ok=True
    )
    assert meta is not None
    return [*sorted(meta.indexes.tolist()), meta.lease_id or 0]


def test_a_lease_holds_until_its_deadline_and_not_a_moment_longer() -> None:
    clock = _Clock()
    ctl = _controller(clock)
    *rows, lease = _take(ctl, lease_s=10.0)
    assert rows == list(range(8))
    clock.now = 109.999
    ctl.queues.expire()
    assert _take(ctl) == [0]  # held: nothing for anyone
    assert ctl.queues.next_deadline() == 110.0
    clock.now = 110.0
    ctl.queues.expire()
    *again, _ = _take(ctl)
    assert again == rows  # back at the deadline
    with pytest.raises(LeaseExpiredError, match="handed out again"):
        ctl.queues.ack(lease)


def test_renew_moves_the_deadline_from_now() -> None:
    clock = _Clock()
    ctl = _controller(clock)
    *_, lease = _take(ctl, lease_s=10.0)
    clock.now = 108.0
    ctl.queues.renew(lease, 10.0)  # deadline 118, not 110 + 10
    assert ctl.queues.next_deadline() == 118.0
    clock.now = 117.0
    ctl.queues.expire()
    assert _take(ctl) == [0]
    ctl.queues.ack(lease)  # accepted: the lease holds
    clock.now = 1000.0
    ctl.queues.expire()
    assert _take(ctl) == [0]  # acknowledged rows never come back


def test_an_expired_lease_cannot_be_renewed_or_acked() -> None:
    clock = _Clock()
    ctl = _controller(clock)
    *_, lease = _take(ctl, lease_s=10.0)
    clock.now = 110.0  # past the deadline, before the timer returned the rows
    with pytest.raises(LeaseExpiredError, match="lease_s"):
        ctl.queues.renew(lease, 10.0)
    with pytest.raises(LeaseExpiredError):
        ctl.queues.ack(lease)


def test_consume_acks_a_full_batch_as_it_is_handed_out(client: Client) -> None:
    """``consume=True``: a full batch comes back acknowledged (never handed out again, even
    after its lease would have run out); a short one stays leased, to release."""
    _put(client, 5)
    full = client.get_meta(
        task="t", fields=["x"], batch_size=3, timeout_s=5.0, lease_s=0.2, consume=True
    )
    assert len(full) == 3 and full.acked
    client.ack(full)  # (acks are idempotent: nothing to send)
    short = client.get_meta(task="t", fields=["x"], batch_size=3, timeout_s=0.0, consume=True)
    assert len(short) == 2 and not short.acked
    client.release(short)
    time.sleep(0.3)
    rest = client.get_meta(task="t", fields=["x"], batch_size=5, timeout_s=0.0)
    assert sorted(rest.indexes.tolist()) == sorted(short.indexes.tolist())
    assert client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]["done"] == 3


def test_a_consumed_batch_is_acked_without_a_lease_and_frees_its_rows() -> None:
    """``poll(consume=True)`` (``get_meta(consume=True)``): a full batch is done for the task
    as it is handed out; its rows are freed once every declared task is done (the batch still
    names them), no lease stays open or due, and its lease id is known as acked (an ack of
    it is a no-op). A short batch is leased as without ``consume``."""
    clock = _Clock()
    ctl = _controller(clock)
    ctl.queues.declare_tasks("p", ["t"])
    meta, changes = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=5, lease_s=10.0, consume=True
    )
    assert meta is not None and meta.acked and meta.lease_id is not None
    assert meta.indexes.tolist() == [0, 1, 2, 3, 4] and meta.groups.tolist() == [0, 1, 2, 3, 4]
    assert sorted(np.concatenate(changes.freed).tolist()) == [0, 1, 2, 3, 4]
    assert len(ctl.leases) == 0 and ctl.queues.next_deadline() is None
    assert ctl.leases.closed_reason(meta.lease_id) == "acked"
    ctl.queues.ack(meta.lease_id, meta.indexes)  # (no-op: consumed already)
    task = ctl.stats()["partitions"]["p"]["tasks"]["t"]
    assert task["done"] == 5 and task["leased"] == 0
    short, _ = ctl.queues.poll(
        task="t",
        partition="p",
        fields=["x"],
        batch_size=5,
        lease_s=10.0,
        consume=True,
        short_ok=True,
    )
    assert short is not None and not short.acked and short.indexes.tolist() == [5, 6, 7]
    assert ctl.leases.active(short.lease_id) is not None  # leased: release or ack it


# -- a fresh lease is written to without a renewal (transferqueue.client.holder) --------------
def _renewals(client: Client) -> int:
    kinds = client.stats()["controller"]["requests"]["kinds"]
    return int(kinds.get("renew", {}).get("requests", 0))


def test_a_put_right_after_its_get_meta_skips_the_renewal_and_only_then() -> None:
    """A stage's put of the batch it just leased is two controller round trips (write, commit)
    instead of three; a put past ``FRESH_LEASE_S``, a second put of the lease, or one after the
    handle released part of it renews first, as does a put that keeps the lease. Every row
    still reaches the next task exactly once, with the values written."""
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        aio = tq.async_client()  # (its get_meta goes through the loop: the lease is remembered)
        client.declare_tasks(["t", "u"])
        _put(client, 8)

        def take(n: int) -> BatchMeta:
            return tq.run(aio.get_meta("t", ["x"], n, lease_s=HOLD_S, timeout_s=WAIT_S))

        def put(meta: BatchMeta, value: float, **kw: object) -> None:
            tq.run(aio.put({"y": torch.full((len(meta),), value)}, meta=meta, **kw))  # type: ignore[arg-type]

        before = _renewals(client)
        put(meta := take(2), 1.0)  # at once: no renewal
        assert meta.acked and _renewals(client) == before
        meta = take(2)
        time.sleep(FRESH_LEASE_S + 0.05)  # no longer fresh: renewed first
        put(meta, 2.0)
        assert _renewals(client) == before + 1
        meta = take(2)
        put(meta.select([0]), 3.0)  # the first put of the lease: fresh
        put(meta.select([1]), 3.0)  # a second one renews
        assert _renewals(client) == before + 2
        meta = take(2)
        tq.run(aio.release(meta.select([0])))  # settled by this handle: the put renews
        put(meta.select([1]), 4.0)
        assert _renewals(client) == before + 3
        put(meta := take(1), 5.0, ack=False, lease_s=WAIT_S)  # keeps the lease: renews it
        assert _renewals(client) == before + 4 and not meta.acked
        tq.run(aio.ack(meta))
        got = client.get_meta("u", ["y"], 8, timeout_s=WAIT_S)  # (the released row: put last)
        ys = client.get_data(got, ["y"])["y"]
        assert sorted(ys.tolist()) == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 5.0]  # type: ignore[union-attr]
        client.ack(got)
        assert len(client.get_meta("t", ["x"], 8, timeout_s=0)) == 0
        assert len(client.get_meta("u", ["y"], 8, timeout_s=0)) == 0
