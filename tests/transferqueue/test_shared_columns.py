"""Columns shared by their producer (``put(share=[...])``, transferqueue/device/shared.py).

The producer runs in a process of its own (tests/transferqueue/shared_producer.py) over a
local service; on the CPU the column goes through shared files (the ``file`` sharer: the same
protocol as CUDA IPC, which tests/transferqueue/test_gpu_device.py runs). Checked: readers
get the rows bit-exactly and own them; the producer keeps the column until every declared task
acked its rows, then drops it; when the producer dies, a read of its rows raises
RowsLostError and their groups leave every task, as rows of a dead unit do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import transferqueue
from tests.transferqueue.shared_producer import column, produce
from transferqueue import RowsLostError

pytestmark = pytest.mark.service


class Producer:
    def __init__(self, address: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=produce, args=(address, child), daemon=True)
        self.process.start()
        assert self.ask() == "ready"

    def ask(self, *command: Any) -> Any:
        if command:
            self.conn.send(command)
        assert self.conn.poll(120), f"no answer to {command}"
        return self.conn.recv()


@pytest.fixture
def service() -> Iterator[str]:
    with transferqueue.serve(num_units=1) as svc:
        yield svc.address


def _shared_files(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"asyncflow-share-{pid}-*.bin")]


def test_readers_get_shared_rows_until_every_task_acked(service: str) -> None:
    producer = Producer(service)
    with transferqueue.connect(service) as tq:
        client = tq.client()
        client.declare_tasks(["a", "b"], partition="s")
        indexes = producer.ask("put", 1, "s")
        assert producer.ask("kept") == 1
        for task in ("a", "b"):
            meta = client.get_meta(task, ["x", "y"], 12, partition="s", timeout_s=30)
            assert meta.indexes.tolist() == indexes
            got = client.get_data(meta)
            assert torch.equal(got["x"], column(1))  # the rows, bit-exactly, in order
            assert torch.equal(got["y"], torch.arange(12))
            part = client.get_data(meta.select([7, 2]), ["x"])["x"]
            assert torch.equal(part, column(1)[[7, 2]])
            assert producer.ask("kept") == 1  # kept while a declared task has not acked
            client.ack(meta)
        deadline = time.monotonic() + 30
        while producer.ask("kept"):  # freed rows: the exporter drops the column (it polls)
            assert time.monotonic() < deadline, "the shared column outlived its rows"
            time.sleep(0.2)
        assert not _shared_files(producer.process.pid or 0)  # every export was retired
    assert producer.ask("exit") == "bye"


def test_rows_of_a_dead_producer_are_lost_and_leave_every_task(service: str) -> None:
    producer = Producer(service)
    with transferqueue.connect(service) as tq:
        client = tq.client()
        client.declare_tasks(["a", "b"], partition="d")
        first = producer.ask("put", 2, "d")
        os.kill(producer.process.pid or 0, signal.SIGKILL)
        producer.process.join(30)
        meta = client.get_meta("a", ["x", "y"], 12, partition="d", timeout_s=30)
        assert meta.indexes.tolist() == first
        with pytest.raises(RowsLostError, match="shared by a producer that is gone") as err:
            client.get_data(meta)
        assert sorted(err.value.indexes.tolist()) == first  # type: ignore[attr-defined]
        assert client.status("d").indexes.size == 0  # retired: gone from every task
        meta = client.get_meta("b", ["x"], 12, partition="d", timeout_s=1)
        assert len(meta) == 0
