"""Status queries, reset_consumption and custom metadata, in every deployment.

Status must say exactly which rows have which field and what a task made of each row; a
reset must replay every live row to the task once (never twice, never a stale ack counted,
other tasks untouched, rows freed for good never resurrected); custom metadata must round-trip
exactly and leave with its row; bad input is a typed error after which the server serves on.
"""

from __future__ import annotations

import time

import fuzzwire
import numpy as np
import pytest
import rawwire as raw
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import transferqueue
from transferqueue import (
    Client,
    LeaseExpiredError,
    UnknownFieldError,
    UnknownLeaseError,
    UnknownRowError,
    UnknownTaskError,
)
from transferqueue.controller.core import Controller
from transferqueue.errors import BadRequestError
from transferqueue.limits import MAX_META_BYTES
from transferqueue.schema import FieldSpec
from transferqueue.wire.replies import STATES

HOLD_S = 30.0
"""A lease the test relies on still holding while it acts on its rows."""
SHORT_S = 0.3
"""A lease the test waits out (after a reset it must not bring its rows back again)."""
WAIT_S = 60.0
"""Bound of a wait that ends on an event, long before this."""


def _states(client: Client, task: str, partition: str = "default") -> dict[int, str]:
    st = client.status(partition, task=task)
    return dict(zip(st.indexes.tolist(), st.state_names(), strict=True))


def _drain(client: Client, task: str, fields: list[str], partition: str = "default") -> list[int]:
    """Every row the (finished) partition still has for ``task``, batch by batch, acked."""
    got: list[int] = []
    while True:
        meta = client.get_meta(task, fields, 2, partition=partition, timeout_s=WAIT_S)
        got += meta.indexes.tolist()
        if len(meta):
            client.ack(meta)
        if meta.is_end:
            return got


def test_status_follows_fields_as_they_land_and_the_task_as_it_leases_and_acks(
    client: Client,
) -> None:
    rows = client.put({"x": torch.arange(4)})
    idx = rows.indexes.tolist()
    st = client.status(fields=["x"])
    assert st.indexes.tolist() == idx and st.states is None
    assert st.ready["x"].tolist() == [True] * 4
    client.put({"y": torch.ones(2)}, meta=rows.select([1, 3]))  # y lands on two rows only
    assert client.get_meta("t", ["x", "y"], 1, timeout_s=0).reason == "full"  # (starts t)
    st = client.status(fields=["y", "x"], task="t")
    assert st.ready["y"].tolist() == [False, True, False, True]
    assert st.ready["x"].tolist() == [True] * 4
    assert st.state_names() == ["waiting", "leased", "waiting", "queued"]
    assert st.rows("queued").tolist() == [idx[3]] and st.rows("leased").tolist() == [idx[1]]
    assert STATES[int(st.states[1])] == "leased"  # type: ignore[index]
    leased = client.get_meta("t", ["x", "y"], 1, timeout_s=WAIT_S, lease_s=HOLD_S)
    client.put({"y": torch.ones(2)}, meta=rows.select([0, 2]))
    client.ack(leased)
    assert _states(client, "t") == {
        idx[0]: "queued",
        idx[1]: "leased",
        idx[2]: "queued",
        idx[3]: "done",
    }


def test_a_declared_task_that_has_not_started_is_waiting_on_every_row(client: Client) -> None:
    client.declare_tasks(["early", "late"], partition="p")
    client.put({"x": torch.arange(3)}, partition="p")
    assert client.status("p", task="late").state_names() == ["waiting"] * 3
    assert client.reset_consumption("late", partition="p") == 0


def test_reset_replays_every_live_row_once_and_leaves_other_tasks_alone(client: Client) -> None:
    rows = client.put({"x": torch.arange(6)}).indexes.tolist()
    client.finish("default")
    first = client.get_meta("a", ["x"], 4, timeout_s=WAIT_S)
    client.ack(first)
    held = client.get_meta("a", ["x"], 2, timeout_s=WAIT_S, lease_s=SHORT_S)
    b_meta = client.get_meta("b", ["x"], 3, timeout_s=WAIT_S)
    client.ack(b_meta)
    b_before = _states(client, "b")

    assert client.reset_consumption("a") == 6
    assert set(_states(client, "a").values()) == {"queued"}
    assert _states(client, "b") == b_before
    with pytest.raises(UnknownLeaseError, match="reset_consumption"):
        client.ack(held)
    time.sleep(3 * SHORT_S)  # the old lease's deadline passes: its rows must not come back again
    replay = _drain(client, "a", ["x"])
    assert sorted(replay) == rows  # every live row exactly once
    tasks = client.stats()["controller"]["partitions"]["default"]["tasks"]
    assert tasks["a"]["done"] == 6 and tasks["a"]["leased"] == tasks["a"]["queued"] == 0
    assert tasks["b"]["done"] == 3 and tasks["b"]["queued"] == 3
    assert sorted(_drain(client, "b", ["x"])) == rows[3:]


def test_a_reset_task_with_a_group_sampler_gets_whole_groups_again(client: Client) -> None:
    rows = client.put({"x": torch.arange(6)}, group=[0, 0, 1, 1, 2, 2]).indexes.tolist()
    opts = {"sampler": "group", "group_size": 2, "timeout_s": WAIT_S}
    client.ack(client.get_meta("g", ["x"], 4, **opts))  # two groups consumed
    held = client.get_meta("g", ["x"], 2, lease_s=HOLD_S, **opts)  # the third leased
    assert client.reset_consumption("g") == 6
    batches = [client.get_meta("g", ["x"], 2, **opts) for _ in range(3)]
    assert sorted(i for b in batches for i in b.indexes.tolist()) == rows
    assert all(len(set(b.groups.tolist())) == 1 and len(b) == 2 for b in batches)
    assert len(client.get_meta("g", ["x"], 2, sampler="group", group_size=2, timeout_s=0)) == 0
    with pytest.raises(UnknownLeaseError):
        client.ack(held)


def test_reset_closes_a_lease_so_a_put_with_it_writes_nothing(client: Client) -> None:
    client.put({"x": torch.arange(2)})
    held = client.get_meta("a", ["x"], 2, timeout_s=WAIT_S, lease_s=HOLD_S)
    client.reset_consumption("a")
    with pytest.raises(UnknownLeaseError, match="reset_consumption"):
        client.put({"z": torch.ones(2)}, meta=held)
    assert not client.status(fields=["z"]).ready["z"].any()
    assert _states(client, "a") == dict.fromkeys(held.indexes.tolist(), "queued")


def test_freed_rows_are_gone_and_a_reset_keeps_the_rest_until_every_task_is_done_again(
    client: Client,
) -> None:
    client.declare_tasks(["a", "b"], partition="p")
    rows = client.put({"x": torch.arange(4)}, partition="p").indexes.tolist()
    client.finish("p")
    assert sorted(_drain(client, "a", ["x"], "p")) == rows
    early = client.get_meta("b", ["x"], 2, partition="p", timeout_s=WAIT_S)
    client.ack(early)  # rows 0 and 1: acked by both declared tasks, freed
    assert client.status("p").indexes.tolist() == rows[2:]

    assert client.reset_consumption("a", partition="p") == 2
    # b finishing first must not free rows a has yet to consume again
    assert sorted(_drain(client, "b", ["x"], "p")) == rows[2:]
    assert client.status("p").indexes.tolist() == rows[2:]
    assert sorted(_drain(client, "a", ["x"], "p")) == rows[2:]
    assert client.status("p").indexes.tolist() == []
    assert client.stats()["controller"]["rows_live"] == 0


def test_custom_meta_round_trips_exactly_and_leaves_with_its_row(client: Client) -> None:
    client.declare_tasks(["t"])
    meta = client.put({"x": torch.arange(3)})
    metas = [
        {"uid": "ü-0", "score": 0.1, "n": 2**63 - 1, "neg": -(2**63), "ok": True, "none": None},
        {"nested": {"a": [1, [2, {"b": b"\x00\xff"}]]}, "empty": [], "f": -0.0},
        {"s": "x" * 100},
    ]
    client.set_custom_meta(meta, metas)
    back = client.get_custom_meta(meta.indexes[::-1])
    assert back == metas[::-1]
    assert [type(v) for v in back[2].values()] == [str, float, int, int, bool, type(None)]
    assert repr(back[1]["f"]) == "-0.0" and back[1]["nested"]["a"][1][1]["b"] == b"\x00\xff"
    back[2]["uid"] = "changed"  # a copy: the stored metadata does not change with it
    client.set_custom_meta(meta.indexes[1:2], [{}])  # {} removes a row's metadata
    assert client.get_custom_meta(meta) == [metas[0], {}, metas[2]]
    stats = client.stats()["controller"]
    assert stats["custom_meta_rows"] == 2 and stats["custom_meta_bytes"] > 100

    client.finish("default")
    _drain(client, "t", ["x"])  # every declared task acked: rows freed, metadata with them
    with pytest.raises(UnknownRowError):
        client.get_custom_meta(meta)
    assert client.stats()["controller"]["custom_meta_rows"] == 0

    other = client.put({"x": torch.arange(2)}, partition="q")
    client.set_custom_meta(other, [{"k": 1}, {"k": 2}])
    client.clear("q")
    with pytest.raises(UnknownRowError):
        client.get_custom_meta(other)
    stats = client.stats()["controller"]
    assert stats["custom_meta_rows"] == 0 and stats["custom_meta_bytes"] == 0


def test_bad_inputs_are_typed_errors_naming_the_fix_and_the_server_keeps_serving(
    client: Client,
) -> None:
    meta = client.put({"x": torch.arange(2)})
    client.get_meta("t", ["x"], 1, timeout_s=0)
    cases: list[tuple[type[Exception], str, object]] = [
        (BadRequestError, "'nope' is unknown", lambda: client.status("nope")),
        (UnknownFieldError, "'typo' was never written", lambda: client.status(fields=["typo"])),
        (UnknownTaskError, "known tasks: \\['t'\\]", lambda: client.status(task="ghost")),
        (UnknownTaskError, "'ghost'", lambda: client.reset_consumption("ghost")),
        (
            BadRequestError,
            f"MAX_META_BYTES={MAX_META_BYTES}",
            lambda: client.set_custom_meta(meta, [{"k": "x" * MAX_META_BYTES}, {}]),
        ),
        (BadRequestError, "2 rows but 1 metas", lambda: client.set_custom_meta(meta, [{}])),
        (BadRequestError, "must be a dict", lambda: client.set_custom_meta(meta, [{}, [1]])),
        (BadRequestError, "tuple", lambda: client.set_custom_meta(meta, [{}, {"t": (1,)}])),
        (BadRequestError, "map keys", lambda: client.set_custom_meta(meta, [{}, {"a": {1: 2}}])),
        (UnknownRowError, "10000000", lambda: client.set_custom_meta([10**7], [{"a": 1}])),
        (UnknownRowError, "-1", lambda: client.get_custom_meta([-1])),
        (BadRequestError, "1-D sequence", lambda: client.get_custom_meta([0.5])),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()  # type: ignore[operator]
        # nothing was stored, and the next normal call works
        assert client.get_custom_meta(meta) == [{}, {}]
    client.set_custom_meta(meta, [{"k": "x" * (MAX_META_BYTES - 10)}, {"a": 1}])  # at the bound
    assert client.get_custom_meta(meta)[1] == {"a": 1}


@pytest.mark.service
def test_hostile_status_requests_on_the_wire_get_typed_errors_then_normal_calls_work(
    local_service: transferqueue.LocalService,
) -> None:
    with transferqueue.connect(local_service.address) as tq:
        tq.reset()
        client = tq.client()
        meta = client.put({"x": torch.arange(2)})
        first = int(meta.indexes[0])
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(local_service.address)
        try:
            hostile = [
                ("set_custom_meta", [raw.int64s([first]), [b"\x80" * (MAX_META_BYTES + 1)]]),
                ("set_custom_meta", [raw.int64s([first]), [b"\x93\x01\x02\x03"]]),  # a list
                ("set_custom_meta", [raw.int64s([first]), [b"\xc1"]]),  # not msgpack
                ("set_custom_meta", [raw.int64s([first]), [fuzzwire._nested_ext(2, 40).data]]),
                ("status", ["default", ["x"] * 2000]),
                ("reset_consumption", ["default", "t" * 300]),
            ]
            for kind, body in hostile:
                assert raw.error_code(raw.ask(sock, raw.request(kind, body))) == "protocol", kind
            reply = raw.ask(sock, raw.request("get_custom_meta", [raw.int64s([10**9])]))
            assert raw.error_code(reply) == "unknown_row"
        finally:
            ctx.destroy(linger=0)
        assert client.get_custom_meta(meta) == [{}, {}]
        client.set_custom_meta(meta, [{"a": 1}, {"b": [2]}])
        assert client.get_custom_meta(meta) == [{"a": 1}, {"b": [2]}]
        assert client.status(fields=["x"]).ready["x"].tolist() == [True, True]
        assert np.array_equal(client.status().indexes, meta.indexes)


# -- the controller alone: random interleavings, counters and rounds checked after each step ---
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "poll", "poll", "ack", "ack", "release", "expire", "reset"]),
        st.sampled_from(["a", "a", "b"]),  # (mostly one task: its poll, ack, reset meet)
        st.integers(1, 4),
    ),
    min_size=8,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, declared=st.booleans())
def test_reset_keeps_counters_true_and_each_round_exactly_once(
    ops: list[tuple[str, str, int]], declared: bool
) -> None:
    """After every step, each task's counters agree with the per-row states ``status``
    reports (rows freed count as done); within one round (between resets) a task never
    consumes a row twice; a row is freed only once every declared task consumed it in its
    current round (a reset task's acks count again)."""
    clock = _Clock()
    ctl = Controller(1, clock=clock)
    ctl.rows.register_fields({"x": FieldSpec.dense("int64")}, "p")
    if declared:
        ctl.queues.declare_tasks("p", ["a", "b"])
    held: dict[str, list[tuple[int, list[int]]]] = {"a": [], "b": []}
    consumed: dict[str, set[int]] = {"a": set(), "b": set()}  # this round's acks
    live: set[int] = set()
    for op, task, k in ops:
        if op == "put":
            ctl.writes.commit(ctl.writes.allocate(k, "p").indexes, ["x"])
        elif op == "poll":
            meta, _ = ctl.queues.poll(
                task=task, partition="p", fields=["x"], batch_size=k, lease_s=15, short_ok=True
            )
            if meta is not None and meta.lease_id is not None:
                held[task].append((meta.lease_id, meta.indexes.tolist()))
        elif op in ("ack", "release") and held[task]:
            lease_id, rows = held[task].pop(0)
            try:
                getattr(ctl.queues, op)(lease_id, np.array(rows))
            except (UnknownLeaseError, LeaseExpiredError):
                continue  # (closed by a reset or expired: nothing was consumed)
            if op == "ack":
                assert not consumed[task] & set(rows), "a row consumed twice in one round"
                consumed[task] |= set(rows)
        elif op == "expire":  # (a lease outlives one expire, not two)
            clock.now += 10
            ctl.queues.expire()
        elif op == "reset" and "p" in ctl.stats()["partitions"]:
            try:
                ctl.queues.reset_consumption("p", task)
            except UnknownTaskError:
                assert not declared  # (a task that never asked, undeclared)
                continue
            consumed[task].clear()
        stats = ctl.stats()["partitions"].get("p")
        if stats is None:
            continue
        now = set(ctl.status.status("p").indexes.tolist())
        gone = live - now
        live = now
        # a row is freed only once every declared task consumed it in its current round
        assert gone <= (consumed["a"] & consumed["b"] if declared else set())
        for name, t in stats["tasks"].items():
            codes = ctl.status.status("p", task=name).states
            assert codes is not None
            counts = np.bincount(codes, minlength=4)
            assert t["queued"] == counts[1] and t["leased"] == counts[2]
            assert t["done"] == counts[3] + stats["rows_freed"]
            assert t["waiting"] == counts[0] == 0
