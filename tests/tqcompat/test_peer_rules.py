"""Where the peer's own tests pin a behaviour of its public API, the facade follows it: the
GRPO sampler's scan, ``BatchMeta``/``KVBatchMeta`` validations with the peer's exception types
and words, a missing checkpoint folder, micro-batches of a strided nested tensor (the module
paths users import: ``test_alias``) (``bench.peer --compat`` runs the peer's suite itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tensordict", reason="needs the compat extra")

from tensordict import NonTensorData, TensorDict

import tqcompat as tq
from tqcompat import BatchMeta, KVBatchMeta
from tqcompat.dataloader import chunk_batch_fn
from tqcompat.sampler import get_seqlen_balanced_partitions


@pytest.fixture
def store() -> Iterator[tq.TransferQueueClient]:
    tq.init()
    try:
        yield tq.get_client()
    finally:
        tq.close()


def _meta(n: int, start: int = 0, **extra: object) -> BatchMeta:
    schema = {"f": {"dtype": torch.float32, "shape": (2,), "is_nested": False}}
    return BatchMeta(
        list(range(start, start + n)), ["p"] * n, schema, np.ones(n, np.int8), dict(extra)
    )


def test_grpo_takes_runs_of_consecutive_sorted_ready_indexes() -> None:
    s = tq.GRPOGroupNSampler(n_samples_per_prompt=3)
    # [3, 4, 5] is a group although 3 is no multiple of 3; [0, 1] and [6, 7] are not
    assert s.sample([11, 0, 1, 3, 4, 5, 6, 7, 9, 10], 6) == ([3, 4, 5, 9, 10, 11],) * 2
    assert s.sample([0, 1, 3, 4, 6, 7], 6) == ([], [])
    with pytest.raises(ValueError, match="multiple of n_samples_per_prompt"):
        s.sample([0, 1, 2], 4)
    with pytest.raises(ValueError, match="must be positive"):
        tq.GRPOGroupNSampler(n_samples_per_prompt=0)
    # one rank's batch is handed again for the same (dp_rank, batch_index)
    first = s.sample([0, 1, 2], 3, "t", "p", dp_rank=0, batch_index=0)
    assert s.sample([6, 7, 8], 3, "t", "p", dp_rank=0, batch_index=0) == first
    assert s.sample([6, 7, 8], 3, "t", "p", dp_rank=0, batch_index=1) == ([6, 7, 8],) * 2


def test_union_with_an_empty_batch_is_a_copy_and_mismatches_are_named() -> None:
    batch = _meta(2, step=1)
    for got in (batch.union(BatchMeta.empty()), BatchMeta.empty().union(batch)):
        assert got is not batch and got.global_indexes == [0, 1] and got.field_names == ["f"]
        got.extra_info["new"] = 1
        assert "new" not in batch.extra_info
    other = BatchMeta([0, 1], ["p", "q"], {"g": {"dtype": torch.int64, "shape": (1,)}})
    with pytest.raises(ValueError, match="partition_ids do not match"):
        batch.union(other)
    with pytest.raises(ValueError, match="global_indexes do not match"):
        batch.union(_meta(2, start=5))


def test_concat_merges_extra_info_and_refuses_conflicting_values() -> None:
    t = torch.arange(3)
    merged = BatchMeta.concat([_meta(1, step=1, w=t), _meta(1, 1, step=1, w=t.clone(), lr=0.1)])
    assert merged.global_indexes == [0, 1] and merged.extra_info["lr"] == 0.1
    with pytest.raises(ValueError, match="'step' has conflicting values"):
        BatchMeta.concat([_meta(1, step=1), _meta(1, 1, step=2)])
    with pytest.raises(ValueError, match="'w' has conflicting values"):
        BatchMeta.concat([_meta(1, w=t), _meta(1, 1, w=t + 1)])


def test_batch_meta_reorder_validations() -> None:
    batch = _meta(3)
    with pytest.raises(ValueError, match="mismatch batch size"):
        batch.reorder([0, 1])
    with pytest.raises(ValueError, match="contain duplicates"):
        batch.reorder([0, 0, 1])
    batch.reorder([2, 0, 1])
    assert batch.global_indexes == [2, 0, 1]


def test_kv_batch_meta_validations_raise_the_peers_types() -> None:
    kv = KVBatchMeta(["a", "b", "c"], [{}, {}, {}], "p", ["x"], {"step": 1})
    with pytest.raises(ValueError, match="Contain duplicate keys"):
        kv.select_keys(["a", "a"])
    with pytest.raises(RuntimeError, match="not found in current batch"):
        kv.select_keys(["zz"])
    with pytest.raises(ValueError, match="does not match the batch size"):
        kv.reorder([0, 1])
    with pytest.raises(ValueError, match="Contain duplicate indexes"):
        kv.reorder([0, 0, 1])
    with pytest.raises(ValueError, match="Field names do not match"):
        KVBatchMeta.concat([kv, KVBatchMeta(["d"], [{}], "p", ["y"])])
    with pytest.raises(ValueError, match="Partition do not match"):
        KVBatchMeta.concat([kv, KVBatchMeta(["d"], [{}], "q", ["x"])])
    with pytest.raises(ValueError, match="'step' has conflicting values"):
        KVBatchMeta.concat([kv, KVBatchMeta(["d"], [{}], "p", ["x"], {"step": 2})])
    both = KVBatchMeta.concat([KVBatchMeta(), kv, KVBatchMeta(["d"], [{}], "p", ["x"])])
    assert both.keys == ["a", "b", "c", "d"] and both.extra_info == {"step": 1}


def test_load_checkpoint_of_a_missing_folder_is_file_not_found(
    store: tq.TransferQueueClient, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        tq.load_checkpoint(tmp_path / "nowhere")


def test_kv_misses_read_as_the_peer_reads_them(store: tq.TransferQueueClient) -> None:
    tq.kv_put("a", "p", fields={"x": torch.tensor([1])})
    assert tq.kv_list("empty") == {}
    for kind in (ValueError, tq.StorageKeyNotFoundError):  # the peer's type, and ours
        with pytest.raises(kind, match="not found"):
            tq.kv_batch_get("missing", "p")


def test_micro_batches_of_a_strided_nested_tensor() -> None:
    rows = [torch.arange(4).view(2, 2), torch.arange(6).view(3, 2), torch.ones(1, 2)]
    td = TensorDict(
        {"a": torch.nested.as_nested_tensor(rows, layout=torch.strided), "b": torch.arange(3)},
        batch_size=3,
    )
    parts = chunk_batch_fn(td, BatchMeta([0, 1, 2], ["p"] * 3), micro_batch_size=2)
    assert [p[0].batch_size[0] for p in parts] == [2, 1]
    assert [p[1].global_indexes for p in parts] == [[0, 1], [2]]
    got = [r for part, _ in parts for r in part["a"].unbind(0)]
    assert all(torch.equal(g, r) for g, r in zip(got, rows, strict=True))
    assert parts[1][0]["a"].is_nested and parts[0][0]["b"].tolist() == [0, 1]


def test_seqlen_balanced_partitions_are_our_balanced_split() -> None:
    parts = get_seqlen_balanced_partitions([100, 90, 50, 10, 5, 1], 2, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(6))
    assert [len(p) for p in parts] == [3, 3] and all(p == sorted(p) for p in parts)
    sums = [sum([100, 90, 50, 10, 5, 1][i] for i in p) for p in parts]
    assert abs(sums[0] - sums[1]) <= 100
    with pytest.raises(AssertionError):
        get_seqlen_balanced_partitions([1, 2, 3], 2, equal_size=True)
    with pytest.raises(AssertionError):
        get_seqlen_balanced_partitions([1], 3, equal_size=False)


def test_kv_puts_return_every_field_the_keys_hold(store: tq.TransferQueueClient) -> None:
    first = tq.kv_put("k", "p", fields=TensorDict({"a": torch.tensor([[1, 2]])}, batch_size=1))
    assert first.fields == ["a"]
    second = tq.kv_put("k", "p", fields=TensorDict({"b": torch.tensor([[3]])}, batch_size=1))
    assert sorted(second.fields or ()) == ["a", "b"]
    assert tq.kv_put("k", "p", tag={"s": 1}).fields == second.fields
    with pytest.raises(ValueError, match="select_fields not found"):
        tq.kv_batch_get_by_meta(second, select_fields=["a", "nope"])
    assert tq.kv_batch_get_by_meta(second, select_fields="b")["b"].tolist() == [[3]]


def test_a_partition_cleared_by_another_client_takes_new_shapes(
    store: tq.TransferQueueClient,
) -> None:
    tq.kv_put("k", "p", fields={"x": torch.tensor([1, 2, 3])})
    store.native_sync.clear("p")  # another client: this one's specs of "p" are stale
    tq.kv_put("k", "p", fields={"x": torch.tensor([1, 2, 3, 4])})
    assert tq.kv_batch_get("k", "p")["x"].tolist() == [[1, 2, 3, 4]]


def test_tags_only_puts_create_keys_that_get_fields_later(store: tq.TransferQueueClient) -> None:
    # verl's pattern: register prompts by tags, flip their status, write trajectories later
    meta = tq.kv_batch_put(["u1", "u2"], "train", tags=[{"status": "pending"}] * 2)
    assert (meta.keys, meta.fields) == (["u1", "u2"], [])
    tq.kv_put("u1", "train", tag={"status": "running"})
    assert tq.kv_list("train") == {
        "train": {"u1": {"status": "running"}, "u2": {"status": "pending"}}
    }
    done = tq.kv_put("u1", "train", fields={"ids": torch.tensor([1, 2, 3])})
    assert done.fields == ["ids"] and done.tags == [{"status": "running"}]
    assert tq.kv_batch_get("u1", "train")["ids"].tolist() == [[1, 2, 3]]
    tq.kv_clear(["u1", "u2"], "train")
    assert tq.kv_list("train") == {}


def test_numpy_strings_and_bytes_round_trip(store: tq.TransferQueueClient) -> None:
    cols = {"s": np.array([b"x", b"yz\x00"], dtype="S4"), "u": np.array(["é", "ab"])}
    tq.kv_batch_put(["a", "b"], "p", cols)
    got = tq.kv_batch_get(["b", "a"], "p")
    assert got["s"].tolist() == [b"yz", b"x"]  # (numpy's S drops trailing NULs)
    assert got["u"].tolist() == ["ab", "é"]


def test_numpy_arrays_in_a_tensordict_are_columns_of_rows(store: tq.TransferQueueClient) -> None:
    data = TensorDict(
        {
            "s": np.array([b"a", b"bc", b"d"], dtype="S4"),
            "o": np.array(["x", {"k": 1}, None], dtype=object),
            "f": torch.arange(3),
        },
        batch_size=3,
    )
    data["rows"] = NonTensorData(data=[{"i": 0}, {"i": 1}, {"i": 2}], batch_size=(3,))
    data["same"] = NonTensorData(data="all", batch_size=(3,))
    meta = store.put(data, partition_id="p")
    got = store.get_data(meta)
    assert got["s"].tolist() == [b"a", b"bc", b"d"]
    assert got["o"].tolist() == ["x", {"k": 1}, None]
    assert got["rows"].tolist() == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert got["same"].tolist() == ["all"] * 3


def test_production_status_of_what_the_store_does_not_know(
    store: tq.TransferQueueClient,
) -> None:
    assert store.get_production_status(["x"], "nowhere") == (None, None)
    store.put(TensorDict({"x": torch.ones(2, 1)}, batch_size=2), partition_id="p")
    assert store.check_production_status(["x"], "p")
    assert store.get_production_status(["never"], "p") == (None, None)
    store.clear_partition("p")
    assert not store.check_production_status(["x"], "p")


def test_insert_mode_allocates_rows_whose_fields_come_later(
    store: tq.TransferQueueClient,
) -> None:
    alloc = store.get_meta(["a", "b"], 4, "p", mode="insert", task_name="allocator")
    assert alloc.size == 4 and not alloc.is_ready
    with pytest.raises(TimeoutError):  # nothing is handed out before its fields are written
        store.get_meta(["a"], 1, "p", task_name="t")
    store.put(TensorDict({"a": torch.arange(2)}, batch_size=2), metadata=alloc[0:2])
    store.put(TensorDict({"a": torch.arange(2, 4)}, batch_size=2), metadata=alloc[2:4])
    assert store.check_production_status(["a"], "p")
    assert not store.check_production_status(["a", "b"], "p")  # b: never written
    got = store.get_meta(["a"], 4, "p", task_name="t")
    assert sorted(got.global_indexes) == sorted(alloc.global_indexes)
    assert sorted(store.get_data(got)["a"].tolist()) == [0, 1, 2, 3]
