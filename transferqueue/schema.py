"""Field specs: what a column holds, and turning user input into canonical columns.

A field is a named column. Its :class:`FieldSpec` fixes three things the first time any
producer writes it (or when declared up front), and every later write must agree:

| kind     | canonical column type      | ``dtype``        | ``shape``                      |
|----------|----------------------------|------------------|--------------------------------|
| dense    | ``torch.Tensor [B, *shape]`` | a tensor dtype | per-row shape (``()`` = scalar) |
| ragged   | :class:`Ragged`            | a tensor dtype   | per-element shape (token: ``()``) |
| object   | ``list`` of msgpack values | ``None``         | ``()``                          |

Strings and bytes: a list of ``str``/``bytes`` and a numpy array of dtype ``U``, ``S`` or
``object`` are object columns; they read back as a ``list`` of Python ``str``/``bytes`` (a
2-D array: a list of lists per row). numpy scalars become their Python values.

Object values are what msgpack carries (None, bool, int, float, str, bytes, lists, dicts with
str keys), checked on write in every deployment so that a program that works embedded works
over the wire too. Nothing is ever pickled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from transferqueue.errors import SchemaError
from transferqueue.limits import MAX_DIM, MAX_DIMS, MAX_OBJECT_DEPTH, MAX_ROW_BYTES
from transferqueue.ragged import Ragged
from transferqueue.shaped import Shaped

__all__ = [
    "DTYPES",
    "Column",
    "FieldSpec",
    "Kind",
    "column_rows",
    "normalize_columns",
]

Kind = Literal["dense", "ragged", "object", "shaped"]
NUMERIC_KINDS = "biufc"
"""numpy dtype kinds stored as tensors (bool, ints, floats, complex); arrays of any other kind
(``U`` strings, ``S`` bytes, ``O`` objects) are object columns of their Python values."""
Column: TypeAlias = "torch.Tensor | Ragged | list[Any]"
"""(A :class:`Shaped` column is a Ragged.)"""

DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
"""Every tensor dtype a field may have, by name. The order is the wire's dtype code, so new
dtypes go at the end; those this torch lacks are left out (only the last ones are that new)."""
for _name in (
    "uint16",
    "uint32",
    "uint64",
    "complex32",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",  # (torch 2.7+)
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        DTYPES[_name] = getattr(torch, _name)
_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a supported dtype; raises SchemaError for anything else."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise SchemaError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
        return name
    if dtype not in _NAMES:
        raise SchemaError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
    return _NAMES[dtype]


@dataclass(frozen=True)
class FieldSpec:
    """The type of one field (column). Build with :meth:`dense`, :meth:`ragged`,
    :meth:`shaped`, :meth:`object`."""

    kind: Kind
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    ndim: int = 0
    """Number of axes of every row of a shaped field (0 for the other kinds)."""

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "ragged", "object", "shaped"):
            raise SchemaError(f"kind must be dense, ragged, shaped or object, got {self.kind!r}")
        if self.kind == "shaped":
            if self.shape or not 1 <= self.ndim <= MAX_DIMS:
                raise SchemaError(
                    f"shaped fields have 1..{MAX_DIMS} axes (ndim) and no fixed shape, "
                    f"got ndim={self.ndim} shape={self.shape}"
                )
        elif self.ndim:
            raise SchemaError(f"only shaped fields have ndim, got ndim={self.ndim} for {self.kind}")
        if self.kind == "object":
            if self.dtype is not None or self.shape:
                raise SchemaError("object fields have no dtype or shape")
        else:
            if self.dtype is None:
                raise SchemaError(f"{self.kind} fields need a dtype")
            object.__setattr__(self, "dtype", dtype_name(self.dtype))
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
            if len(self.shape) > MAX_DIMS or any(not 0 <= d <= MAX_DIM for d in self.shape):
                raise SchemaError(
                    f"shape must have at most {MAX_DIMS} dimensions of 0..{MAX_DIM}, "
                    f"got {self.shape}"
                )
            if self.row_nbytes > MAX_ROW_BYTES:
                raise SchemaError(
                    f"a row of {self.describe()} takes {self.row_nbytes} bytes, more than "
                    f"{MAX_ROW_BYTES}; split the field"
                )

    @classmethod
    def dense(cls, dtype: torch.dtype | str, shape: Sequence[int] = ()) -> FieldSpec:
        """Every row is a tensor of ``shape`` (``()``: one scalar per row)."""
        return cls("dense", dtype_name(dtype), tuple(shape))

    @classmethod
    def ragged(cls, dtype: torch.dtype | str, inner_shape: Sequence[int] = ()) -> FieldSpec:
        """Rows of variable length along their first axis (token ids, per-token logprobs)."""
        return cls("ragged", dtype_name(dtype), tuple(inner_shape))

    @classmethod
    def shaped(cls, dtype: torch.dtype | str, ndim: int) -> FieldSpec:
        """Rows whose whole shape varies (images ``[3, H, W]``): ``ndim`` axes of any size."""
        return cls("shaped", dtype_name(dtype), (), int(ndim))

    @classmethod
    def object(cls) -> FieldSpec:
        """Any msgpack-able Python value per row (strings, numbers, dicts, lists)."""
        return cls("object")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype is None:
            raise SchemaError("object fields have no tensor dtype")
        return DTYPES[self.dtype]

    @property
    def row_nbytes(self) -> int:
        """Bytes per row of a dense field (per element of a ragged one)."""
        n = 1
        for d in self.shape:  # (Python ints: no overflow before the bound is checked)
            n *= d
        return n * self.torch_dtype.itemsize

    def widened_by(self, other: FieldSpec) -> FieldSpec | None:
        """The shaped spec a partition's field takes when ``other``, a *shaped* spec, arrives
        where this *dense* one holds rows of the same dtype and number of axes (rows of one
        shape are rows of any shape: those stored read back as rows of the shaped field);
        None for any other pair. Only an explicitly shaped write widens a field: a dense
        write of another shape stays a :class:`SchemaError` (a producer's mistake more often
        than not)."""
        if (
            self.kind == "dense"
            and other.kind == "shaped"
            and other.dtype == self.dtype
            and other.ndim == len(self.shape)
        ):
            return other
        return None

    def describe(self) -> str:
        if self.kind == "object":
            return "object"
        if self.kind == "shaped":
            return f"shaped {self.dtype} ndim={self.ndim}"
        return f"{self.kind} {self.dtype} {list(self.shape)}"


# -- input normalization -----------------------------------------------------------------------
def column_rows(col: Column) -> int:
    """Number of rows of a canonical column."""
    if isinstance(col, torch.Tensor):
        return int(col.shape[0])
    return len(col)


def normalize_columns(
    data: Mapping[str, Any], specs: Mapping[str, FieldSpec], *, keep_device: bool = False
) -> tuple[dict[str, Column], dict[str, FieldSpec], int]:
    """Turn a user's ``{field: values}`` into canonical columns and their specs.

    Tensors on a device are moved to host memory, unless ``keep_device`` (the client then
    moves them itself, through pinned memory: :mod:`transferqueue.device.staging`); a
    Ragged's offsets always come to the host (they are small and read on the host).

    ``specs`` holds the specs already known (registered by earlier writes or declared); new
    fields get a spec inferred from the data. Returns (columns, specs of these columns, rows).
    Raises :class:`SchemaError` naming the field on any mismatch; nothing is converted silently
    (no dtype casts), so what is read back is bit-identical to what was written.
    """
    if not isinstance(data, Mapping) or not data:
        raise SchemaError("put needs a non-empty mapping {field name: column}")
    cols: dict[str, Column] = {}
    out_specs: dict[str, FieldSpec] = {}
    rows: int | None = None
    first = ""
    for name, value in data.items():
        if not isinstance(name, str) or not name:
            raise SchemaError(f"field names must be non-empty strings, got {name!r}")
        col, spec = _normalize(name, value, specs.get(name), keep_device)
        n = column_rows(col)
        if rows is None:
            rows, first = n, name
        elif n != rows:
            raise SchemaError(
                f"field {name!r} has {n} rows but field {first!r} has {rows}; "
                "every column of one put must have the same number of rows"
            )
        cols[name] = col
        out_specs[name] = spec
    assert rows is not None
    return cols, out_specs, rows


def _normalize(
    name: str, value: Any, known: FieldSpec | None, keep_device: bool = False
) -> tuple[Column, FieldSpec]:
    if isinstance(value, np.ndarray) and value.dtype.kind in NUMERIC_KINDS:
        value = _from_numpy(name, value)
    if isinstance(value, torch.Tensor):
        return _tensor_column(name, value, known, keep_device)
    if isinstance(value, Shaped):
        if value.values.device.type != "cpu" and not keep_device:
            value = value.with_values(value.values.detach().cpu(), value.offsets.cpu())
        elif value.offsets.device.type != "cpu":
            value = value.with_values(value.values.detach(), value.offsets.cpu())
        spec = FieldSpec.shaped(_dtype_of(name, value.dtype), value.ndim)
        return value, _check(name, spec, known)
    if isinstance(value, Ragged):
        spec = FieldSpec.ragged(_dtype_of(name, value.dtype), value.inner_shape)
        if value.values.device.type != "cpu" and not keep_device:
            value = value.with_values(value.values.detach().cpu(), value.offsets.cpu())
        elif value.offsets.device.type != "cpu":
            value = value.with_values(value.values.detach(), value.offsets.cpu())
        return value, _check(name, spec, known)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list | tuple):
        return _sequence_column(name, value, known, keep_device)
    raise SchemaError(
        f"field {name!r}: cannot store a {type(value).__name__}; give a tensor [rows, ...], "
        "a Ragged, a list of 1-D tensors (ragged) or a list of msgpack-able values (object)"
    )


def _tensor_column(
    name: str, value: torch.Tensor, known: FieldSpec | None, keep_device: bool = False
) -> tuple[Column, FieldSpec]:
    if value.dim() == 0:
        raise SchemaError(
            f"field {name!r}: a 0-d tensor has no row axis; use t.reshape(1) for one row"
        )
    if value.device.type != "cpu" and not keep_device:
        # TransferQueue stores host memory; moving here keeps producers on any device simple.
        value = value.detach().to("cpu")
    value = value.detach()
    if known is not None and known.kind == "shaped":
        # A batch of equal shapes written to a shaped field: every row has value.shape[1:].
        return _normalize(name, Shaped.from_dense(value), known, keep_device)
    if known is not None and known.kind == "ragged":
        # A padded-free [B, T] batch written to a ragged field: every row has length T.
        if value.dim() < 2:
            raise SchemaError(
                f"field {name!r} is {known.describe()}; a 1-D tensor has no per-row length. "
                "Give a list of 1-D tensors or a Ragged"
            )
        rows, width = value.shape[0], value.shape[1]
        values = value.reshape(rows * width, *value.shape[2:])
        lens = torch.full((rows,), width, dtype=torch.int64)
        return _normalize(name, Ragged.from_lengths(values, lens), known, keep_device)
    spec = FieldSpec.dense(_dtype_of(name, value.dtype), tuple(value.shape[1:]))
    return value, _check(name, spec, known)


def _sequence_column(
    name: str, value: Sequence[Any], known: FieldSpec | None, keep_device: bool = False
) -> tuple[Column, FieldSpec]:
    items = [as_python(x) for x in value]  # (numpy strings, bytes, objects: their values)
    if items and all(isinstance(x, torch.Tensor | np.ndarray) for x in items):
        tensors = [_from_numpy(name, x) if isinstance(x, np.ndarray) else x for x in items]
        host = (lambda t: t.detach()) if keep_device else (lambda t: t.detach().cpu())
        if known is not None and known.kind == "dense":
            try:
                stacked = torch.stack([host(t) for t in tensors])
            except RuntimeError as e:
                raise SchemaError(f"field {name!r} is {known.describe()}: {e}") from None
            return _tensor_column(name, stacked, known, keep_device)
        dtype = tensors[0].dtype
        if (known is not None and known.kind == "shaped") or (
            known is None and _shapes_vary(tensors)
        ):
            try:
                shaped = Shaped.from_tensors([host(t) for t in tensors], dtype)
            except (ValueError, RuntimeError) as e:
                raise SchemaError(f"field {name!r}: {e}") from None
            return _normalize(name, shaped, known, keep_device)
        for i, t in enumerate(tensors):
            if t.dim() == 0:
                raise SchemaError(
                    f"field {name!r}: row {i} is a 0-d tensor; ragged rows need a length axis"
                )
            if t.dtype != dtype:
                raise SchemaError(
                    f"field {name!r}: row {i} has dtype {t.dtype}, row 0 has {dtype}; "
                    "all rows of a ragged field share one dtype"
                )
        try:
            ragged = Ragged.from_tensors([host(t) for t in tensors], dtype)
        except (ValueError, RuntimeError) as e:  # (rows on different devices: RuntimeError)
            raise SchemaError(f"field {name!r}: {e}") from None
        return _normalize(name, ragged, known, keep_device)
    if known is not None and known.kind == "ragged":
        try:
            ragged = Ragged.from_lists(items, known.torch_dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SchemaError(
                f"field {name!r} is {known.describe()}; could not build rows from lists: {e}"
            ) from None
        return ragged, _check(name, FieldSpec.ragged(known.torch_dtype, known.shape), known)
    if known is not None and known.kind == "dense":
        try:
            tensor = torch.tensor(items, dtype=known.torch_dtype)
        except (TypeError, ValueError, RuntimeError) as e:
            raise SchemaError(f"field {name!r} is {known.describe()}: {e}") from None
        return _tensor_column(name, tensor, known)
    plain = [_plain(name, i, item, 0) for i, item in enumerate(items)]
    return plain, _check(name, FieldSpec.object(), known)


def _shapes_vary(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether rows differ in shape beyond their first axis (a shaped column, not ragged)."""
    first = tensors[0].shape
    return any(t.dim() != len(first) or t.shape[1:] != first[1:] for t in tensors)


def _check(name: str, spec: FieldSpec, known: FieldSpec | None) -> FieldSpec:
    if known is not None and known != spec:
        raise SchemaError(
            f"field {name!r}: expected {known.describe()}, received {spec.describe()}; "
            "convert the column (e.g. t.to(torch.<dtype>)) or write it under a new field name"
        )
    return spec


def _dtype_of(name: str, dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except SchemaError as e:
        raise SchemaError(f"field {name!r}: {e}") from None


def as_python(value: Any) -> Any:
    """A numpy array of strings, bytes or objects as its Python values (``tolist``: a 0-d
    one is one value); anything else as it is."""
    if isinstance(value, np.ndarray) and value.dtype.kind not in NUMERIC_KINDS:
        return value.tolist()
    return value


def _from_numpy(name: str, arr: np.ndarray) -> torch.Tensor:
    if arr.dtype.kind not in NUMERIC_KINDS:
        raise SchemaError(f"field {name!r}: numpy dtype {arr.dtype} is not numeric")
    if not arr.dtype.isnative or not arr.flags.writeable:
        arr = np.array(arr, dtype=arr.dtype.newbyteorder("="))
    return torch.from_numpy(arr)


_SCALARS = (type(None), bool, int, float, str, bytes)


def _base(value: Any) -> type:
    return next(t for t in (int, float, str, bytes) if isinstance(value, t))


def _plain(name: str, row: int, value: Any, depth: int) -> Any:
    """A copy of ``value`` in the msgpack data model (tuples become lists, as on the wire).

    Copying containers means a producer that mutates its list after ``put`` cannot change
    what is stored, and an embedded read returns exactly what a read over the wire returns.
    """
    if isinstance(value, _SCALARS):
        if isinstance(value, np.generic):  # (np.float64 and np.str_ are float and str too)
            return _plain(name, row, value.item(), depth)
        if type(value) not in _SCALARS:  # (a subclass: stored as the plain type, as on the wire)
            value = _base(value)(value)
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
            raise SchemaError(f"field {name!r} row {row}: integer {value} does not fit 64 bits")
        return value
    if depth >= MAX_OBJECT_DEPTH:
        raise SchemaError(f"field {name!r} row {row}: nesting deeper than {MAX_OBJECT_DEPTH}")
    if isinstance(value, list | tuple):
        return [_plain(name, row, v, depth + 1) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError(f"field {name!r} row {row}: dict keys must be str, got {k!r}")
            out[k] = _plain(name, row, v, depth + 1)
        return out
    if isinstance(value, np.generic):
        return _plain(name, row, value.item(), depth)
    raise SchemaError(
        f"field {name!r} row {row}: {type(value).__name__} is not msgpack-able (object fields "
        "hold None, bool, int, float, str, bytes, lists and str-keyed dicts); convert it, or "
        "store tensors in a dense/ragged field"
    )
