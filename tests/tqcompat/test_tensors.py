"""TensorDict <-> our columns (tqcompat.tensors): jagged nested tensors go both ways over
their own buffers, bit for bit, the odd layouts included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tensordict", reason="needs the compat extra")  # the vLLM venv has no extras

from tensordict import TensorDict

from tqcompat.tensors import from_columns, schema_from_spec, schema_of, to_columns
from transferqueue import Ragged


def _rows() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(k, 2, generator=g) for k in (3, 0, 5, 1)]


def test_jagged_columns_share_the_buffers_both_ways() -> None:
    nt = torch.nested.as_nested_tensor(_rows(), layout=torch.jagged)
    cols, n = to_columns(TensorDict({"x": nt}, batch_size=4))
    col = cols["x"]
    assert n == 4 and isinstance(col, Ragged)
    assert col.values.data_ptr() == nt.values().data_ptr()  # put: no copy
    assert col.offsets.tolist() == [0, 3, 3, 8, 9]
    assert schema_of(cols)["x"]["per_sample_shapes"] == [(3, 2), (0, 2), (5, 2), (1, 2)]
    back = from_columns(cols, 4)["x"]
    assert back.is_nested and back.layout == torch.jagged
    assert back.values().data_ptr() == col.values.data_ptr()  # get: no copy
    assert torch.equal(back.offsets(), col.offsets)
    for got, want in zip(back.unbind(), _rows(), strict=True):
        assert torch.equal(got, want)


def test_a_jagged_tensor_with_holes_keeps_its_rows() -> None:
    values = torch.arange(10, dtype=torch.float32)
    offsets = torch.tensor([0, 4, 8, 10])
    lengths = torch.tensor([2, 3, 1])  # rows are values[0:2], values[4:7], values[8:9]
    nt = torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths)
    cols, _ = to_columns({"x": nt})
    col = cols["x"]
    assert isinstance(col, Ragged)
    assert col.offsets.tolist() == [0, 2, 5, 6]
    assert col.values.tolist() == [0.0, 1.0, 4.0, 5.0, 6.0, 8.0]


def test_rows_that_differ_beyond_the_first_axis_are_a_shaped_column() -> None:
    import transferqueue
    from transferqueue import Shaped

    g = torch.Generator().manual_seed(1)
    imgs = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
        for h, w in ((4, 6), (2, 9))
    ]
    cols, n = to_columns(TensorDict({"img": torch.nested.nested_tensor(imgs)}, batch_size=2))
    col = cols["img"]
    assert n == 2 and isinstance(col, Shaped) and col.shapes.tolist() == [[3, 4, 6], [3, 2, 9]]
    assert schema_of(cols)["img"]["per_sample_shapes"] == [(3, 4, 6), (3, 2, 9)]
    nt = torch.nested.nested_tensor(imgs)
    col = to_columns({"img": nt})[0]["img"]
    assert col.values.data_ptr() == nt.unbind()[0].data_ptr()  # put: over its buffer
    back = from_columns(cols, 2)["img"]
    assert back.is_nested and back.layout == torch.strided
    assert back.unbind()[1].data_ptr() == cols["img"].values[72:].data_ptr()  # get: views
    described = schema_from_spec(transferqueue.FieldSpec.shaped(torch.uint8, 3).describe())
    assert described == {
        "dtype": torch.uint8,
        "shape": None,
        "is_nested": True,
        "is_non_tensor": False,
    }
    assert all(torch.equal(a, b) for a, b in zip(back.unbind(), imgs, strict=True))


def test_a_strided_nested_tensor_of_one_inner_shape_is_ragged_over_its_buffer() -> None:
    rows = _rows()
    nt = torch.nested.nested_tensor(rows)  # strided layout
    col = to_columns({"x": nt})[0]["x"]
    assert isinstance(col, Ragged) and col.offsets.tolist() == [0, 3, 3, 8, 9]
    assert col.values.data_ptr() == nt.unbind()[0].data_ptr()
    back = from_columns({"x": col}, 4)["x"]
    assert back.layout == torch.jagged
    assert all(torch.equal(a, b) for a, b in zip(back.unbind(), rows, strict=True))
