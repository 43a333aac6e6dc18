"""The Arrow IPC files of a store checkpoint (layout: :mod:`transferqueue.client.checkpoint`).

``Writers`` appends one record batch per row batch to ``rows.arrow`` and to each field's
file; ``Readers`` reads batch ``k`` of them back (only that batch is in memory). Columns go
through :mod:`transferqueue.arrow`, which shares the tensors' memory with Arrow's buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import torch

from transferqueue.arrow import column_from_arrow, column_to_arrow, has_arrow_type
from transferqueue.errors import CheckpointError
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.shaped import Shaped
from transferqueue.wire.replies import PartitionExport, TaskExport

__all__ = ["Readers", "RowBatch", "Writers"]


def _empty(spec: FieldSpec) -> Column:
    if spec.kind == "dense":
        return torch.empty((0, *spec.shape), dtype=spec.torch_dtype)
    if spec.kind == "ragged":
        values = torch.empty((0, *spec.shape), dtype=spec.torch_dtype)
        return Ragged(values, torch.zeros(1, dtype=torch.int64))
    if spec.kind == "shaped":
        values = torch.empty((0,), dtype=spec.torch_dtype)
        shapes = torch.zeros((0, spec.ndim), dtype=torch.int64)
        return Shaped(values, torch.zeros(1, dtype=torch.int64), shapes)
    return []


def _to_arrow(col: Column, spec: FieldSpec) -> pa.Array:
    if spec.kind == "object":
        assert isinstance(col, list)
        return pa.array(encode_objects(col), type=pa.large_binary())
    return column_to_arrow(as_arrow_tensor(col, spec))


class Writers:
    """The files of one partition being saved; closed (and flushed) on exit."""

    def __init__(
        self,
        directory: Path,
        part: PartitionExport,
        specs: dict[str, FieldSpec],
        tasks: Sequence[tuple[str, TaskExport]],
    ) -> None:
        self._dir = directory
        self._part = part
        self._specs = specs
        self.files = {f: f"f{k:04d}.arrow" for k, f in enumerate(specs)}
        self._writers: dict[str, pa.ipc.RecordBatchFileWriter] = {}
        self._tasks = [col for col, _ in tasks]

    def __enter__(self) -> Writers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for w in self._writers.values():
            w.close()

    def _write(self, key: str, name: str, batch: pa.RecordBatch) -> None:
        w = self._writers.get(key)
        if w is None:
            w = self._writers[key] = pa.ipc.new_file(str(self._dir / name), batch.schema)
        w.write_batch(batch)

    def write_rows(
        self,
        lo: int,
        hi: int,
        consumed: dict[str, np.ndarray],
        queue: dict[str, np.ndarray],
        leased: dict[str, np.ndarray],
    ) -> None:
        p = self._part
        arrays: dict[str, pa.Array] = {
            "index": pa.array(p.indexes[lo:hi]),
            "group": pa.array(p.groups[lo:hi]),
            "version": pa.array(p.versions[lo:hi]),
            "length": pa.array(p.lengths[lo:hi]),
        }
        custom: list[bytes | None] = [None] * (hi - lo)
        sel = (p.custom_rows >= lo) & (p.custom_rows < hi)
        for k in np.flatnonzero(sel).tolist():
            custom[int(p.custom_rows[k]) - lo] = p.custom[k]
        arrays["custom"] = pa.array(custom, type=pa.binary())
        if p.keys:  # (only a partition with string keys has the column)
            keys: list[str | None] = [None] * (hi - lo)
            assert p.key_rows is not None
            for k in np.flatnonzero((p.key_rows >= lo) & (p.key_rows < hi)).tolist():
                keys[int(p.key_rows[k]) - lo] = p.keys[k]
            arrays["key"] = pa.array(keys, type=pa.large_string())
        for f, ready in p.ready.items():
            arrays[f"ready:{f}"] = pa.array(ready[lo:hi], type=pa.bool_())
        for col in self._tasks:
            arrays[f"consumed:{col}"] = pa.array(consumed[col], type=pa.bool_())
            arrays[f"queue:{col}"] = pa.array(queue[col], type=pa.int64())
            arrays[f"leased:{col}"] = pa.array(leased[col], type=pa.int64())
        self._write("rows", "rows.arrow", pa.RecordBatch.from_pydict(arrays))

    def write_field(self, field: str, pos: np.ndarray, col: Column | None) -> None:
        spec = self._specs[field]
        value = _to_arrow(_empty(spec) if col is None else col, spec)
        batch = pa.RecordBatch.from_arrays(
            [pa.array(pos, type=pa.int64()), value], ["row", "value"]
        )
        self._write(field, self.files[field], batch)


@dataclass
class RowBatch:
    """One row batch of ``rows.arrow``."""

    groups: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    custom_pos: np.ndarray  # positions within the batch of rows with custom metadata
    custom: list[bytes]
    key_pos: np.ndarray  # positions within the batch of rows with a string key
    keys: list[str]
    consumed: dict[str, np.ndarray]  # task column -> bool per row
    queue: dict[str, np.ndarray]  # task column -> serve rank (-1: not queued)
    leased: dict[str, np.ndarray]  # task column -> rank in the open leases (-1: none)


class Readers:
    """Batch ``k`` of a saved partition's files, on demand."""

    def __init__(self, directory: Path, entry: dict[str, Any]) -> None:
        self._files: list[pa.OSFile] = []
        self._batches = int(entry["batches"])
        self._tasks = [t["column"] for t in entry["tasks"]]
        self._rows = self._open(directory / "rows.arrow")
        self._fields = {f: self._open(directory / e["file"]) for f, e in entry["fields"].items()}

    def _open(self, path: Path) -> pa.ipc.RecordBatchFileReader:
        try:
            f = pa.OSFile(str(path))
            self._files.append(f)
            reader = pa.ipc.open_file(f)
        except (OSError, pa.ArrowInvalid) as e:
            raise CheckpointError(f"{path}: cannot be read as an Arrow IPC file ({e})") from None
        if reader.num_record_batches != self._batches:
            raise CheckpointError(
                f"{path} has {reader.num_record_batches} record batches, the manifest says "
                f"{self._batches}; the save is damaged"
            )
        return reader

    def __enter__(self) -> Readers:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._files:
            f.close()

    def rows(self, k: int) -> RowBatch:
        b = self._rows.get_batch(k)

        def ints(name: str) -> np.ndarray:
            return b.column(name).to_numpy(zero_copy_only=False).astype(np.int64)

        custom_pos, custom = _present(b, "custom")
        key_pos, keys = _present(b, "key")
        return RowBatch(
            ints("group"),
            ints("version"),
            ints("length"),
            custom_pos,
            custom,
            key_pos,
            keys,
            {
                c: b.column(f"consumed:{c}").to_numpy(zero_copy_only=False).astype(bool)
                for c in self._tasks
            },
            {c: ints(f"queue:{c}") for c in self._tasks},
            {c: ints(f"leased:{c}") for c in self._tasks},
        )

    def field(self, name: str, k: int, spec: FieldSpec) -> tuple[np.ndarray, Column]:
        """(positions in the partition, column) of field ``name`` in row batch ``k``."""
        b = self._fields[name].get_batch(k)
        pos = b.column("row").to_numpy(zero_copy_only=False).astype(np.int64)
        value = b.column("value")
        if spec.kind == "object":
            return pos, [msgspec.msgpack.decode(v) for v in value.to_pylist()]
        if len(value) == 0:
            return pos, _empty(spec)
        return pos, from_arrow_tensor(column_from_arrow(value), spec)


def _present(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, list[Any]]:
    """(positions, values) of the non-null entries of column ``name`` (none: no column)."""
    if name not in batch.schema.names:
        return np.empty(0, dtype=np.int64), []
    col = batch.column(name)
    has = np.flatnonzero(col.is_valid().to_numpy(zero_copy_only=False))
    values = col.to_pylist()
    return has.astype(np.int64), [values[i] for i in has.tolist()]


def encode_objects(values: list[Any]) -> list[bytes]:
    return [msgspec.msgpack.encode(v) for v in values]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype whose Arrow type carries the bits of a dtype without one, by width
(bfloat16 as int16, fp8 as uint8, complex64 as int64; 16-byte complex128 as two int64 on a
last axis of 2)."""


def _to_bits(t: torch.Tensor) -> torch.Tensor:
    size = t.dtype.itemsize
    if size in _BITS:
        return t.view(_BITS[size])
    return t.contiguous().unsqueeze(-1).view(torch.int64)  # [..., 2]


def _from_bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize in _BITS:
        return t.view(dtype)
    return t.contiguous().view(dtype).squeeze(-1)


def as_arrow_tensor(col: Column, spec: FieldSpec) -> Column:
    """A dtype without an Arrow type (bfloat16, fp8, complex) travels as its bits."""
    if spec.dtype is None or has_arrow_type(spec.torch_dtype):
        return col
    if isinstance(col, Shaped) and spec.torch_dtype.itemsize not in _BITS:
        # (complex128: two int64 per element, as a last axis of 2 of every row)
        pairs = torch.cat([col.shapes, torch.full((len(col), 1), 2, dtype=torch.int64)], 1)
        return Shaped(_to_bits(col.values).reshape(-1), col.offsets * 2, pairs)
    if isinstance(col, Ragged):
        return col.with_values(_to_bits(col.values))
    if isinstance(col, torch.Tensor):
        return _to_bits(col)
    return col


def from_arrow_tensor(col: Column, spec: FieldSpec) -> Column:
    if spec.dtype is None or has_arrow_type(spec.torch_dtype):
        return col
    if isinstance(col, Shaped) and spec.torch_dtype.itemsize not in _BITS:
        values = _from_bits(col.values.view(-1, 2), spec.torch_dtype)
        return Shaped(values, col.offsets // 2, col.shapes[:, :-1])
    if isinstance(col, Ragged):
        return col.with_values(_from_bits(col.values, spec.torch_dtype))
    if isinstance(col, torch.Tensor):
        return _from_bits(col, spec.torch_dtype)
    return col
