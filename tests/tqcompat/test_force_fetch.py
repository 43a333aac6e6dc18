"""The peer's ``get_meta(mode="force_fetch")`` on the facade: every live row of a partition at
once, consumed or not, ready or not, without touching any task's consumption."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("tensordict", reason="needs the compat extra")  # the vLLM venv has no extras

from tensordict import TensorDict

import tqcompat as tq


@pytest.fixture
def store() -> Iterator[tq.TransferQueueClient]:
    tq.init()
    try:
        yield tq.get_client()
    finally:
        tq.close()


def _batch(n: int) -> TensorDict:
    ids = torch.arange(3 * n).view(n, 3)
    rows = [torch.arange(k, dtype=torch.float32) for k in range(1, n + 1)]
    return TensorDict(
        {"input_ids": ids, "seq": torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
        batch_size=n,
    )


def test_force_fetch_returns_every_row_and_leaves_consumption_alone(
    store: tq.TransferQueueClient,
) -> None:
    store.put(_batch(5), partition_id="p")
    taken = store.get_meta(["input_ids"], 2, "p", task_name="A")  # rows 0, 1 consumed by A
    assert taken.global_indexes == [0, 1]
    before = store.get_consumption_status("A", "p")[1]
    assert before is not None

    # batch_size and task_name play no part: all five rows, the consumed ones included
    t0 = time.monotonic()
    meta = store.get_meta(["input_ids", "seq"], 1, "p", mode="force_fetch")
    assert time.monotonic() - t0 < 0.5  # no wait for a full batch
    assert meta.global_indexes == [0, 1, 2, 3, 4]
    assert meta.is_ready and meta.production_status.tolist() == [1] * 5
    assert sorted(meta.field_names) == ["input_ids", "seq"]

    after = store.get_consumption_status("A", "p")[1]
    assert after is not None and after.tolist() == before.tolist() == [1, 1, 0, 0, 0]
    assert store.get_meta(["input_ids"], 3, "p", task_name="A").global_indexes == [2, 3, 4]
    # a task that never asked still gets every row: force_fetch consumed nothing for it
    assert store.get_meta(["input_ids"], 5, "p", task_name="B").global_indexes == list(range(5))

    data = store.get_data(meta)
    want = _batch(5)
    assert torch.equal(data["input_ids"], want["input_ids"])
    for got, exp in zip(data["seq"].unbind(), want["seq"].unbind(), strict=True):
        assert torch.equal(got, exp)


def test_force_fetch_reports_rows_not_yet_produced(store: tq.TransferQueueClient) -> None:
    first = store.put(_batch(4), partition_id="p")
    store.put(
        TensorDict({"reward": torch.tensor([0.5, -1.0])}, batch_size=2),
        metadata=first.select_samples([1, 3]),
    )
    meta = store.get_meta(["input_ids", "reward"], 4, "p", mode="force_fetch")
    assert meta.global_indexes == [0, 1, 2, 3]
    assert meta.production_status.tolist() == [0, 1, 0, 1] and not meta.is_ready
    ready = meta.select_samples([i for i, s in enumerate(meta.production_status) if s])
    assert store.get_data(ready)["reward"].tolist() == [0.5, -1.0]
    # a field nobody wrote: every row is unready, the batch still comes back at once
    none = store.get_meta(["input_ids", "never"], 1, "p", mode="force_fetch")
    assert none.production_status.tolist() == [0] * 4 and "never" not in none.field_names


def test_force_fetch_async_twin_and_empty_partition(store: tq.TransferQueueClient) -> None:
    store.put(_batch(3), partition_id="p")

    async def twin() -> list[int]:
        meta = await store.async_get_meta(["seq"], 2, "p", mode="force_fetch")
        return meta.global_indexes

    assert asyncio.run(twin()) == [0, 1, 2]
    store.clear_partition("p")
    store.put(_batch(1), partition_id="q")
    with pytest.raises(ValueError, match="nowhere"):  # an unknown partition, as the peer
        store.get_meta(["seq"], 1, "nowhere", mode="force_fetch")
