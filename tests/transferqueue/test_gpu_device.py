"""CUDA columns at the device's speed (needs a CUDA device; skipped without one).

- a put of CUDA columns goes through the handle's pinned pool (page-locked chunks, at most
  its capacity, every chunk given back), bit-exact, the tensors read as the producer's stream
  left them;
- ``get_data(meta, device=...)``, ``stream(device=...)`` and ``StreamingDataset(device=...)``
  return tensors on the device, bit-exact, ready on the caller's stream;
- a column shared by a producer in another process (``put(share=...)``) is read through a
  CUDA IPC handle into the reader's own device memory.
"""

from __future__ import annotations

import pytest
import torch

import transferqueue
from transferqueue import Ragged, Shaped
from transferqueue.client.dataset import StreamingDataset

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _columns(rows: int, seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3000, (rows,), generator=g)
    return {
        "hidden": torch.randn(rows, 4096, generator=g).to(torch.bfloat16).cuda(),
        "reward": torch.randn(rows, generator=g).cuda(),
        "ids": Ragged.from_lengths(
            torch.randint(0, 50_000, (int(lengths.sum()),), dtype=torch.int32, generator=g).cuda(),
            lengths,
        ),
        "logprobs": [torch.randn(int(n), generator=g).cuda() for n in lengths],
        "img": [  # a shaped column: [3, H, W] per row
            torch.randint(0, 256, (3, 8 + i % 5, 4 + i % 7), dtype=torch.uint8, generator=g).cuda()
            for i in range(rows)
        ],
    }


def _check(got: dict, want: dict, device: str) -> None:
    for name in ("hidden", "reward"):
        assert got[name].device.type == device, name
        assert torch.equal(got[name].cpu(), want[name].cpu()), name
    assert got["ids"].values.device.type == device
    assert got["ids"].offsets.device.type == "cpu"
    assert torch.equal(got["ids"].values.cpu(), want["ids"].values.cpu())
    assert torch.equal(got["ids"].offsets, want["ids"].offsets.cpu())
    rows = got["logprobs"].unbind()
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(rows, want["logprobs"], strict=True))
    img = got["img"]
    assert isinstance(img, Shaped) and img.values.device.type == device
    assert img.shapes.device.type == "cpu" and img.offsets.device.type == "cpu"
    assert all(
        torch.equal(a.cpu(), b.cpu()) for a, b in zip(img.unbind(), want["img"], strict=True)
    )


@pytest.mark.parametrize("service", [False, True])
def test_device_put_and_device_get_round_trip(service: bool) -> None:
    with (
        transferqueue.serve(num_units=2) if service else transferqueue.start(num_units=2)
    ) as tq_or_svc:
        tq = transferqueue.connect(tq_or_svc.address) if service else tq_or_svc
        try:
            tq.configure_device(pinned_bytes=64 << 20, chunk_bytes=8 << 20)  # several chunks
            client = tq.client()
            client.declare_tasks(["t"], partition="gpu")
            batches = [_columns(96, seed) for seed in range(3)]
            for want in batches:
                client.put(want, group=0, partition="gpu")
            pool = tq._staging.pool
            assert pool.pin and 1 <= pool.made <= pool.limit and pool.lent == 0
            for want in batches:
                meta = client.get_meta("t", list(want), 96, partition="gpu", timeout_s=30)
                _check(client.get_data(meta, device="cuda:0"), want, "cuda")
                _check(client.get_data(meta), want, "cpu")  # the host path is unchanged
                client.ack(meta)
            assert pool.lent == 0 and pool.peak_lent <= pool.limit
        finally:
            if service:
                tq.close()


def test_put_reads_the_tensors_as_the_producers_stream_left_them() -> None:
    """A producer that fills its tensor on the current stream and puts at once: the copy
    waits for that work (it is queued after an event on the current stream)."""
    with transferqueue.start(num_units=1) as tq:
        client = tq.client()
        out = torch.empty(64, 1 << 16, device="cuda")
        for i in range(5):
            out.fill_(float(i))
            torch.cuda._sleep(10_000_000)  # the copy would read stale values without the wait
            out.add_(1.0)
            client.put({"x": out}, partition="s")
            meta = client.get_meta("t", ["x"], 64, partition="s", timeout_s=30)
            assert bool((client.get_data(meta)["x"] == float(i + 1)).all())
            client.ack(meta)


def test_stream_and_dataset_land_on_the_device() -> None:
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        want = _columns(32, 7)
        client.put(want, group=0, partition="s")
        client.finish("s")
        batches = list(client.stream("t", list(want), 32, partition="s", device="cuda"))
        assert len(batches) == 1
        _check(batches[0][1], want, "cuda")
        client.put(want, group=0, partition="d")
        client.finish("d")
        data = StreamingDataset(client, "u", list(want), 32, partition="d", device="cuda:0")
        (cols,) = list(data)
        _check(cols, want, "cuda")


def test_a_shared_cuda_column_is_read_by_ipc_in_another_process() -> None:
    from tests.transferqueue.shared_producer import column
    from tests.transferqueue.test_shared_columns import Producer

    with transferqueue.serve(num_units=1) as svc, transferqueue.connect(svc.address) as tq:
        producer = Producer(svc.address)
        client = tq.client()
        client.declare_tasks(["a"], partition="g")
        producer.ask("put", 3, "g", "cuda:0")
        meta = client.get_meta("a", ["x"], 12, partition="g", timeout_s=30)
        got = client.get_data(meta)["x"]
        assert got.device.type == "cuda"  # a copy of its own on the GPU it sees
        assert torch.equal(got.cpu(), column(3))
        again = client.get_data(meta, device="cuda:0")["x"]
        assert torch.equal(again.cpu(), column(3))
        client.ack(meta)
        assert producer.ask("exit") == "bye"
