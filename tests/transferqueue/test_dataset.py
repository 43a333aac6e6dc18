"""StreamingDataset: every row once across data-parallel ranks, the same rows on the ranks of
one model-parallel group, acknowledged only once every rank is done with a batch."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import transferqueue
from transferqueue import BatchMeta, Ragged, TransferQueue
from transferqueue.client.dataset import StreamingDataset, ThreadGroup


def _fill(tq: TransferQueue, rows: int, partition: str = "train") -> None:
    client = tq.client()
    client.declare_tasks(["train"], partition=partition)  # rows freed once trained
    lengths = np.arange(rows) % 7 + 1
    client.put(
        {"ids": [torch.full((int(n),), i) for i, n in enumerate(lengths)], "i": torch.arange(rows)},
        length=lengths,
        partition=partition,
    )
    client.finish(partition)


def _run_ranks(
    tq: TransferQueue, ranks: list[dict[str, int]], **options: Any
) -> list[list[tuple[BatchMeta, dict[str, Any]]]]:
    """Iterate one dataset per rank, each rank a thread with its own client; the batches each
    rank saw, in order."""
    group = ThreadGroup(len(ranks), timeout_s=60)
    seen: list[list[tuple[BatchMeta, dict[str, Any]]]] = [[] for _ in ranks]
    errors: list[BaseException] = []

    def rank_main(k: int) -> None:
        try:
            ds = StreamingDataset(
                tq.client(), "train", ["ids", "i"], 4, partition="train", group=group,
                with_meta=True, timeout_s=10, **ranks[k], **options,
            )  # fmt: skip
            for meta, cols in ds:
                seen[k].append((meta, cols))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(k,)) for k in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return seen


def _indexes(batches: list[tuple[BatchMeta, dict[str, Any]]]) -> list[int]:
    return [i for meta, _ in batches for i in meta.indexes.tolist()]


def _check_columns(batches: list[tuple[BatchMeta, dict[str, Any]]]) -> None:
    for meta, cols in batches:  # each row's payload is that row's (columns follow the meta)
        assert cols["i"].tolist() == meta.indexes.tolist()
        assert isinstance(cols["ids"], Ragged)
        assert [int(r[0]) for r in cols["ids"] if len(r)] == meta.indexes.tolist()


@pytest.mark.parametrize("rows", [40, 41], ids=["full", "short-tail"])
def test_data_parallel_ranks_get_every_row_exactly_once(tq: TransferQueue, rows: int) -> None:
    _fill(tq, rows)
    seen = _run_ranks(tq, [{"dp_rank": r, "dp_size": 2} for r in range(2)])
    a, b = _indexes(seen[0]), _indexes(seen[1])
    assert not set(a) & set(b)
    assert sorted(a + b) == list(range(rows))  # every row, once
    assert len(seen[0]) == len(seen[1])  # the same number of steps on both ranks
    for (ma, _), (mb, _) in zip(seen[0], seen[1], strict=True):
        assert abs(len(ma) - len(mb)) <= 1 and ma.lease_id == mb.lease_id  # one global batch
    if rows == 41:  # 41 = 5 x 8 + 1: the last global batch has one row; one rank gets none
        assert sorted([len(seen[0][-1][0]), len(seen[1][-1][0])]) == [0, 1]
    for s in seen:
        _check_columns(s)
    stats = tq.client().stats()["controller"]
    assert stats["rows_live"] == 0  # every batch was acknowledged, so every row freed


def test_model_parallel_ranks_get_the_same_batches(tq: TransferQueue) -> None:
    _fill(tq, 24)
    seen = _run_ranks(tq, [{"mp_rank": r, "mp_size": 2} for r in range(2)])
    assert [m.indexes.tolist() for m, _ in seen[0]] == [m.indexes.tolist() for m, _ in seen[1]]
    assert sorted(_indexes(seen[0])) == list(range(24))
    for s in seen:
        _check_columns(s)
    assert tq.client().stats()["controller"]["rows_live"] == 0


def test_dp_by_mp_grid(tq: TransferQueue) -> None:
    _fill(tq, 32)
    grid = [
        {"dp_rank": d, "dp_size": 2, "mp_rank": m, "mp_size": 2} for d in (0, 1) for m in (0, 1)
    ]
    seen = _run_ranks(tq, grid)
    by_dp = {d: _indexes(seen[2 * d]) for d in (0, 1)}
    assert _indexes(seen[1]) == by_dp[0] and _indexes(seen[3]) == by_dp[1]  # MP peers alike
    assert not set(by_dp[0]) & set(by_dp[1])
    assert sorted(by_dp[0] + by_dp[1]) == list(range(32))


def test_a_batch_abandoned_before_its_ack_comes_back(tq: TransferQueue) -> None:
    _fill(tq, 8)
    client = tq.client()
    ds = StreamingDataset(client, "train", ["i"], 4, partition="train", lease_s=0.5)
    it = iter(ds)
    first = next(it)["i"].tolist()
    it.close()  # the consumer dies holding the batch: nothing acknowledged it
    again = StreamingDataset(client, "train", ["i"], 8, partition="train", timeout_s=10)
    got = [i for cols in again for i in cols["i"].tolist()]
    assert sorted(got) == list(range(8)) and set(first) <= set(got)


def test_manual_ack_and_dataloader(tq: TransferQueue) -> None:
    _fill(tq, 12)
    client = tq.client()
    ds = StreamingDataset(client, "train", ["ids", "i"], 4, partition="train", ack="manual")
    got = []
    for cols in DataLoader(ds, batch_size=None, num_workers=0):  # batches pass through as-is
        assert isinstance(cols["ids"], Ragged) and isinstance(cols["i"], torch.Tensor)
        got += cols["i"].tolist()
        ds.ack()
    assert got == list(range(12))
    assert client.stats()["controller"]["rows_live"] == 0
    _fill(tq, 8, partition="p2")
    ds2 = StreamingDataset(client, "train", ["i"], 4, partition="p2", ack="manual")
    it = iter(ds2)
    next(it)
    with pytest.raises(RuntimeError, match=r"call ack\(\) on every rank"):
        next(it)


def test_bad_rank_arguments_are_named() -> None:
    tq = transferqueue.start(num_units=1)
    try:
        with pytest.raises(ValueError, match=r"dp_rank=2 must be in \[0, dp_size=2\)"):
            StreamingDataset(tq.client(), "t", ["x"], 4, dp_rank=2, dp_size=2)
        with pytest.raises(ValueError, match="need a group="):
            StreamingDataset(tq.client(), "t", ["x"], 4, mp_rank=1, mp_size=2)
    finally:
        tq.close()


# -- separate processes over torch.distributed (gloo) -----------------------------------------
def _process_rank(address: str, init: str, rank: int, out: Any) -> None:
    import torch.distributed as dist

    from transferqueue.client.dataset import TorchGroup

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        with transferqueue.connect(address) as tq:
            ds = StreamingDataset(
                tq.client(), "train", ["i"], 4, partition="train", dp_rank=rank, dp_size=2,
                group=TorchGroup(), timeout_s=30,
            )  # fmt: skip
            out.put((rank, [cols["i"].tolist() for cols in ds]))
    finally:
        dist.destroy_process_group()


@pytest.mark.service
@pytest.mark.slow
def test_data_parallel_processes_over_torch_distributed(
    local_service: transferqueue.LocalService,
) -> None:
    with transferqueue.connect(local_service.address) as tq:
        tq.reset()
        _fill(tq, 26)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_process_rank,
                args=(local_service.address, f"tcp://127.0.0.1:{port}", r, out),
            )
            for r in range(2)
        ]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs)
        a = [i for b in results[0] for i in b]
        b = [i for b in results[1] for i in b]
        assert len(results[0]) == len(results[1]) == 4  # 26 rows = 3 x 8 + 2: four steps
        assert sorted(a + b) == list(range(26)) and not set(a) & set(b)
        assert tq.client().stats()["controller"]["rows_live"] == 0
