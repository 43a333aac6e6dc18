"""Columns to and from Apache Arrow (``pyarrow``), sharing memory wherever the layouts agree.

:class:`~transferqueue.Ragged` is Arrow's list layout already (values + int64 offsets), so a
ragged column becomes a ``LargeListArray`` whose buffers *are* the tensors' memory, and comes
back the same way. Dense columns are primitive arrays (one value per row) or fixed-size lists
(a tensor per row), again over the tensor's memory. Object columns are converted value by
value (``pa.array``). ``client.get_data(meta, format="arrow")`` returns a ``pyarrow.Table``
built this way.

| column                          | Arrow type                                   | copies        |
|---------------------------------|----------------------------------------------|---------------|
| ``Ragged`` values [N], int64 offsets | ``large_list<T>``                       | none          |
| the same, ``large=False``       | ``list<T>`` (int32 offsets)                  | offsets only  |
| ``Ragged`` values [N, d]        | ``large_list<fixed_size_list<T, d>>``        | none          |
| ``Shaped`` values [N], shapes [B, k] | ``struct<values: large_list<T>,``  | none          |
|                                 | ``shape: fixed_size_list<int64, k>>``        |               |
| dense [B]                       | ``T``                                        | none          |
| dense [B, d1, d2]               | ``fixed_size_list<fixed_size_list<T, d2>, d1>`` | none       |
| bool (Arrow packs bits)         | ``bool``                                     | one, to bits  |
| object (list)                   | what ``pa.array`` infers                     | per value     |

``bfloat16``, the fp8 types and complex have no Arrow type: such columns raise a
``TypeError`` that says to convert them first (:func:`has_arrow_type` tells which do).
Tensors off the CPU are copied to it. What comes *from* Arrow shares Arrow's buffers, which
Arrow holds immutable (and which may be a read-only memory map): clone a tensor before
writing into it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from transferqueue.ragged import Ragged
from transferqueue.schema import Column
from transferqueue.shaped import Shaped

__all__ = [
    "column_from_arrow",
    "column_to_arrow",
    "from_table",
    "has_arrow_type",
    "ragged_from_arrow",
    "ragged_to_arrow",
    "shaped_from_arrow",
    "shaped_to_arrow",
    "tensor_from_arrow",
    "tensor_to_arrow",
    "to_table",
]

_TO_ARROW: dict[torch.dtype, pa.DataType] = {
    torch.uint8: pa.uint8(),
    torch.uint16: pa.uint16(),
    torch.uint32: pa.uint32(),
    torch.uint64: pa.uint64(),
    torch.int8: pa.int8(),
    torch.int16: pa.int16(),
    torch.int32: pa.int32(),
    torch.int64: pa.int64(),
    torch.float16: pa.float16(),
    torch.float32: pa.float32(),
    torch.float64: pa.float64(),
}
_FROM_ARROW: dict[pa.DataType, torch.dtype] = {v: k for k, v in _TO_ARROW.items()}


def has_arrow_type(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` have an Arrow type (else they raise ``TypeError``)."""
    return dtype == torch.bool or dtype in _TO_ARROW


# -- tensors -----------------------------------------------------------------------------------
def _host(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype == torch.bfloat16:
        raise TypeError(
            f"{what}: bfloat16 has no Arrow type; convert first, e.g. .float() "
            "(or .view(torch.int16) to keep the bits)"
        )
    if t.dtype != torch.bool and t.dtype not in _TO_ARROW:
        raise TypeError(
            f"{what}: dtype {t.dtype} has no Arrow type; convert first, or view the bits as "
            "an integer dtype of the same width (e.g. .view(torch.uint8) for fp8)"
        )
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _flat_array(t: torch.Tensor) -> pa.Array:
    """The elements of a contiguous host tensor as one primitive array over its memory."""
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:  # Arrow packs booleans into bits: one copy
        return pa.array(flat.numpy(), type=pa.bool_())
    # py_buffer keeps the numpy array (and through it the tensor) alive: no copy
    buf = pa.py_buffer(flat.numpy())
    return pa.Array.from_buffers(_TO_ARROW[flat.dtype], flat.numel(), [None, buf])


def _wrap_fixed(values: pa.Array, inner: Sequence[int]) -> pa.Array:
    """Group ``values`` into nested fixed-size lists of the inner shape (last axis innermost)."""
    for d in reversed(inner):
        values = pa.FixedSizeListArray.from_arrays(values, int(d))
    return values


def tensor_to_arrow(t: torch.Tensor) -> pa.Array:
    """A dense column [B, *shape] as an Arrow array of B rows: primitive for ``shape == ()``,
    nested fixed-size lists otherwise; over the tensor's memory (bool: one copy)."""
    if t.dim() == 0:
        raise ValueError("a dense column needs a row axis; got a 0-d tensor")
    t = _host(t, "dense column")
    return _wrap_fixed(_flat_array(t), t.shape[1:])


def _unwrap_fixed(arr: pa.Array) -> tuple[pa.Array, tuple[int, ...]]:
    """(primitive child, inner shape) of nested fixed-size lists, slices resolved."""
    inner: list[int] = []
    while pa.types.is_fixed_size_list(arr.type):
        if arr.null_count:
            raise ValueError("Arrow column has null rows; TransferQueue columns have none")
        size = arr.type.list_size
        inner.append(size)
        arr = arr.values.slice(arr.offset * size, len(arr) * size)
    return arr, tuple(inner)


def _primitive_tensor(arr: pa.Array) -> torch.Tensor:
    """A 1-D tensor over a primitive array's data buffer (bool: one copy)."""
    if arr.null_count:
        raise ValueError("Arrow column has null values; TransferQueue columns have none")
    if pa.types.is_boolean(arr.type):
        return torch.from_numpy(arr.to_numpy(zero_copy_only=False).copy())
    dtype = _FROM_ARROW.get(arr.type)
    if dtype is None:
        raise TypeError(
            f"Arrow type {arr.type} has no tensor dtype; known: {', '.join(map(str, _FROM_ARROW))}"
        )
    data = arr.buffers()[1]
    np_dtype = np.dtype(arr.type.to_pandas_dtype())
    if len(arr) == 0:
        return torch.empty(0, dtype=dtype)
    view = np.frombuffer(
        data, dtype=np_dtype, count=len(arr), offset=arr.offset * np_dtype.itemsize
    )
    with warnings.catch_warnings():
        # Arrow buffers are immutable: the tensor is a read-only view (see the module doc).
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(view)


def tensor_from_arrow(arr: pa.Array | pa.ChunkedArray) -> torch.Tensor:
    """A dense column from a primitive or fixed-size-list array, sharing its buffer."""
    arr = _one_chunk(arr)
    child, inner = _unwrap_fixed(arr)
    flat = _primitive_tensor(child)
    return flat.view(len(arr), *inner)


# -- ragged ------------------------------------------------------------------------------------
def ragged_to_arrow(r: Ragged, *, large: bool = True) -> pa.LargeListArray | pa.ListArray:
    """``large_list`` over the Ragged's own values and offsets (no copy); ``large=False``
    gives a ``list`` array with int32 offsets (the offsets are converted, not the values)."""
    values = _host(r.values, "ragged column")
    child = _wrap_fixed(_flat_array(values), values.shape[1:])
    offsets = r.offsets if r.offsets.device.type == "cpu" else r.offsets.cpu()
    offsets = offsets if offsets.is_contiguous() else offsets.contiguous()
    if large:
        off = pa.Array.from_buffers(
            pa.int64(), offsets.numel(), [None, pa.py_buffer(offsets.numpy())]
        )
        return pa.LargeListArray.from_arrays(off, child)
    if int(offsets[-1]) > np.iinfo(np.int32).max:
        raise ValueError(
            f"ragged column has {int(offsets[-1])} elements, more than int32 offsets hold; "
            "use large=True"
        )
    return pa.ListArray.from_arrays(pa.array(offsets.numpy().astype(np.int32)), child)


def ragged_from_arrow(arr: pa.Array | pa.ChunkedArray) -> Ragged:
    """A Ragged over a list / large-list array's value buffer (no copy of the values; the
    offsets are copied when they are int32 or do not start at 0)."""
    arr = _one_chunk(arr)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise TypeError(f"expected an Arrow list or large_list array, got {arr.type}")
    if arr.null_count:
        raise ValueError("Arrow list column has null rows; a Ragged has none (fill them first)")
    n = len(arr)
    off_dtype = np.int64 if pa.types.is_large_list(arr.type) else np.int32
    off_buf = arr.buffers()[1]
    offsets = (
        np.frombuffer(
            off_buf, dtype=off_dtype, count=n + 1, offset=arr.offset * np.dtype(off_dtype).itemsize
        )
        if off_buf is not None
        else np.zeros(1, dtype=off_dtype)
    )
    start, stop = int(offsets[0]), int(offsets[-1])
    child, inner = _unwrap_fixed(arr.values)
    width = int(np.prod(inner, dtype=np.int64)) if inner else 1
    values = _primitive_tensor(child.slice(start * width, (stop - start) * width))
    values = values.view(stop - start, *inner)
    if start == 0 and off_dtype == np.int64:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            off_t = torch.from_numpy(offsets)
    else:
        off_t = torch.from_numpy(offsets.astype(np.int64) - start)
    return Ragged(values, off_t)


# -- shaped ------------------------------------------------------------------------------------
def shaped_to_arrow(r: Shaped, *, large: bool = True) -> pa.StructArray:
    """``struct<values: large_list<T>, shape: fixed_size_list<int64, ndim>>`` over the
    column's own values, offsets and shapes (no copy)."""
    values = ragged_to_arrow(r, large=large)
    shapes = r.shapes.contiguous()
    flat = pa.Array.from_buffers(pa.int64(), shapes.numel(), [None, pa.py_buffer(shapes.numpy())])
    shape = pa.FixedSizeListArray.from_arrays(flat, r.ndim)
    return pa.StructArray.from_arrays([values, shape], names=["values", "shape"])


def _is_shaped(t: pa.DataType) -> bool:
    if not pa.types.is_struct(t) or [t.field(i).name for i in range(t.num_fields)] != [
        "values",
        "shape",
    ]:
        return False
    shape = t.field(1).type
    return pa.types.is_fixed_size_list(shape) and shape.value_type == pa.int64()


def shaped_from_arrow(arr: pa.Array | pa.ChunkedArray) -> Shaped:
    """A Shaped over a ``struct<values, shape>`` array (see :func:`shaped_to_arrow`); the
    values are not copied."""
    arr = _one_chunk(arr)
    if not _is_shaped(arr.type):
        raise TypeError(
            f"expected struct<values: list<T>, shape: fixed_size_list<int64>>, got {arr.type}"
        )
    if arr.null_count:
        raise ValueError("Arrow struct column has null rows; a Shaped has none (fill them first)")
    values, shape = arr.field("values"), arr.field("shape")
    flat = ragged_from_arrow(values)
    ndim = shape.type.list_size
    child = shape.values.slice(shape.offset * ndim, len(shape) * ndim)
    shapes = torch.from_numpy(child.to_numpy(zero_copy_only=False).copy()).view(len(shape), ndim)
    return Shaped(flat.values, flat.offsets, shapes)


# -- columns and tables ------------------------------------------------------------------------
def column_to_arrow(col: Column, *, large: bool = True) -> pa.Array:
    """Any TransferQueue column as an Arrow array of one entry per row."""
    if isinstance(col, Shaped):
        return shaped_to_arrow(col, large=large)
    if isinstance(col, Ragged):
        return ragged_to_arrow(col, large=large)
    if isinstance(col, torch.Tensor):
        return tensor_to_arrow(col)
    if isinstance(col, list):
        return pa.array(col)
    raise TypeError(f"not a TransferQueue column: {type(col).__name__}")


def column_from_arrow(arr: pa.Array | pa.ChunkedArray) -> Column:
    """The TransferQueue column an Arrow array maps to: list types give a Ragged, a
    ``struct<values, shape>`` a Shaped, primitive
    and fixed-size-list types a dense tensor, anything else a list of Python values."""
    arr = _one_chunk(arr)
    t = arr.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ragged_from_arrow(arr)
    if _is_shaped(t):
        return shaped_from_arrow(arr)
    base = t
    while pa.types.is_fixed_size_list(base):
        base = base.value_type
    if base in _FROM_ARROW or pa.types.is_boolean(base):
        return tensor_from_arrow(arr)
    return arr.to_pylist()


def to_table(cols: Mapping[str, Column], *, large: bool = True) -> pa.Table:
    """A ``pyarrow.Table`` with one column per field, in the given order."""
    names = list(cols)
    arrays = []
    for name in names:
        try:
            arrays.append(column_to_arrow(cols[name], large=large))
        except (TypeError, ValueError, pa.ArrowException) as e:
            raise type(e)(f"field {name!r}: {e}") from e
    return pa.Table.from_arrays(arrays, names=names)


def from_table(table: pa.Table) -> dict[str, Any]:
    """Columns ready to ``put``, from a table (see :func:`column_from_arrow`)."""
    return {name: column_from_arrow(table.column(name)) for name in table.column_names}


def _one_chunk(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A chunked array's only chunk (several are concatenated: one copy)."""
    if isinstance(arr, pa.ChunkedArray):
        if arr.num_chunks == 1:
            return arr.chunk(0)
        return pa.concat_arrays(arr.chunks) if arr.num_chunks else pa.array([], type=arr.type)
    return arr
