"""CUDA tensors through TransferQueue (needs a CUDA device; skipped without one).

Producers on a GPU put their tensors as they are. TransferQueue stores host memory: every
column (dense, ragged, a list of per-row tensors) is copied to the host on the way in, through
the handle's pinned chunks, and a read returns host tensors bit-identical to what was put, on
every deployment (reads onto the device: tests/transferqueue/test_gpu_device.py).
"""

from __future__ import annotations

import pytest
import torch

import transferqueue
from transferqueue import Client, Ragged
from transferqueue.client.unit_link import RemoteUnitLink

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _columns(rows: int, seed: int, width: int = 1024) -> dict[str, object]:
    """A GPU producer's batch: a dense bf16 and a dense f32 column, a packed ragged column and
    a list of per-row tensors, all on the device."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4000, (rows,), generator=g)
    ids = torch.randint(0, 50_000, (int(lengths.sum()),), dtype=torch.int32, generator=g)
    return {
        "hidden": torch.randn(rows, width, generator=g).to(torch.bfloat16).cuda(),
        "reward": torch.randn(rows, 2, generator=g).cuda(),
        "ids": Ragged.from_lengths(ids.cuda(), lengths),
        "logprobs": [torch.randn(int(n), generator=g).cuda() for n in lengths],
    }


def _check(got: dict, want: dict) -> None:
    for name in ("hidden", "reward"):
        assert got[name].device.type == "cpu"
        assert got[name].dtype == want[name].dtype
        assert torch.equal(got[name], want[name].cpu()), name
    assert isinstance(got["ids"], Ragged) and got["ids"].values.device.type == "cpu"
    assert torch.equal(got["ids"].values, want["ids"].values.cpu())
    assert torch.equal(got["ids"].offsets, want["ids"].offsets.cpu())
    rows = got["logprobs"].unbind()
    assert len(rows) == len(want["logprobs"])
    assert all(torch.equal(a, b.cpu()) for a, b in zip(rows, want["logprobs"], strict=True))


def test_cuda_columns_round_trip_bit_exactly(client: Client) -> None:
    client.declare_tasks(["t"], partition="gpu")
    batches = [_columns(48, seed) for seed in range(3)]
    for want in batches:
        client.put(want, group=0, partition="gpu")
    for want in batches:
        meta = client.get_meta("t", list(want), 48, partition="gpu", timeout_s=10)
        _check(client.get_data(meta), want)
        client.ack(meta)


def test_cuda_results_written_back_to_existing_rows(client: Client) -> None:
    """A GPU stage adds fields to rows it read (put with meta): those land on the host too."""
    client.declare_tasks(["score", "train"], partition="gpu2")
    client.put({"prompt": torch.arange(32, dtype=torch.int64).reshape(8, 4)}, partition="gpu2")
    meta = client.get_meta("score", ["prompt"], 8, partition="gpu2", timeout_s=10)
    prompt = client.get_data(meta)["prompt"].cuda()
    values = (prompt.float() * 0.5).softmax(dim=1)  # computed on the device
    client.put({"values": values}, meta=meta)
    meta = client.get_meta("train", ["prompt", "values"], 8, partition="gpu2", timeout_s=10)
    got = client.get_data(meta)
    assert torch.equal(got["values"], values.cpu())
    client.ack(meta)


def test_cuda_ragged_puts_through_a_service_are_intact() -> None:
    """Ragged GPU batches of a few MB through a one-unit service, a pinned chunk at a time
    (not through the write arenas host puts are staged in); nothing changes on the way."""
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        client = tq.client()
        client.declare_tasks(["t"], partition="st")
        (link,) = tq._units
        assert isinstance(link, RemoteUnitLink)
        first = _columns(160, 0)  # larger than the rest: they are placed whole too
        batches = [_columns(128, seed) for seed in range(1, 5)]
        for want in [first, *batches]:
            client.put(want, group=0, partition="st")
            rows = len(want["reward"])
            meta = client.get_meta("t", list(want), rows, partition="st", timeout_s=10)
            _check(client.get_data(meta), want)
            client.ack(meta)
        assert link.staged_writes == 0
        assert tq._staging.pool.made >= 1 and tq._staging.pool.lent == 0
