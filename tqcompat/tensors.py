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
| strided nested tensor                | ``Ragged`` (one copy)       | jagged nested tensor  |
| ``NonTensorStack`` / list of values  | object column (msgpack)     | ``NonTensorStack``    |

A jagged field needs rows of one inner shape (``[len_i, *inner]``), as Arrow's list layout
does; the peer's strided nested tensors with rows of different inner shapes are refused with
a ``ValueError`` naming the field.

Called by :mod:`tqcompat.client` on every ``put`` and ``get_data``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from transferqueue import Ragged

__all__ = ["from_columns", "schema_of", "to_columns"]


def _tensordict() -> Any:
    try:
        import tensordict
    except ImportError:  # pragma: no cover - the extra is part of dev
        raise ImportError(
            "the transfer_queue facade moves tensordict.TensorDict batches: "
            'pip install "asyncflow[compat]"'
        ) from None
    return tensordict


def _column(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if not value.is_nested:
            return value
        if value.layout == torch.jagged:
            return Ragged(value.values(), value.offsets())  # type: ignore[attr-defined]
        rows = list(value.unbind())
        if len({tuple(r.shape[1:]) for r in rows}) > 1:
            raise ValueError(
                f"field {name!r}: a nested tensor whose rows differ beyond their first axis "
                f"({[tuple(r.shape) for r in rows]}) has no ragged layout; pad the inner axes"
            )
        return Ragged.from_tensors(rows, value.dtype)
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
        if isinstance(col, Ragged):
            out[name] = torch.nested.nested_tensor_from_jagged(col.values, col.offsets)
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
        if isinstance(col, Ragged):
            inner = tuple(col.values.shape[1:])
            lengths = (col.offsets[1:] - col.offsets[:-1]).tolist()  # (no view per row)
            shapes = [(int(n), *inner) for n in lengths]
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
