"""Re-replication (``replicas=2``): rows left with one copy get a second one again.

The controller core plans bounded copies and records them only when nothing changed under
them (a commit of fields, a free, the target's death); against real service processes a
unit killed, restarted and re-filled lets a second unit be killed without losing a row.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
from test_replicas import LIVENESS, SLACK_S, Expected, _ctl
from tq_helpers import until

import transferqueue
from transferqueue.controller.core import Controller
from transferqueue.controller.recopy import CLOCK_SLACK_S, Copier
from transferqueue.controller.rereplicate import CopyPlan
from transferqueue.controller.service import ControllerService
from transferqueue.errors import DeniedError
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire.grants import Grants

X = transferqueue.FieldSpec("dense", "float32", ())
Y = transferqueue.FieldSpec("dense", "int64", ())


def _one_copy_rows(n: int = 40, units: int = 2) -> tuple[Controller, np.ndarray]:
    """A core whose rows all lost their second copy (unit 1 died and came back)."""
    ctl = Controller(units, spread_bytes=0, replicas=2)
    ctl.rows.register_fields({"x": X, "y": Y}, "p")
    ctl.queues.declare_tasks("p", ["t"])
    meta = ctl.writes.allocate(n, "p", nbytes=n * 10)
    ctl.writes.commit(meta.indexes, ["x"], copies=meta.replica_units)
    ctl.health.lose_unit(1)
    ctl.health.unit_back(1)
    assert ctl.stats()["rows_one_copy"] == n
    return ctl, meta.indexes


def _freed(changes: Any) -> list[tuple[int, int]]:
    if not changes.freed:
        return []
    idx, units = np.concatenate(changes.freed), np.concatenate(changes.freed_units)
    return sorted(zip(idx.tolist(), units.tolist(), strict=True))


# -- the controller core ---------------------------------------------------------------------
def test_plans_are_bounded_and_a_done_copy_is_the_rows_second() -> None:
    ctl, rows = _one_copy_rows()
    plans: list[CopyPlan] = []
    while (plan := ctl.copies.plan_copies(max_rows=16, max_bytes=1 << 20)) is not None:
        assert plan.source == 0 and plan.target == 1 and plan.fields == ["x"]
        assert plan.indexes.size <= 16
        plans.append(plan)
    assert [p.indexes.size for p in plans] == [16, 16, 8]  # (rows under way: not planned again)
    assert np.concatenate([p.indexes for p in plans]).tolist() == rows.tolist()
    for p in plans:
        assert _freed(ctl.copies.copies_made(p.plan_id, p.target, p.indexes, p.epoch, True)) == []
    stats = ctl.stats()
    assert (stats["rows_one_copy"], stats["rows_recopied"]) == (0, 40)
    assert ctl.placement.unit_bytes.tolist() == [400, 400]
    # the bytes bound: 10 bytes a row
    ctl.health.lose_unit(1)
    ctl.health.unit_back(1)
    plan = ctl.copies.plan_copies(max_rows=100, max_bytes=35)
    assert plan is not None and plan.indexes.size == 3
    # the rows are freed once consumed: both copies
    got, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=40, lease_s=60)
    assert got is not None and got.replica_units is not None
    ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, True)
    freed = _freed(ctl.queues.ack(got.lease_id or 0))
    assert [u for i, u in freed if i in plan.indexes.tolist()] == [0, 1] * 3


def test_rows_of_one_copy_with_other_fields_go_in_another_copy() -> None:
    ctl, rows = _one_copy_rows(10)
    ctl.writes.commit(rows[:4], ["y"])
    plan = ctl.copies.plan_copies()  # (the oldest row's fields first)
    assert plan is not None and plan.fields == ["x", "y"]
    assert plan.indexes.tolist() == rows[:4].tolist()
    other = ctl.copies.plan_copies()
    assert other is not None and other.fields == ["x"]
    assert other.indexes.tolist() == rows[4:].tolist()


def test_a_failed_copy_is_freed_on_the_target_and_planned_again() -> None:
    ctl, rows = _one_copy_rows(8)
    plan = ctl.copies.plan_copies()
    assert plan is not None
    changes = ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, False)
    assert _freed(changes) == [(i, 1) for i in rows.tolist()]
    assert ctl.stats()["rows_one_copy"] == 8
    again = ctl.copies.plan_copies()
    assert again is not None and again.indexes.tolist() == rows.tolist()


def test_rows_changed_or_freed_during_a_copy_leave_nothing_on_the_target() -> None:
    ctl, rows = _one_copy_rows(12)
    plan = ctl.copies.plan_copies()
    assert plan is not None
    # fields committed during the copy (the copy may have read the rows before them)
    ctl.writes.commit(rows[:3], ["y"], copies=np.full(3, -1))
    # rows freed during the copy (consumed by every task)
    got, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=12, lease_s=60)
    assert got is not None
    ctl.queues.ack(got.lease_id or 0, rows[3:6])
    changes = ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, True)
    assert _freed(changes) == [(i, 1) for i in rows[:6].tolist()]
    h = ctl.rows.header
    slots = ctl.rows.map.lookup(rows)
    assert h["replica"][slots[6:]].tolist() == [1] * 6
    assert h["replica"][slots[:3]].tolist() == [-1] * 3  # (copied again later)
    assert ctl.stats()["rows_one_copy"] == 3


def test_a_target_that_died_during_the_copy_gets_no_copy() -> None:
    ctl, rows = _one_copy_rows(6)
    plan = ctl.copies.plan_copies()
    assert plan is not None
    ctl.health.lose_unit(1)  # (dies, and comes back empty before the copy's answer)
    ctl.health.unit_back(1)
    changes = ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, True)
    assert _freed(changes) == [(i, 1) for i in rows.tolist()]
    assert ctl.stats()["rows_one_copy"] == 6 and ctl.stats()["rows_recopied"] == 0


def test_a_writer_whose_meta_predates_the_copy_drops_it_at_commit() -> None:
    ctl, rows = _one_copy_rows(6)
    got, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=6, lease_s=60)
    assert got is not None and got.replica_units is not None
    assert (got.replica_units == -1).all()  # (the meta names one copy)
    plan = ctl.copies.plan_copies()
    assert plan is not None
    ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, True)
    assert ctl.stats()["rows_one_copy"] == 0
    # the writer wrote "y" to the one unit its meta named: the new copy lacks it
    changes = ctl.writes.commit(got.indexes, ["y"], copies=got.replica_units)
    assert _freed(changes) == [(i, 1) for i in rows.tolist()]  # (forgotten, freed there)
    assert ctl.stats()["rows_one_copy"] == 6
    again = ctl.copies.plan_copies()  # (copied again, "y" with it)
    assert again is not None and again.fields == ["x", "y"]
    # acked: each row freed once on each unit holding it (unit 0 only, now)
    freed = _freed(ctl.queues.ack(got.lease_id or 0))
    assert freed == [(i, 0) for i in rows.tolist()]
    assert _freed(ctl.copies.copies_made(again.plan_id, 1, again.indexes, again.epoch, True)) == [
        (i, 1) for i in rows.tolist()
    ]
    # a writer with a fresh meta keeps the copy
    ctl2, rows2 = _one_copy_rows(6)
    plan = ctl2.copies.plan_copies()
    assert plan is not None
    ctl2.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, True)
    got2, _ = ctl2.queues.poll(task="t", partition="p", fields=["x"], batch_size=6, lease_s=60)
    assert got2 is not None and got2.replica_units is not None
    assert (got2.replica_units == 1).all()
    assert _freed(ctl2.writes.commit(rows2, ["y"], copies=got2.replica_units)) == []
    assert _freed(ctl2.writes.commit(rows2[:2], ["y"], copies=np.full(2, -1))) == [(0, 1), (1, 1)]
    assert ctl2.stats()["rows_one_copy"] == 2


def test_nothing_is_planned_with_one_copy_kept_or_one_unit_alive() -> None:
    ctl, _ = _one_copy_rows(4)
    ctl.health.lose_unit(1)
    assert ctl.copies.plan_copies() is None
    one = Controller(2, spread_bytes=0)
    one.rows.register_fields({"x": X}, "p")
    meta = one.writes.allocate(3, "p")
    one.writes.commit(meta.indexes, ["x"])
    assert one.copies.plan_copies() is None and one.stats()["rows_one_copy"] == 0


def test_the_copier_survives_failing_copies_and_records_each_outcome() -> None:
    """A failed copy is freed on the target only once the grant its write was signed with
    has expired (a write still on its way is then refused there, not left behind)."""
    ctl, rows = _one_copy_rows(20)
    freed: list[tuple[int, list[int]]] = []
    freed_at: list[float] = []
    expiries: list[float] = []

    async def free_rows(unit: int, indexes: np.ndarray) -> None:
        freed.append((unit, indexes.tolist()))
        freed_at.append(time.time())

    outcomes = iter([RuntimeError("unit 0 stalled"), None])

    async def send(plan: CopyPlan, expires: float) -> int:
        expiries.append(expires)
        error = next(outcomes, None)
        if error is not None:
            raise error
        return int(plan.indexes.size)

    async def go() -> None:
        copier = Copier(ControllerService(ctl, free_rows), send, max_rows=20, timeout_s=0.5)
        copier.backoff_s = 0.0
        t0 = time.time()
        assert await copier.step()  # (fails at once: waits out the grant, frees on the target)
        assert copier.copies_failed == 1 and freed == [(1, rows.tolist())]
        assert t0 + 0.5 <= expiries[0] <= time.time()
        assert freed_at[0] >= expiries[0] + CLOCK_SLACK_S
        assert await copier.step()
        assert not await copier.step()  # (nothing left)

    asyncio.run(go())
    assert ctl.stats()["rows_one_copy"] == 0 and ctl.stats()["rows_recopied"] == 20


def test_a_copy_grant_expires_when_its_copy_is_given_up() -> None:
    """The target checks a copy's write against the grant's own expiry (the copier's bound),
    not the 10 minutes a put's grant has."""
    grants = Grants(b"k" * 32)
    rows = np.arange(4, 8)
    grants.check(grants.sign(1, 4, 8, time.time() + 5.0), 1, rows)
    with pytest.raises(DeniedError, match=r"rows 4\.\.7 expired"):
        grants.check(grants.sign(1, 4, 8, time.time() - 0.01), 1, rows)
    left = _expires_of(grants.sign(1, 4, 8)) - time.time()
    assert grants.ttl_s - 5 < left <= grants.ttl_s


def _expires_of(grant: bytes) -> float:
    """The expiry a grant carries (unit int32, lo int64, hi int64, expires float64)."""
    return float(np.frombuffer(grant, dtype="<f8", count=1, offset=20)[0])


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [("target", -1, ">= 0"), ("target", 5000, "<= 4095"), ("address", "", "length >= 1")],
)
def test_a_hostile_copy_rows_is_a_typed_error_naming_the_field(
    field: str, value: object, error: str
) -> None:
    msg = m.CopyRows(
        indexes=np.arange(3), fields=["x"], specs={"x": X}, target=1, address="a", grant=b"g"
    )
    setattr(msg, field, value)
    with pytest.raises(wire.RequestError) as info:
        wire.decode_request(wire.encode_request(1, msg), "unit")
    text = str(info.value.error)
    assert isinstance(info.value.error, transferqueue.ProtocolError)
    assert error in text and "copy_rows" in text
    assert f"$[{m.CopyRows.__struct_fields__.index(field)}]" in text
    assert m.CopyRows.needs == "service"  # (only the service's own servers may send it)


# -- the local service -----------------------------------------------------------------------
def _read_all(c: transferqueue.Client, task: str, want: Expected, n: int) -> list[int]:
    """Every row read back (bit-exact) by ``task``, acknowledged."""
    seen: list[int] = []
    while len(seen) < n:
        b = c.get_meta(task, ["x", "r"], 128, partition="p", timeout_s=60)
        assert len(b), f"task {task!r}: no batch within 60 s ({len(seen)} of {n} rows)"
        want.check(b, c.get_data(b))
        seen += b.indexes.tolist()
        c.ack(b)
    return seen


@pytest.mark.slow
@pytest.mark.service
def test_a_second_unit_killed_after_re_replication_loses_no_row() -> None:
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, replicas=2) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        want = Expected()
        metas = [want.put(c, k * 1000, 300) for k in range(4)]
        n = sum(len(x) for x in metas)
        os.kill(svc.pids[1], signal.SIGKILL)
        until(lambda: _ctl(c)["units_lost"] == 1, LIVENESS.bound_s + SLACK_S, "unit 1 lost")
        st = _ctl(c)  # every row lost its copy on unit 1 (unless copied again already: the
        assert st["rows_one_copy"] + st["rows_recopied"] == n  # unit may be back by now)
        until(lambda: svc.restarts[1] == 1, SLACK_S + 30, "unit 1 restarted")
        until(lambda: all(_ctl(c)["units_alive"]), SLACK_S, "unit 1 back")
        # a field added by a writer whose meta predates the copies (one copy named)
        held = c.get_meta("w", ["x"], 300, partition="p", lease_s=600)
        until(lambda: _ctl(c)["rows_one_copy"] == 0, SLACK_S + 30, "second copies made")
        assert _ctl(c)["rows_recopied"] == n
        assert c.stats()["units"][1]["rows"] == n
        assert held.replica_units is not None
        stale = int((held.replica_units < 0).sum())  # (rows copied after the meta was taken)
        c.put({"y": torch.arange(300.0)}, meta=held)  # (writes "y" to unit 0 only for those)
        until(lambda: _ctl(c)["rows_one_copy"] == 0, SLACK_S + 30, "the held rows copied again")
        assert _ctl(c)["rows_recopied"] == n + stale
        # now the other holder dies: every row has a copy on the restarted unit
        os.kill(svc.pids[0], signal.SIGKILL)
        until(lambda: _ctl(c)["units_lost"] == 2, LIVENESS.bound_s + SLACK_S, "unit 0 lost")
        until(lambda: svc.restarts[0] == 1, SLACK_S + 30, "unit 0 restarted")
        seen = _read_all(c, "a", want, n)
        assert sorted(seen) == sorted(np.concatenate([x.indexes for x in metas]).tolist())
        y = c.get_meta("u", ["y"], 300, partition="p", timeout_s=30)
        assert y.indexes.tolist() == held.indexes.tolist()
        assert torch.equal(c.get_data(y)["y"], torch.arange(300.0))  # (on both copies)
        assert _ctl(c)["rows_lost"] == 0
        assert svc.alive()
