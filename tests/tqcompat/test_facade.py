"""The ``transfer_queue`` facade (tqcompat) on a real embedded store: the peer's client calls,
TensorDict round trips, both consumption semantics, the KV calls and their async twins,
checkpoints, refused backends and samplers, and bad input."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tensordict", reason="needs the compat extra")  # the vLLM venv has no extras

from tensordict import NonTensorStack, TensorDict

import tqcompat as tq
import transferqueue
from tqcompat import BatchMeta


@pytest.fixture
def store() -> Iterator[tq.TransferQueueClient]:
    tq.init()
    try:
        yield tq.get_client()
    finally:
        tq.close()


def _batch(n: int = 4, start: int = 0) -> TensorDict:
    ids = torch.arange(start, start + 3 * n).view(n, 3)
    return TensorDict({"input_ids": ids, "mask": torch.ones_like(ids)}, batch_size=n)


def _awkward() -> TensorDict:
    rows = [torch.arange(k, dtype=torch.float32) * 0.5 for k in (3, 0, 5, 1)]
    return TensorDict(
        {
            "dense_bf16": torch.randn(4, 2, 3).to(torch.bfloat16),
            "nan": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),
            "jagged": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "strided": torch.nested.nested_tensor([torch.ones(k, 2) * k for k in (1, 2, 3, 4)]),
            "images": torch.nested.nested_tensor(  # rows of any shape: a shaped column
                [torch.full((3, 2 + k, 5 - k), k, dtype=torch.uint8) for k in range(4)]
            ),
            "text": NonTensorStack("a", "ünïcödé", "", "🙂"),
            "obj": NonTensorStack({"k": 1}, {"k": [1, 2]}, None, 3.5),
        },
        batch_size=4,
    )


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _INT_OF_SIZE[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def test_tensordict_round_trip_is_bit_exact(store: tq.TransferQueueClient) -> None:
    data = _awkward()
    put = store.put(data, partition_id="p")
    assert put.global_indexes == [0, 1, 2, 3] and put.is_ready
    assert put.field_schema["jagged"]["is_nested"]
    assert put.field_schema["jagged"]["per_sample_shapes"] == [(3,), (0,), (5,), (1,)]
    assert put.field_schema["text"]["is_non_tensor"]
    meta = store.get_meta(list(data.keys()), 4, "p", task_name="t")
    got = store.get_data(meta)
    assert got.batch_size == torch.Size([4])
    assert _same_bits(got["dense_bf16"], data["dense_bf16"])
    assert _same_bits(got["nan"], data["nan"])
    assert got["jagged"].is_nested and got["jagged"].layout == torch.jagged
    for a, b in zip(got["jagged"].unbind(), data["jagged"].unbind(), strict=True):
        assert _same_bits(a, b)
    for a, b in zip(got["strided"].unbind(), data["strided"].unbind(), strict=True):
        assert _same_bits(a, b)
    assert put.field_schema["images"]["per_sample_shapes"][3] == (3, 5, 2)
    for a, b in zip(got["images"].unbind(), data["images"].unbind(), strict=True):
        assert _same_bits(a, b)
    assert got["text"].tolist() == ["a", "ünïcödé", "", "🙂"]
    assert got["obj"].tolist() == [{"k": 1}, {"k": [1, 2]}, None, 3.5]


def test_rows_are_consumed_at_get_meta_by_default(store: tq.TransferQueueClient) -> None:
    store.put(_batch(6), partition_id="p")
    a1 = store.get_meta(["input_ids"], 3, "p", task_name="A")
    a2 = store.get_meta(["input_ids"], 3, "p", task_name="A")
    b1 = store.get_meta(["input_ids"], 2, "p", task_name="B")
    assert (a1.global_indexes, a2.global_indexes, b1.global_indexes) == (
        [0, 1, 2],
        [3, 4, 5],
        [0, 1],
    )
    with pytest.raises(TimeoutError, match="Required: 1"):
        store.get_meta(["input_ids"], 1, "p", task_name="A")  # consumed, never handed again
    idx, done = store.get_consumption_status("A", "p")
    assert idx is not None and done is not None
    assert idx.tolist() == list(range(6)) and done.tolist() == [1] * 6
    assert store.check_consumption_status("A", "p")
    assert not store.check_consumption_status("B", "p")
    # a short batch is never handed out: the rows go back to the task
    with pytest.raises(TimeoutError, match="Available: 4"):
        store.get_meta(["input_ids"], 5, "p", task_name="B")
    assert store.get_meta(["input_ids"], 4, "p", task_name="B").global_indexes == [2, 3, 4, 5]
    assert store.reset_consumption("p", "A")
    assert store.get_meta(["input_ids"], 6, "p", task_name="A").global_indexes == list(range(6))


def test_leases_are_an_opt_in() -> None:
    tq.init({"asyncflow": {"leases": True, "lease_s": 0.5}})
    try:
        c = tq.get_client()
        c.put(_batch(2), partition_id="p")
        lost = c.get_meta(["input_ids"], 2, "p", task_name="t")  # its consumer "dies"
        assert not c.check_consumption_status("t", "p")
        again = c.get_meta(["input_ids"], 2, "p", task_name="t")  # back after lease_s
        assert again.global_indexes == lost.global_indexes
        c.put(TensorDict({"reward": torch.tensor([1.0, 2.0])}, batch_size=2), metadata=again)
        assert c.check_consumption_status("t", "p")  # the put acknowledged the lease
        with pytest.raises(TimeoutError):
            c.get_meta(["input_ids"], 1, "p", task_name="t")
    finally:
        tq.close()


def test_polling_mode_returns_an_empty_batch() -> None:
    tq.init({"controller": {"polling_mode": True}})
    try:
        c = tq.get_client()
        c.put(_batch(1), partition_id="p")
        empty = c.get_meta(["input_ids"], 2, "p", task_name="t")
        assert empty.size == 0 and not empty.is_ready
        assert c.get_data(empty).batch_size == torch.Size([0])
        assert c.get_meta(["input_ids"], 1, "p", task_name="t").global_indexes == [0]
    finally:
        tq.close()


def test_put_with_metadata_adds_fields_and_meta_operations_read(
    store: tq.TransferQueueClient,
) -> None:
    m1 = store.put(_batch(2), partition_id="p")
    store.put(_batch(3, start=100), partition_id="p")
    m3 = store.put(TensorDict({"extra": torch.tensor([[7], [8]])}, batch_size=2), metadata=m1)
    assert m3.field_names == ["extra", "input_ids", "mask"]
    meta = store.get_meta(["input_ids", "extra"], 2, "p", task_name="t")
    assert meta.global_indexes == [0, 1]
    data = store.get_data(meta.select_fields(["extra"]))
    assert list(data.keys()) == ["extra"] and data["extra"].tolist() == [[7], [8]]
    all_meta = store.get_meta(["input_ids"], 5, "p", task_name="u")
    parts = all_meta.chunk(2)
    assert [p.global_indexes for p in parts] == [[0, 1, 2], [3, 4]]
    assert store.get_data(parts[1])["input_ids"][:, 0].tolist() == [103, 106]
    picked = all_meta.select_samples([4, 0])
    assert store.get_data(picked)["input_ids"][:, 0].tolist() == [106, 0]
    joined = BatchMeta.concat([parts[1], parts[0]])
    assert store.get_data(joined)["input_ids"][:, 0].tolist() == [103, 106, 0, 3, 100]
    all_meta.reorder([4, 3, 2, 1, 0])
    assert store.get_data(all_meta)["input_ids"][:, 0].tolist() == [106, 103, 100, 3, 0]
    assert store.get_partition_list() == ["p"]
    _, produced = store.get_production_status(["extra"], "p")
    assert produced is not None and produced.tolist() == [1, 1, 0, 0, 0]
    assert not store.check_production_status(["extra"], "p")
    store.clear_samples(parts[0])
    idx, _ = store.get_production_status(["input_ids"], "p")
    assert idx is not None and idx.tolist() == [3, 4]  # rows 0..2 freed
    store.clear_partition("p")
    assert store.get_partition_list() == []


def test_custom_meta_travels_with_the_rows(store: tq.TransferQueueClient) -> None:
    meta = store.put(_batch(2), partition_id="p")
    meta.update_custom_meta([{"uid": "a"}, {"uid": "b", "v": 1}])
    store.set_custom_meta(meta)
    got = store.get_meta(["mask"], 2, "p", task_name="t")
    assert got.get_all_custom_meta() == [{"uid": "a"}, {"uid": "b", "v": 1}]
    assert got.samples[1].custom_meta["v"] == 1


def test_custom_meta_is_read_when_first_used(store: tq.TransferQueueClient) -> None:
    """A blocking get_meta's batch reads its custom metadata on first use: its parts read
    the whole batch's, a put with an unread batch keeps the store's, a changed one writes."""
    meta = store.put(_batch(4), partition_id="p")
    meta.update_custom_meta([{"k": i} for i in range(4)])
    store.set_custom_meta(meta)
    got = store.get_meta(["mask"], 4, "p", task_name="t")
    assert not got.custom_meta_loaded
    first, second = got.chunk(2)
    store.put(TensorDict({"y": torch.zeros(2)}, batch_size=2), metadata=first)
    assert second.custom_meta == [{"k": 2}, {"k": 3}] and got.custom_meta_loaded
    first.update_custom_meta([{"k": 10}, {"k": 11}])
    store.put(TensorDict({"z": torch.zeros(2)}, batch_size=2), metadata=first)
    store.reset_consumption("p", "t")
    again = store.get_meta(["mask"], 4, "p", task_name="t")
    # pickled (a DataLoader worker's batch) with its metadata read: the loader stays here
    part = pickle.loads(pickle.dumps(again[1:3]))
    assert part.custom_meta_loaded and part.custom_meta == [{"k": 11}, {"k": 2}]
    assert again.custom_meta == [{"k": 10}, {"k": 11}, {"k": 2}, {"k": 3}]
    assert (
        again.custom_meta
        == store.run(store.async_get_meta(["mask"], 4, "p", "fetch", "u")).custom_meta
    )


def test_batch_meta_by_hand() -> None:
    schema = {"x": {"dtype": torch.int64, "shape": (4,), "is_nested": False}}
    a = BatchMeta([0, 1, 2], ["p"] * 3, schema)
    b = BatchMeta([0, 1, 2], ["p"] * 3, {"y": dict(schema["x"])}, np.ones(3))
    assert not a.is_ready and b.is_ready
    u = a.union(b)
    assert u.field_names == ["x", "y"] and not u.is_ready
    assert [len(c) for c in BatchMeta.concat([a, a]).chunk(4)] == [2, 2, 1, 1]
    assert BatchMeta.empty().size == 0
    assert a.samples[0].fields["x"]["shape"] == (4,)
    with pytest.raises(ValueError, match="Length mismatch"):
        BatchMeta([0, 1], ["p"])
    with pytest.raises(ValueError, match="same rows"):
        a.union(BatchMeta([5], ["p"]))
    tq.init()
    try:
        with pytest.raises(ValueError, match="built by hand"):
            tq.get_client().get_data(a)
    finally:
        tq.close()


def test_kv_retrieve_meta_and_keys(store: tq.TransferQueueClient) -> None:
    tq.kv_batch_put(["a", "b"], "T", TensorDict({"ids": torch.tensor([[1], [2]])}, batch_size=2))
    tq.kv_put("b", "T", tag={"step": 3})
    meta = store.kv_retrieve_meta(["b", "a"], "T")
    assert meta.field_names == ["ids"] and meta.custom_meta == [{"step": 3}, {}]
    assert store.get_data(meta)["ids"].view(-1).tolist() == [2, 1]
    assert store.kv_retrieve_keys(meta.global_indexes, "T") == ["b", "a"]
    assert store.kv_retrieve_keys(meta.global_indexes[1], "T") == ["a"]
    one = store.run(store.async_kv_retrieve_meta("a", "T"))
    assert one.global_indexes == meta.global_indexes[1:]
    assert store.run(store.async_kv_retrieve_keys(one.global_indexes, "T")) == ["a"]
    put = store.put(TensorDict({"ids": torch.tensor([[9]])}, batch_size=1), partition_id="T")
    with pytest.raises(RuntimeError, match="no corresponding keys"):
        store.kv_retrieve_keys(put.global_indexes, "T")
    with pytest.raises(tq.StorageKeyNotFoundError):
        store.kv_retrieve_meta(["nope"], "T")
    with pytest.raises(NotImplementedError, match="kv_batch_put"):
        store.kv_retrieve_meta(["c"], "T", create=True)
    with pytest.raises(ValueError, match="empty list"):
        store.kv_retrieve_keys([], "T")
    with pytest.raises(TypeError, match="string"):
        store.kv_retrieve_meta([1], "T")  # type: ignore[list-item]


def test_kv_calls_and_their_async_twins(store: tq.TransferQueueClient) -> None:
    kv = tq.kv_put("0_0", "Train", fields={"ids": torch.tensor([1, 2, 3])}, tag={"step": 0})
    assert (kv.keys, kv.tags, kv.fields) == (["0_0"], [{"step": 0}], ["ids"])
    tq.kv_batch_put(
        ["1_0", "1_1"],
        "Train",
        TensorDict({"ids": torch.tensor([[4, 5, 6], [7, 8, 9]])}, batch_size=2),
        tags=[{"step": 1}, {"step": 1}],
    )
    tq.kv_put("0_0", "Train", tag={"step": 0, "status": "finish"})  # tag only
    assert tq.kv_list() == {
        "Train": {"0_0": {"step": 0, "status": "finish"}, "1_0": {"step": 1}, "1_1": {"step": 1}}
    }
    got = tq.kv_batch_get(["1_1", "0_0"], "Train", select_fields="ids")
    assert got["ids"].tolist() == [[7, 8, 9], [1, 2, 3]]
    tq.kv_clear(["0_0"], "Train")
    assert list(tq.kv_list("Train")["Train"]) == ["1_0", "1_1"]
    with pytest.raises(tq.StorageKeyNotFoundError):
        tq.kv_batch_get(["0_0"], "Train")

    async def twins() -> None:
        meta = await tq.async_kv_batch_put(
            ["a", "b"],
            "Val",
            TensorDict({"s": NonTensorStack("x", "y")}, batch_size=2),
            tags=[{}, {"t": 1}],
        )
        assert (await tq.async_kv_batch_get_by_meta(meta))["s"].tolist() == ["x", "y"]
        await tq.async_kv_put("c", "Val", {"s": "z"})
        assert (await tq.async_kv_batch_get("c", "Val"))["s"].tolist() == ["z"]
        assert list((await tq.async_kv_list("Val"))["Val"]) == ["a", "b", "c"]
        await tq.async_kv_clear("a", "Val")
        assert list((await tq.async_kv_list("Val"))["Val"]) == ["b", "c"]

    asyncio.run(twins())
    assert tq.kv_batch_get_by_meta(tq.KVBatchMeta(["b"], [{}], "Val"))["s"].tolist() == ["y"]


def test_async_client_calls(store: tq.TransferQueueClient) -> None:
    async def flow() -> None:
        await store.async_put(_batch(2), partition_id="p")
        meta = await store.async_get_meta(["mask"], 2, "p", task_name="t")
        data = await store.async_get_data(meta)
        assert data["mask"].tolist() == [[1, 1, 1]] * 2
        assert await store.async_check_consumption_status("t", "p")

    asyncio.run(flow())


def test_a_dtype_differing_from_the_field_is_cast_only_when_exact(
    store: tq.TransferQueueClient,
) -> None:
    tq.kv_put("a", "p", fields={"m": torch.ones(3)})  # float32 field
    tq.kv_put("b", "p", fields={"m": torch.ones(3, dtype=torch.int64)})  # exact: stored
    assert tq.kv_batch_get(["b"], "p")["m"].dtype == torch.float32
    with pytest.raises(transferqueue.SchemaError, match="'m'"):
        tq.kv_put("c", "p", fields={"m": torch.full((3,), 2**25 + 1, dtype=torch.int64)})


def test_rows_of_a_new_shape_widen_the_field_and_read_back_jagged(
    store: tq.TransferQueueClient, tmp_path: Path
) -> None:
    """The peer keeps a shape per row: ``kv_put`` of ``x`` ``[1, i]`` for i = 1, 2, 3 in one
    partition reads back as the jagged nested tensor of those rows, bit for bit (the facade
    widens our dense field to a shaped one), and so after a checkpoint's round trip."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(i, generator=g) for i in (1, 2, 3)]
    keys = [f"k{i}" for i in range(3)]
    for key, row in zip(keys, rows, strict=True):
        tq.kv_put(key, "p", fields=TensorDict({"x": row.unsqueeze(0)}, batch_size=1))

    def check() -> None:
        got = tq.kv_batch_get(keys, "p")["x"]
        assert got.is_nested and got.layout == torch.jagged
        for a, b in zip(got.unbind(), rows, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))

    check()
    tq.save_checkpoint(tmp_path / "ckpt")
    tq.close()
    tq.init()
    tq.load_checkpoint(tmp_path / "ckpt")
    check()


def test_checkpoint_save_and_load(store: tq.TransferQueueClient, tmp_path: Path) -> None:
    store.put(_batch(3), partition_id="p")
    store.get_meta(["mask"], 1, "p", task_name="t")
    tq.save_checkpoint(tmp_path / "ckpt")
    tq.close()
    tq.init()
    tq.load_checkpoint(tmp_path / "ckpt")
    c = tq.get_client()
    meta = c.get_meta(["mask"], 2, "p", task_name="t")  # row 0 stays consumed
    assert meta.global_indexes == [1, 2]
    every = c.get_meta(["input_ids", "mask"], 3, "p", task_name="u")
    assert c.get_data(every)["input_ids"].tolist() == _batch(3)["input_ids"].tolist()


@pytest.mark.parametrize("backend", ["MooncakeStore", "Yuanrong", "RayStore", "Nope"])
def test_backends_we_do_not_have_are_refused_at_init(backend: str) -> None:
    with pytest.raises(NotImplementedError, match=f"{backend}.*SimpleStorage"):
        tq.init({"backend": {"storage_backend": backend}})
    with pytest.raises(RuntimeError, match="init"):
        tq.get_client()  # nothing started


class _WithReplacement(tq.BaseSampler):
    """A user sampler as the peer's tutorial writes one: the highest ``score`` first, and
    nothing consumed (rows may come again)."""

    def sample(self, ready_indexes, batch_size, *args, scores=None, **kwargs):  # type: ignore[no-untyped-def]
        self._states["calls"] = self._states.get("calls", 0) + 1
        ranked = sorted(ready_indexes, key=lambda i: -scores[i])
        return ranked[:batch_size], ([ranked[0]] if kwargs.get("consume_best") else [])


def test_a_user_sampler_runs_as_given() -> None:
    sampler = _WithReplacement()
    tq.init({"controller": {"sampler": sampler}})
    try:
        c = tq.get_client()
        c.put(TensorDict({"x": torch.arange(5).view(5, 1)}, batch_size=5), partition_id="p")
        scores = np.array([0.1, 5.0, 0.2, 9.0, 1.0])
        cfg = {"scores": scores}
        first = c.get_meta(["x"], 2, "p", task_name="t", sampling_config=cfg)
        assert first.global_indexes == [3, 1]
        assert c.get_data(first)["x"].view(-1).tolist() == [3, 1]
        again = c.get_meta(["x"], 2, "p", task_name="t", sampling_config=cfg)
        assert again.global_indexes == [3, 1]  # sampled, not consumed: sampled again
        best = c.get_meta(["x"], 1, "p", task_name="t", sampling_config={**cfg, "consume_best": 1})
        assert best.global_indexes == [3]
        after = c.get_meta(["x"], 2, "p", task_name="t", sampling_config=cfg)
        assert after.global_indexes == [1, 4]  # 3 was consumed
        _, done = c.get_consumption_status("t", "p")
        assert done is not None and done.tolist() == [0, 0, 0, 1, 0]
        c.put(TensorDict({"x": torch.tensor([[5]])}, batch_size=1), partition_id="p")
        scores = np.append(scores, 99.0)
        assert c.get_meta(
            ["x"], 1, "p", task_name="t", sampling_config={"scores": scores}
        ).global_indexes == [5]
        with pytest.raises(TimeoutError, match="Required: 9"):
            c.get_meta(["x"], 9, "p", task_name="t", sampling_config=cfg)
        assert sampler._states["calls"] == 5  # one instance, in this process
    finally:
        tq.close()


def test_grpo_sampler_hands_out_whole_groups() -> None:
    tq.init({"controller": {"sampler": tq.GRPOGroupNSampler(n_samples_per_prompt=2)}})
    try:
        c = tq.get_client()
        c.put(TensorDict({"x": torch.arange(3).view(3, 1)}, batch_size=3), partition_id="p")
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [0, 1]
        with pytest.raises(TimeoutError):  # row 2's group is not complete
            c.get_meta(["x"], 2, "p", task_name="t")
        c.put(TensorDict({"x": torch.tensor([[3]])}, batch_size=1), partition_id="p")
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [2, 3]
    finally:
        tq.close()


def test_samplers_we_do_not_serve_are_refused_at_init() -> None:
    for sampler in ("SeqlenBalancedSampler", tq.SeqlenBalancedSampler()):
        with pytest.raises(NotImplementedError, match="not served"):
            tq.init({"controller": {"sampler": sampler}})
    with pytest.raises(ValueError, match="Could not find sampler"):
        tq.init({"controller": {"sampler": "Bogus"}})
    tq.init({"controller": {"sampler": tq.SequentialSampler()}})
    tq.close()


def test_bad_input_gives_the_peers_errors(store: tq.TransferQueueClient) -> None:
    with pytest.raises(ValueError, match="task_name"):
        store.get_meta(["x"], 1, "p")
    with pytest.raises(ValueError, match="batch_size"):
        store.get_meta(["x"], 0, "p", task_name="t")
    with pytest.raises(ValueError, match="data_fields"):
        store.get_meta([], 1, "p", task_name="t")
    with pytest.raises(ValueError, match="batch_size"):
        store.get_meta(["x"], 0, "p", mode="insert")
    with pytest.raises(ValueError, match="Invalid mode"):
        store.get_meta(["x"], 1, "p", mode="peek", task_name="t")
    with pytest.raises(ValueError, match=r"batch_size \[B\]"):
        store.put(TensorDict({"x": torch.ones(2, 3)}, batch_size=[2, 3]), partition_id="p")
    with pytest.raises(ValueError, match="partition_id"):
        store.put(_batch(1))
    with pytest.raises(TimeoutError):  # an unknown partition: nothing to hand out, bounded
        store.get_meta(["x"], 1, "nowhere", task_name="t")


def test_streaming_dataloader_with_two_ranks(store: tq.TransferQueueClient) -> None:
    conf = tq.init()  # (already initialized: the peer returns what it is given)
    store.put(TensorDict({"idx": torch.arange(10).view(10, 1)}, batch_size=10), partition_id="p")

    def loader(rank: int) -> tq.StreamingDataLoader:
        dataset = tq.StreamingDataset(
            config=conf,
            batch_size=4,
            micro_batch_size=2,
            data_fields=["idx"],
            partition_id="p",
            task_name="train",
            dp_rank=rank,
            should_check_consumption_status=True,
        )
        dataset._sleep_s = 0.05
        return tq.StreamingDataLoader(dataset, num_workers=0)

    store.put(TensorDict({"idx": torch.arange(10, 12).view(2, 1)}, batch_size=2), partition_id="p")
    ranks = [iter(loader(0)), iter(loader(1))]
    seen: dict[int, list[int]] = {0: [], 1: []}
    for rank in (0, 1, 0):
        for _ in range(2):  # a batch of 4 rows is 2 micro-batches of 2
            batch, meta = next(ranks[rank])
            assert batch.batch_size == torch.Size([2]) and meta.size == 2
            assert batch["idx"].view(-1).tolist() == meta.global_indexes
            seen[rank] += meta.global_indexes
    assert sorted(seen[0] + seen[1]) == list(range(12))  # every row once, across the ranks
    assert not set(seen[0]) & set(seen[1])
    with pytest.raises(StopIteration):  # every row consumed: the finite mode ends
        next(ranks[1])


def test_rank_aware_sampler_gives_a_groups_ranks_the_same_rows() -> None:
    """Ranks of one dp_rank get the same rows for each batch_index, whoever asks first; two
    groups never the same row."""
    tq.init({"controller": {"sampler": tq.RankAwareSampler, "polling_mode": True}})
    try:
        conf = tq.init()
        ranks = {}
        for rank, dp in ((0, 0), (1, 0), (2, 1), (3, 1)):
            dataset = tq.StreamingDataset(conf, 2, 2, ["idx"], "p", "train", dp_rank=dp)
            dataset._sleep_s = 0.05
            ranks[(rank, dp)] = iter(tq.StreamingDataLoader(dataset))
        c = tq.get_client()
        c.put(TensorDict({"idx": torch.arange(8).view(8, 1)}, batch_size=8), partition_id="p")
        seen: dict[tuple[int, int], list[list[int]]] = {key: [] for key in ranks}
        for order in ([(0, 0), (2, 1), (1, 0), (3, 1)], [(3, 1), (1, 0), (0, 0), (2, 1)]):
            for key in order:
                batch, meta = next(ranks[key])
                assert batch["idx"].view(-1).tolist() == meta.global_indexes
                seen[key].append(meta.global_indexes)
        assert seen[(0, 0)] == seen[(1, 0)] and seen[(2, 1)] == seen[(3, 1)]
        group0 = {i for b in seen[(0, 0)] for i in b}
        group1 = {i for b in seen[(2, 1)] for i in b}
        assert len(group0) == len(group1) == 4 and not group0 & group1
        with pytest.raises(ValueError, match="dp_rank"):  # the claim needs the group's name
            c.get_meta(["idx"], 2, "p", task_name="train", sampling_config={})
    finally:
        tq.close()


def test_a_merged_config_shares_no_dict_with_the_defaults() -> None:
    """An init on Ray writes its store's address into the merged config; it must not land in
    the defaults (a later embedded store took that stale address for its own, and
    DataLoader workers were let connect to a store long gone)."""
    from tqcompat import interface

    merged = interface._merge(interface._DEFAULTS, {})
    merged["asyncflow"]["address"] = "tcp://127.0.0.1:1"
    assert interface._DEFAULTS["asyncflow"]["address"] is None


def test_dataloader_workers_need_a_store_they_can_reach(store: tq.TransferQueueClient) -> None:
    dataset = tq.StreamingDataset(tq.init(), 1, 1, ["x"], "p", "t", dp_rank=0)
    # refused when the loader is built, before a worker is forked from this threaded process
    with pytest.raises(RuntimeError, match="num_workers=0"):
        tq.StreamingDataLoader(dataset, num_workers=1)
