"""Device columns' host side, on the CPU (transferqueue/device/pinned.py, staging.py and
client/device_io.py): the pinned pool's bookkeeping, the chunking, and a put that goes the
device path (every column counted as on a device) through a real embedded TransferQueue.

With pinning off and host copies, the pipeline is the one a GPU runs: chunks of whole rows,
at most two in flight, every chunk given back; what changes on a GPU (CUDA streams, events,
page-locked memory) is checked by tests/transferqueue/test_gpu_device.py.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch

import transferqueue
from transferqueue import Ragged, Shaped
from transferqueue.client import device_io, put
from transferqueue.device import staging as staging_module
from transferqueue.device.pinned import PinnedPool, PoolTimeoutError
from transferqueue.device.staging import DeviceStaging, row_chunks
from transferqueue.schema import FieldSpec


def test_the_pool_lends_at_most_its_chunks_and_reuses_them() -> None:
    pool = PinnedPool(4096, 1024, pin=False)
    assert pool.limit == 4 and pool.made == 0  # nothing is made before it is needed
    lent = [pool.acquire() for _ in range(4)]
    assert pool.made == pool.lent == pool.peak_lent == 4
    assert all(c.numel() == 1024 and c.dtype == torch.uint8 for c in lent)
    with pytest.raises(PoolTimeoutError, match="all 4 pinned chunks of 1024 bytes stayed lent"):
        pool.acquire(timeout_s=0.05)
    ptr = lent[0].data_ptr()
    pool.release(lent[0])
    again = pool.acquire()
    assert again.data_ptr() == ptr and pool.made == 4  # reused, not made again
    with pytest.raises(ValueError, match="did not lend"):
        pool.release(torch.empty(1024, dtype=torch.uint8))
    waiter: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: waiter.append(pool.acquire(timeout_s=30)))
    t.start()
    pool.release(lent[1])  # wakes the waiter
    t.join(10)
    assert waiter and waiter[0].data_ptr() == lent[1].data_ptr()
    pool.release(again)
    pool.close()
    assert pool.made == 3  # the free chunk is dropped; lent ones go when they come back
    for chunk in (lent[2], lent[3], waiter[0]):
        pool.release(chunk)
    assert pool.made == 0 and pool.lent == 0
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()
    with pytest.raises(ValueError, match="capacity_bytes >= chunk_bytes"):
        PinnedPool(10, 100)


def test_row_chunks_fit_a_chunk_and_cover_every_row() -> None:
    dense = torch.zeros(100, 10, dtype=torch.float32)  # 40 bytes a row
    lengths = torch.tensor([3] * 50 + [400] + [3] * 49)  # row 50: 3200 bytes of int64
    ragged = Ragged.from_lengths(torch.zeros(int(lengths.sum()), dtype=torch.int64), lengths)
    cols = {"d": dense, "r": ragged}
    chunks = row_chunks(cols, 100, chunk_bytes=1024)
    assert chunks[0][0] == 0 and chunks[-1][1] == 100
    assert all(a < b and b == c for (a, b), (c, _) in itertools.pairwise(chunks))
    assert (50, 51) in chunks  # larger than a chunk: alone
    for a, b in chunks:
        size = 40 * (b - a) + 8 * int(lengths[a:b].sum()) + 2 * 64
        assert size <= 1024 or b - a == 1


def _force_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Count every tensor column as on a device (the path a GPU's columns take)."""

    def on_device(col: object) -> bool:
        return isinstance(col, torch.Tensor | Ragged)

    for module in (staging_module, device_io, put):
        monkeypatch.setattr(module, "is_device", on_device)


def _columns(rows: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(0, 300, (rows,), generator=g)
    return {
        "hidden": torch.randn(rows, 64, generator=g).to(torch.bfloat16),
        "reward": torch.randn(rows, generator=g),
        "ids": Ragged.from_lengths(
            torch.randint(0, 50_000, (int(lengths.sum()),), dtype=torch.int32, generator=g),
            lengths,
        ),
        "answer": [f"{i}" for i in range(rows)],
        "img": Shaped.from_tensors(  # rows of any shape ride the ragged path
            [torch.randint(0, 256, (3, i % 9, 1 + i % 4), dtype=torch.uint8) for i in range(rows)]
        ),
    }


def _same(got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    for name in ("hidden", "reward"):
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got["ids"].values, want["ids"].values)
    assert torch.equal(got["ids"].offsets, want["ids"].offsets)
    assert got["answer"] == want["answer"]
    assert isinstance(got["img"], Shaped) and got["img"] == want["img"]


class _RecordingLink:
    """A unit link that keeps what each write brought (and how many chunks were lent)."""

    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self.writes: list[tuple[np.ndarray, dict[str, Any]]] = []
        self.lent_at_write: list[int] = []

    async def write(
        self, indexes: np.ndarray, columns: Mapping[str, Any], *a: Any, **k: Any
    ) -> None:
        self.lent_at_write.append(self.pool.lent)
        copied = {n: (c.clone() if isinstance(c, Ragged) else c) for n, c in columns.items()}
        copied = {n: c.clone() if isinstance(c, torch.Tensor) else c for n, c in copied.items()}
        self.writes.append((indexes.copy(), copied))


def test_a_device_part_is_written_a_chunk_at_a_time_two_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _force_device(monkeypatch)
    stage = DeviceStaging(64 << 10, 8 << 10, pin=False, host_copies=True)
    cols = _columns(200)
    link = _RecordingLink(stage.pool)
    indexes = np.arange(1000, 1200)
    specs: dict[str, FieldSpec] = {}
    asyncio.run(
        device_io.write_device(
            link,
            indexes,
            cols,
            specs,
            stage,
            {},
            create=True,
            grant=None,  # type: ignore[arg-type]
        )
    )
    assert len(link.writes) > 5
    assert np.array_equal(np.concatenate([w[0] for w in link.writes]), indexes)  # in order
    assert max(link.lent_at_write) <= 2 and stage.pool.lent == 0  # every chunk given back
    assert stage.pool.made <= 3
    dense = torch.cat([w[1]["hidden"] for w in link.writes])
    assert torch.equal(dense, cols["hidden"])
    values = torch.cat([w[1]["ids"].values for w in link.writes])
    assert torch.equal(values, cols["ids"].values)
    assert [a for w in link.writes for a in w[1]["answer"]] == cols["answer"]
    imgs = [row for w in link.writes for row in w[1]["img"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(imgs, cols["img"].unbind(), strict=True))


def test_put_of_device_columns_through_a_real_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's device path (chunked writes through the pool) into two embedded units,
    read back bit-exactly; a put with meta (new fields of leased rows) goes the same way."""
    _force_device(monkeypatch)
    with transferqueue.start(num_units=2) as tq:
        tq.configure_device(pinned_bytes=256 << 10, chunk_bytes=16 << 10)
        with pytest.raises(RuntimeError, match="before the first device put"):
            client = tq.client()
            client.put({"warm": torch.zeros(4, 1)}, partition="w")
            tq.configure_device(pinned_bytes=1 << 20)
        client = tq.client()
        client.declare_tasks(["score", "train"], partition="p")
        want = _columns(300)
        client.put(want, group=0, partition="p")
        meta = client.get_meta("score", ["hidden"], 300, partition="p", timeout_s=10)
        got = client.get_data(meta, list(want))
        _same(got, want)
        score = torch.randn(300, 3)
        client.put({"score": score}, meta=meta)
        meta = client.get_meta("train", ["score", *want], 300, partition="p", timeout_s=10)
        got = client.get_data(meta)
        _same(got, want)
        assert torch.equal(got["score"], score)
        client.ack(meta)
        assert tq._staging.pool.lent == 0 and tq._staging.pool.made >= 2


def test_to_device_through_chunks_lands_every_column() -> None:
    """The read side (host -> pinned chunk -> device), with the CPU as the device."""
    stage = DeviceStaging(64 << 10, 8 << 10, pin=False, host_copies=True)
    cols = _columns(150)
    out = stage.to_device(cols, torch.device("cpu"))
    assert list(out) == list(cols)
    _same(out, cols)
    assert out["hidden"].data_ptr() != cols["hidden"].data_ptr()  # copied, not aliased
    assert stage.pool.lent == 0 and 2 <= stage.pool.made <= 3
    empty = stage.to_device({"x": torch.empty(0, 4)}, torch.device("cpu"))
    assert empty["x"].shape == (0, 4)


def test_get_data_device_cpu_and_arrow_rules() -> None:
    with transferqueue.start(num_units=1) as tq:
        client = tq.client()
        client.put({"x": torch.arange(6).reshape(3, 2)}, partition="p")
        meta = client.get_meta("t", ["x"], 3, partition="p", timeout_s=10)
        assert torch.equal(client.get_data(meta, device="cpu")["x"], torch.arange(6).reshape(3, 2))
        with pytest.raises(ValueError, match="use format='torch'"):
            client.get_data(meta, format="arrow", device="cpu")  # type: ignore[call-overload]
