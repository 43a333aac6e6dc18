"""TensorDict <-> our columns: the data half of the facade.

The peer moves ``tensordict.TensorDict`` batches; our store moves ``{field: column}``. One
table says how each kind travels (nothing is cast; what is read is bit-identical to what was
put):

| TensorDict value                     | our column                  | read back as          |
|--------------------------------------|-----------------------------|-----------------------|
| ``torch.Tensor`` ``[B, ...]``        | dense (the same memory)     | the dense tensor      |
| jagged nested tensor                 | ``Ragged(values, offsets)`` | jagged nested tensor  |
|                                      | (the same buffers)          | (over the read, no    |
|                                      |                             | copy)                 |
| strided nested tensor                | ``Ragged`` (over its buffer | jagged nested tensor  |
|                                      | when contiguous, else one   |                       |
|                                      | copy); jagged with holes    |                       |
|                                      | (``lengths``): one copy     |                       |
| strided nested tensor whose rows     | ``Shaped`` (over its buffer | strided nested tensor |
| differ beyond their first axis       | when contiguous)            | (views of the read)   |
| dense rows of a new shape where the  | ``Shaped`` (a view: the     | jagged nested tensor  |
| partition holds the field dense      | field is widened)           | where rows differ     |
|                                      |                             | only along axis 0     |
| ``NonTensorStack`` / list of values  | object column (msgpack)     | ``NonTensorStack``    |

A jagged field needs rows of one inner shape (``[len_i, *inner]``), as Arrow's list layout
does; a nested tensor whose rows differ beyond their first axis (images ``[3, H, W]``) is a
shaped column and reads back as the strided nested tensor the peer gives.

Called by :mod:`tqcompat.client` on every ``put`` and ``get_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from typing import Any

import numpy as np
import torch

from transferqueue import Ragged, Shaped

_NJT: Any = None  # torch's jagged nested tensor class: its buffers are read without a dispatch
try:
    from torch.nested._internal.nested_tensor import NestedTensor

    _NJT = NestedTensor
except ImportError:  # pragma: no cover - a torch without it takes the public calls
    pass

__all__ = ["from_columns", "schema_from_spec", "schema_of", "to_columns"]


def _tensordict() -> Any:
    try:
        import tensordict
    except ImportError:  # pragma: no cover - the extra is part of dev
        raise ImportError(
            "the transfer_queue facade moves tensordict.TensorDict batches: "
            'pip install "asyncflow[compat]"'
        ) from None
    return tensordict


def _jagged(value: torch.Tensor) -> Ragged | None:
    """``value``'s own ``(values, offsets)`` buffers as a Ragged when it is a plain jagged
    nested tensor (ragged axis 1, no holes); None otherwise. Reads the attributes that
    ``values()`` / ``offsets()`` return: those calls go through the nested tensor's
    ``__torch_dispatch__`` (tens of microseconds each, per field and call)."""
    if _NJT is None or type(value) is not _NJT:
        return None
    njt: Any = value
    if njt._lengths is not None or njt._ragged_idx != 1:
        return None
    return Ragged(njt._values, njt._offsets)


def _nested(col: Ragged) -> torch.Tensor:
    """A jagged nested tensor over ``col``'s buffers (no copy). The class is built directly
    where torch has it: ``nested_tensor_from_jagged`` makes the same tensor through a view
    op's dispatch (~4x the time, per field and call)."""
    if _NJT is None or col.values.dim() < 1 or col.offsets.dtype != torch.int64:
        return torch.nested.nested_tensor_from_jagged(col.values, col.offsets)
    out: torch.Tensor = _NJT(col.values, col.offsets)
    return out


def _row_strides(shapes: torch.Tensor) -> torch.Tensor:
    """C-order strides ``[B, ndim]`` of rows of ``shapes`` ``[B, ndim]``."""
    strides = torch.ones_like(shapes)
    if shapes.shape[1] > 1:
        tail = torch.flip(shapes[:, 1:], [1])
        strides[:, :-1] = torch.flip(torch.cumprod(tail, 1), [1])
    return strides


def _inner_if_one(shapes: torch.Tensor) -> list[int] | None:
    """The rows' sizes beyond their first axis where every row has the same ones (and at
    least one element per unit of the first axis); None otherwise."""
    if not shapes.shape[0] or shapes.shape[1] < 1:
        return None
    if not bool((shapes[:, 1:] == shapes[:1, 1:]).all()):
        return None
    inner = [int(d) for d in shapes[0, 1:].tolist()]
    return inner if all(inner) else None


def _shaped_nested(col: Shaped) -> torch.Tensor:
    """A shaped column as the peer's nested tensor, over the column's values (no copy): rows
    that differ only along their first axis (a field widened from dense rows ``[2]``,
    ``[3]``, ...) as a jagged nested tensor, as the peer returns them; rows that differ
    beyond it (images) as a strided nested tensor whose rows are views of the values."""
    inner = _inner_if_one(col.shapes)
    if inner is not None:
        per = 1
        for d in inner:
            per *= d
        return _nested(Ragged(col.values.view(-1, *inner), col.offsets // per))
    values = col.values
    if values.is_contiguous() and values.dim() == 1 and len(col):
        try:  # (torch's own view constructor; a torch without it copies below)
            out: torch.Tensor = torch._nested_view_from_buffer(
                values, col.shapes, _row_strides(col.shapes), col.offsets[:-1].contiguous()
            )
            return out
        except (AttributeError, RuntimeError):  # pragma: no cover - torch-version dependent
            pass
    return torch.nested.nested_tensor(col.unbind())


def _strided_buffer(value: torch.Tensor) -> Shaped | None:
    """A contiguous strided nested tensor's rows as a Shaped over its own buffer (no copy):
    its rows lie back to back in one storage, which ``unbind`` views share; None when they
    do not (then the rows are copied)."""
    try:
        shapes = value._nested_tensor_size()
        starts = value._nested_tensor_storage_offsets()
    except (AttributeError, RuntimeError):  # pragma: no cover - torch-version dependent
        return None
    if not value.is_contiguous() or shapes.dim() != 2 or not shapes.shape[0]:
        return None
    counts = shapes.prod(dim=1)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    base = int(starts[0])
    if not torch.equal(starts - base, offsets[:-1]):
        return None
    first = value.unbind()[0]
    storage = first.untyped_storage()
    values = torch.empty(0, dtype=value.dtype, device=value.device)
    values.set_(storage, base, (int(offsets[-1]),), (1,))
    return Shaped(values, offsets, shapes.to(torch.int64))


def _column(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        jagged = _jagged(value)
        if jagged is not None:
            return jagged
        if not value.is_nested:
            return value
        if value.layout == torch.jagged and value._lengths is None:  # type: ignore[attr-defined]
            return Ragged(value.values(), value.offsets())  # type: ignore[attr-defined]
        if value.layout == torch.strided:
            shaped = _strided_buffer(value)
            if shaped is not None:
                inner = _inner_if_one(shaped.shapes)
                if inner is None:
                    return shaped
                per = 1
                for d in inner:
                    per *= d
                return Ragged(shaped.values.view(-1, *inner), shaped.offsets // per)
        # (strided not back to back, or jagged with holes: its rows are not
        # values[offsets[i]:offsets[i+1]])
        rows = list(value.unbind())
        if len({tuple(r.shape[1:]) for r in rows}) > 1:
            return Shaped.from_tensors(rows, value.dtype)
        return Ragged.from_tensors(rows, value.dtype)
    # a numpy array or a list in a TensorDict (strings, bytes, objects) is one NonTensorData
    # for the batch; as the peer (which reads row i as td[field][i]), one of batch-size length
    # holds the rows along its first axis: our put takes the array (or list) as the column
    data = getattr(value, "data", None)
    if (
        isinstance(value, _tensordict().NonTensorData)
        and isinstance(data, (np.ndarray, list, tuple))
        and np.ndim(data)
        and len(data) == value.batch_size[0]
    ):
        return data if isinstance(data, np.ndarray) else list(data)
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # NonTensorStack, numpy arrays of objects
        return list(tolist())
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(
        f"field {name!r}: expected a tensor, a nested tensor or a NonTensorStack / list of "
        f"values, got {type(value).__name__}"
    )


def to_columns(data: Any) -> tuple[dict[str, Any], int]:
    """``(columns, rows)`` of a TensorDict (or a plain ``{field: values}`` mapping) for our
    ``put``. A TensorDict with ``batch_size`` other than ``[B]`` or a field whose first axis is
    not ``B`` is a ``ValueError`` naming them."""
    td = _tensordict()
    if isinstance(data, td.TensorDictBase):
        if len(data.batch_size) != 1:
            raise ValueError(
                f"put needs a TensorDict with batch_size [B] (one row per sample), got "
                f"batch_size={list(data.batch_size)}"
            )
        rows = int(data.batch_size[0])
        items = list(data.items())
    elif isinstance(data, Mapping):
        items = list(data.items())
        rows = -1
    else:
        raise TypeError(f"data must be a tensordict.TensorDict, got {type(data).__name__}")
    if not items:
        raise ValueError("put needs at least one field in the TensorDict")
    cols: dict[str, Any] = {}
    for name, value in items:
        col = _column(str(name), value)
        n = len(col)
        if rows < 0:
            rows = n
        if n != rows:
            raise ValueError(f"field {name!r} has {n} rows, expected {rows} (the batch size)")
        cols[str(name)] = col
    return cols, rows


def from_columns(cols: Mapping[str, Any], rows: int) -> Any:
    """A TensorDict of ``rows`` rows over the columns ``get_data`` returned (no copy of
    dense or ragged buffers), its fields in name order as the peer's (``field_names`` is
    sorted there)."""
    td = _tensordict()
    out: dict[str, Any] = {}
    for name, col in sorted(cols.items()):
        if isinstance(col, Shaped):
            out[name] = _shaped_nested(col)
        elif isinstance(col, Ragged):
            out[name] = _nested(col)
        elif isinstance(col, torch.Tensor):
            out[name] = col
        else:
            out[name] = td.NonTensorStack(*col) if col else td.NonTensorStack()
    return td.TensorDict(out, batch_size=[rows])


def schema_of(cols: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The peer's ``field_schema`` of columns: ``{field: {dtype, shape, is_nested,
    is_non_tensor}}`` (a nested field's ``per_sample_shapes`` too)."""
    schema: dict[str, dict[str, Any]] = {}
    for name, col in cols.items():
        if isinstance(col, Shaped):
            every = [torch.Size(s) for s in col.shapes.tolist()]
            schema[name] = {
                "dtype": col.dtype,
                "shape": every[0] if every else None,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": every,
            }
        elif isinstance(col, Ragged):
            inner = tuple(col.values.shape[1:])
            lengths = (col.offsets[1:] - col.offsets[:-1]).tolist()  # (no view per row)
            # [(len_i, *inner)] built by zip in C, not a Python loop per row
            shapes = list(zip(lengths, *(repeat(d, len(lengths)) for d in inner), strict=True))
            schema[name] = {
                "dtype": col.dtype,
                "shape": torch.Size(shapes[0]) if shapes else None,
                "is_nested": True,
                "is_non_tensor": False,
                "per_sample_shapes": shapes,
            }
        elif isinstance(col, torch.Tensor):
            schema[name] = {
                "dtype": col.dtype,
                "shape": col.shape[1:],
                "is_nested": False,
                "is_non_tensor": False,
            }
        else:
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


_DTYPES = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def schema_from_spec(spec: str) -> dict[str, Any]:
    """The peer's schema entry of one of our field specs as ``stats`` describes it
    (``"dense int64 [2]"``, ``"ragged float32 []"``, ``"shaped uint8 ndim=3"``,
    ``"object"``)."""
    kind, *rest = spec.split(" ", 2)
    if kind == "object":
        return {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    dtype = _DTYPES.get(rest[0]) if rest else None
    if kind == "shaped":  # (rows of any shape: no shape for the field)
        return {"dtype": dtype, "shape": None, "is_nested": True, "is_non_tensor": False}
    dims = rest[1].strip("[]") if len(rest) > 1 else ""
    shape = tuple(int(d) for d in dims.split(",") if d.strip())
    return {
        "dtype": dtype,
        "shape": torch.Size(shape) if kind == "dense" else None,
        "is_nested": kind == "ragged",
        "is_non_tensor": False,
    }
