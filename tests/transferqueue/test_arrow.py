"""Arrow interop: Ragged and dense columns share memory with Arrow arrays both ways (checked
by buffer address), and ``get_data(format="arrow")`` returns a table on every deployment."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from transferqueue import Client, Ragged, TransferQueue
from transferqueue.arrow import (
    column_from_arrow,
    from_table,
    ragged_from_arrow,
    ragged_to_arrow,
    tensor_from_arrow,
    tensor_to_arrow,
    to_table,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _ragged(dtype: torch.dtype = torch.float32, inner: tuple[int, ...] = ()) -> Ragged:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, *inner, generator=gen).to(dtype) for n in (3, 0, 1, 0, 5)]
    r = Ragged.from_tensors(rows)
    if dtype.is_floating_point and r.values.numel() >= 2:
        r.values.view(-1)[0], r.values.view(-1)[1] = math.nan, -0.0  # bits must survive
    return r


# -- Ragged <-> list arrays --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float16, torch.float32])
def test_ragged_to_large_list_and_back_copies_nothing(dtype: torch.dtype) -> None:
    r = _ragged(dtype)
    arr = ragged_to_arrow(r)
    assert arr.type == pa.large_list(pa.from_numpy_dtype(r.values.numpy().dtype))
    assert arr.values.buffers()[1].address == r.values.data_ptr()  # values: same memory
    assert arr.buffers()[1].address == r.offsets.data_ptr()  # int64 offsets: same memory
    assert [len(x) for x in arr.to_pylist()] == r.lengths.tolist()
    back = ragged_from_arrow(arr)
    assert back == r  # bit-exact (NaN payload and -0.0 included)
    assert back.values.data_ptr() == r.values.data_ptr()
    assert back.offsets.data_ptr() == r.offsets.data_ptr()


def test_ragged_to_int32_list_converts_only_the_offsets() -> None:
    r = _ragged(torch.int32)
    arr = ragged_to_arrow(r, large=False)
    assert isinstance(arr, pa.ListArray) and arr.offsets.type == pa.int32()
    assert arr.values.buffers()[1].address == r.values.data_ptr()
    back = ragged_from_arrow(arr)
    assert back == r and back.values.data_ptr() == r.values.data_ptr()


def test_ragged_with_inner_shape_and_sliced_arrays() -> None:
    r = _ragged(torch.float32, inner=(3,))
    arr = ragged_to_arrow(r)
    assert arr.type == pa.large_list(pa.list_(pa.float32(), 3))
    assert ragged_from_arrow(arr) == r
    part = arr.slice(2, 3)  # rows 2..4: offsets do not start at 0 any more
    got = ragged_from_arrow(part)
    assert got == r.slice(2, 5)
    assert got.values.data_ptr() == r.values[int(r.offsets[2]) :].data_ptr()  # still a view


def test_arrow_built_lists_become_ragged_views() -> None:
    arr = pa.array([[1, 2, 3], [], [4]], type=pa.list_(pa.int64()))
    r = ragged_from_arrow(arr)
    assert r.lengths.tolist() == [3, 0, 1] and r.values.tolist() == [1, 2, 3, 4]
    assert r.values.data_ptr() == arr.values.buffers()[1].address
    chunked = pa.chunked_array([arr, arr])  # several chunks: concatenated (one copy)
    assert ragged_from_arrow(chunked).lengths.tolist() == [3, 0, 1, 3, 0, 1]
    empty = Ragged(torch.empty(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    assert ragged_from_arrow(ragged_to_arrow(empty)) == empty


def test_arrow_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="null rows"):
        ragged_from_arrow(pa.array([[1], None], type=pa.large_list(pa.int64())))
    with pytest.raises(ValueError, match="null values"):
        ragged_from_arrow(pa.array([[1, None]], type=pa.large_list(pa.int64())))
    with pytest.raises(TypeError, match="list or large_list"):
        ragged_from_arrow(pa.array([1, 2]))
    with pytest.raises(TypeError, match=r"bfloat16 has no Arrow type.*\.float\(\)"):
        ragged_to_arrow(_ragged(torch.bfloat16))
    with pytest.raises(TypeError, match=r"field 'h'.*bfloat16"):
        to_table({"h": torch.zeros(2, dtype=torch.bfloat16)})


# -- dense and object columns ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(6,), (6, 4), (6, 2, 3)], ids=["scalar", "vec", "mat"])
def test_dense_to_arrow_and_back_copies_nothing(shape: tuple[int, ...]) -> None:
    t = torch.randn(shape)
    arr = tensor_to_arrow(t)
    assert len(arr) == shape[0]
    child = arr
    while pa.types.is_fixed_size_list(child.type):
        child = child.values
    assert child.buffers()[1].address == t.data_ptr()
    back = tensor_from_arrow(arr)
    assert back.shape == t.shape and torch.equal(_bits(back), _bits(t))
    assert back.data_ptr() == t.data_ptr()


def test_table_of_every_kind_round_trips() -> None:
    cols = {
        "ids": _ragged(torch.int32),
        "score": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5]),
        "emb": torch.randn(5, 4),
        "ok": torch.tensor([True, False, True, True, False]),  # bool: Arrow packs bits (a copy)
        "answer": ["7", "ü", "", "x" * 100, "9"],
        "info": [{"a": 1}, {"a": 2}, {"a": 3}, {"a": 4}, {"a": 5}],
    }
    table = to_table(cols)
    assert table.num_rows == 5 and table.column_names == list(cols)
    assert table.schema.field("answer").type == pa.string()
    back = from_table(table)
    assert back["ids"] == cols["ids"]
    for f in ("score", "emb", "ok"):
        assert torch.equal(back[f], cols[f])
    assert back["answer"] == cols["answer"] and back["info"] == cols["info"]
    assert column_from_arrow(table.column("emb")).data_ptr() == cols["emb"].data_ptr()


# -- get_data(format="arrow") on every deployment ----------------------------------------------
def _put_mixed(client: Client) -> tuple[dict[str, object], object]:
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 1000, (n,), generator=gen, dtype=torch.int32) for n in (4, 0, 7, 2)]
    cols: dict[str, object] = {
        "ids": ids,
        "logp": [-torch.rand(len(i), generator=gen) for i in ids],
        "reward": torch.tensor([1.0, math.nan, -0.0, 3.0]),
        "answer": ["a", "bb", "", "ü"],
    }
    meta = client.put(cols, group=np.arange(4))
    return cols, meta


def test_get_data_as_arrow_table(client: Client) -> None:
    cols, meta = _put_mixed(client)
    assert len(set(meta.units.tolist())) == 2  # rows over both units: the gathering read path
    got = client.get_data(meta)
    table = client.get_data(meta, format="arrow")
    assert isinstance(table, pa.Table) and table.column_names == list(meta.fields)
    assert table.schema.field("ids").type == pa.large_list(pa.int32())
    assert table.schema.field("reward").type == pa.float32()
    back = from_table(table)
    assert back["ids"] == got["ids"] and back["logp"] == got["logp"]
    assert torch.equal(_bits(back["reward"]), _bits(cols["reward"]))  # type: ignore[arg-type]
    assert back["answer"] == cols["answer"]
    # the table is the result's memory, not a copy of it
    same = to_table(got)
    assert same.column("ids").chunk(0).values.buffers()[1].address == got["ids"].values.data_ptr()
    only = client.get_data(meta, ["reward"], format="arrow")
    assert only.column_names == ["reward"]


def test_async_get_data_as_arrow_table(tq: TransferQueue) -> None:
    async def main() -> pa.Table:
        ac = tq.async_client()
        meta = await ac.put({"x": torch.arange(6).view(3, 2), "t": [[1], [2, 3], []]})
        return await ac.get_data(meta, format="arrow")

    table = asyncio.run(main())
    assert table.column("x").to_pylist() == [[0, 1], [2, 3], [4, 5]]
    assert table.column("t").to_pylist() == [[1], [2, 3], []]


def test_unknown_format_is_a_clear_error(client: Client) -> None:
    meta = client.put({"x": torch.arange(3)})
    with pytest.raises(ValueError, match="format must be one of torch, arrow; got 'pandas'"):
        client.get_data(meta, format="pandas")  # type: ignore[call-overload]
