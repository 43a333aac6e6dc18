"""Rows are freed once every declared task acknowledged them; capacity gives back-pressure."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.transferqueue.conftest import Deploy
from transferqueue import CapacityError, Client, TransferQueue, UnknownRowError, UnknownTaskError


def _rows(client: Client) -> int:
    return int(client.stats()["controller"]["rows_live"])


def test_rows_freed_after_all_declared_tasks_ack(client: Client) -> None:
    client.declare_tasks(["a", "b"])
    meta = client.put({"x": torch.arange(4)}, group=0)
    ma = client.get_meta("a", ["x"], 4, timeout_s=1)
    client.ack(ma)
    assert _rows(client) == 4  # "b" has not consumed them yet
    mb = client.get_meta("b", ["x"], 4, timeout_s=1)
    client.ack(mb)
    assert _rows(client) == 0
    units = client.stats()["units"]
    assert sum(u["rows"] for u in units) == 0  # payload dropped from the units as well
    with pytest.raises(UnknownRowError):
        client.get_data(meta, ["x"])


def test_partition_without_declared_tasks_keeps_rows_for_late_tasks(client: Client) -> None:
    client.put({"x": torch.arange(4)}, group=0)
    client.ack(client.get_meta("early", ["x"], 4, timeout_s=1))
    assert _rows(client) == 4
    late = client.get_meta("late", ["x"], 4, timeout_s=1)
    assert torch.equal(client.get_data(late)["x"], torch.arange(4))  # type: ignore[arg-type]
    client.clear()
    assert _rows(client) == 0


def test_undeclared_task_in_declared_partition_is_rejected(client: Client) -> None:
    client.declare_tasks(["a"], partition="p")
    with pytest.raises(UnknownTaskError, match="declare_tasks"):
        client.get_meta("b", ["x"], 1, partition="p", timeout_s=0)


def test_memory_of_freed_rows_is_reused(client: Client, tq: TransferQueue) -> None:
    client.declare_tasks(["t"])
    x = torch.randn(256, 1024)
    for _ in range(10):
        client.put({"x": x}, group=0)
        client.ack(client.get_meta("t", ["x"], 256, timeout_s=1))
    caps = [u["slot_capacity"] for u in client.stats()["units"]]
    assert all(c <= 256 for c in caps), caps  # ten batches went through the same slots


def test_put_waits_for_capacity_then_proceeds(deploy: Deploy) -> None:
    with deploy(capacity_rows=8) as tq:
        client = tq.client()
        client.declare_tasks(["t"])
        client.put({"x": torch.arange(8)}, group=0)
        done = threading.Event()

        def producer() -> None:
            client.put({"x": torch.arange(4)}, group=1, timeout_s=60)
            done.set()

        th = threading.Thread(target=producer)
        th.start()
        time.sleep(0.2)
        assert not done.is_set()  # full: the put waits (back-pressure), nothing is dropped
        client.ack(client.get_meta("t", ["x"], 4, timeout_s=1))
        th.join(60)  # the ack made room: the put goes on (its timeout is a bound only)
        assert done.is_set()
        with pytest.raises(CapacityError, match="capacity_rows=8"):
            client.put({"x": torch.arange(4)}, group=2, timeout_s=0.2)
        with pytest.raises(CapacityError, match="split the put"):
            client.put({"x": torch.arange(9)}, group=3)
        assert _rows(client) == 8
        stored = client.get_meta("t", ["x"], 8, timeout_s=1)
        x = client.get_data(stored)["x"]
        assert isinstance(x, torch.Tensor)
        assert sorted(x.tolist()) == [0, 1, 2, 3, 4, 5, 6, 7]  # rows 4..7 of put 1, 0..3 of put 2


def test_clear_ends_leases_and_reopens_partition(client: Client) -> None:
    client.put({"x": torch.arange(3)}, group=np.arange(3))
    client.finish()
    meta = client.get_meta("t", ["x"], 3, timeout_s=1)
    client.clear()
    assert _rows(client) == 0
    client.put({"x": torch.arange(2)}, group=0)
    again = client.get_meta("t", ["x"], 2, timeout_s=1)
    assert len(again) == 2 and again.reason == "full"
    with pytest.raises(Exception, match="no longer active"):
        client.ack(meta)


def test_unit_frees_rows_added_after_a_read_was_pinned() -> None:
    """A pinned read (a zero-copy send in flight) must not stop the unit from freeing rows
    written after it, in slots its pin table has not grown to yet."""
    from transferqueue.schema import FieldSpec
    from transferqueue.storage.unit import StorageUnit

    unit = StorageUnit(0)
    specs = {"x": FieldSpec("dense", "float32", (4,))}
    unit.write(np.arange(8), {"x": torch.ones(8, 4)}, specs, create=True)
    pins: list[int] = []
    view = unit.read(np.arange(8), ["x"], pin=pins)["x"]
    assert pins, "a one-run dense read comes back pinned"
    more = np.arange(8, 5000)
    unit.write(more, {"x": torch.full((more.size, 4), 2.0)}, specs, create=True)
    assert unit.free(more) == more.size  # beyond the pin table: freed at once
    assert unit.free(np.arange(8)) == 8  # pinned: freed, their slots reused only once sent
    assert torch.equal(view, torch.ones(8, 4))  # the view being sent is intact
    unit.unpin(pins[0])
    unit.write(np.arange(5000, 5008), {"x": torch.zeros(8, 4)}, specs, create=True)
    assert unit.stats()["rows"] == 8
