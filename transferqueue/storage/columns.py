"""Column storage inside a storage unit: one class per field kind, all indexed by slot.

Every column has the same slot space as its unit (slots come from the unit's allocator) and a
``written`` bitmap, so reading a cell that was never written is an error, not garbage.

``DenseColumn``: preallocated blocks that only grow (growing never copies old rows)::

    blocks   [cap_0, *shape] [cap_1, *shape] ...   slot s lives in the block whose range holds s
    written  [capacity] bool

``RaggedColumn``: each write's values as one segment (Arrow list layout per segment)::

    segments {id: values [N, *inner]}             one per write, dropped when its rows are freed
    seg      [capacity] int32   start [capacity] int64   length [capacity] int64

``ShapedColumn``: a ragged column of the rows' flattened elements, plus each slot's shape::

    (as RaggedColumn, inner shape ())            shapes [capacity, ndim] int64

``ObjectColumn``: a Python list of msgpack values indexed by slot.

Reads gather into one contiguous buffer per field (dense: one tensor; ragged: values +
offsets). Contiguous slot ranges are copied with one ``copy_`` per block; scattered slots with
one ``index_select`` per block.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import UnknownFieldError
from transferqueue.memcpy import copy_rows, gather_rows, scatter_rows
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.shaped import Shaped

__all__ = ["DenseColumn", "ObjectColumn", "RaggedColumn", "ShapedColumn", "make_column"]


class _ColumnBase:
    def __init__(self, name: str, spec: FieldSpec, capacity: int) -> None:
        self.name = name
        self.spec = spec
        self.written = np.zeros(capacity, dtype=bool)

    @property
    def capacity(self) -> int:
        return int(self.written.size)

    def grow(self, capacity: int) -> None:
        if capacity > self.written.size:
            written = np.zeros(capacity, dtype=bool)
            written[: self.written.size] = self.written
            self.written = written

    def check_written(self, slots: np.ndarray, indexes: np.ndarray) -> None:
        missing = ~self.written[slots]
        if missing.any():
            rows = indexes[missing][:5].tolist()
            raise UnknownFieldError(
                f"field {self.name!r} was never written for rows {rows} "
                f"({int(missing.sum())} of {slots.size}); wait for the producer of "
                f"{self.name!r} (get_meta hands out only rows whose fields are ready)"
            )

    def free(self, slots: np.ndarray) -> None:
        self.written[slots] = False

    @property
    def nbytes(self) -> int:
        return 0


class DenseColumn(_ColumnBase):
    """Fixed-shape rows in growable preallocated blocks."""

    def __init__(self, name: str, spec: FieldSpec, capacity: int) -> None:
        super().__init__(name, spec, 0)
        self._blocks: list[torch.Tensor] = []
        self._starts: list[int] = []  # first slot of each block
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        old = self.capacity
        super().grow(capacity)
        if capacity > old:
            self._blocks.append(
                torch.empty((capacity - old, *self.spec.shape), dtype=self.spec.torch_dtype)
            )
            self._starts.append(old)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks)

    def _pieces(self, slots: np.ndarray) -> list[tuple[int, slice | np.ndarray, slice]]:
        """Split slots into (block, rows in block, positions in the batch).

        Contiguous ascending slots give slices (memcpy); anything else gives index arrays.
        """
        n = slots.size
        if n == 0:
            return []
        lo, hi = int(slots[0]), int(slots[-1]) + 1
        if hi - lo == n and (n == 1 or bool((np.diff(slots) == 1).all())):
            out: list[tuple[int, slice | np.ndarray, slice]] = []
            b = bisect.bisect_right(self._starts, lo) - 1
            pos = 0
            while lo < hi:
                start = self._starts[b]
                end = start + self._blocks[b].shape[0]
                take = min(hi, end) - lo
                out.append((b, slice(lo - start, lo - start + take), slice(pos, pos + take)))
                lo += take
                pos += take
                b += 1
            return out
        block_of = np.searchsorted(np.asarray(self._starts), slots, side="right") - 1
        pieces: list[tuple[int, slice | np.ndarray, slice]] = []
        for b in np.unique(block_of).tolist():
            where = np.flatnonzero(block_of == b)
            pieces.append((b, slots[where] - self._starts[b], where))  # type: ignore[arg-type]
        return pieces

    def write(self, slots: np.ndarray, values: torch.Tensor | ChunkedTensor) -> None:
        pieces = self._pieces(slots)
        if isinstance(values, ChunkedTensor):
            if len(pieces) == 1 and isinstance(pieces[0][1], slice):
                values.copy_into(self._blocks[pieces[0][0]][pieces[0][1]])  # frames -> buffer
                self.written[slots] = True
                return
            values = values.materialize()
        for b, rows, pos in pieces:
            block = self._blocks[b]
            src = values[pos]
            if isinstance(rows, slice):
                copy_rows(block[rows], src)
            else:
                scatter_rows(block, rows, src)
        self.written[slots] = True

    def view(self, slots: np.ndarray) -> torch.Tensor | None:
        """The rows as a view of the block (no copy) when they are one run of one block."""
        pieces = self._pieces(slots)
        if len(pieces) == 1 and isinstance(pieces[0][1], slice):
            return self._blocks[pieces[0][0]][pieces[0][1]]
        return None

    def read(self, slots: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty((slots.size, *self.spec.shape), dtype=self.spec.torch_dtype)
        pieces = self._pieces(slots)
        for b, rows, pos in pieces:
            block = self._blocks[b]
            if isinstance(rows, slice):
                copy_rows(out[pos], block[rows])
            elif len(pieces) == 1:
                gather_rows(out, block, rows)
            else:
                part = torch.empty((len(rows), *self.spec.shape), dtype=self.spec.torch_dtype)
                gather_rows(part, block, rows)
                scatter_rows(out, np.asarray(pos), part)
        return out


class RaggedColumn(_ColumnBase):
    """Variable-length rows; each write's values are kept as one contiguous segment."""

    def __init__(self, name: str, spec: FieldSpec, capacity: int) -> None:
        super().__init__(name, spec, capacity)
        self._seg = np.full(capacity, -1, dtype=np.int64)
        self._start = np.zeros(capacity, dtype=np.int64)
        self._len = np.zeros(capacity, dtype=np.int64)
        self._segments: dict[int, torch.Tensor] = {}
        self._live: dict[int, int] = {}
        self._next_seg = 0

    def grow(self, capacity: int) -> None:
        old = self.capacity
        super().grow(capacity)
        if capacity > old:
            self._seg = np.concatenate([self._seg, np.full(capacity - old, -1, dtype=np.int64)])
            self._start = np.concatenate([self._start, np.zeros(capacity - old, dtype=np.int64)])
            self._len = np.concatenate([self._len, np.zeros(capacity - old, dtype=np.int64)])

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self._segments.values())

    def write(self, slots: np.ndarray, values: Ragged, *, adopt: bool = False) -> None:
        """Store rows; ``adopt=True`` keeps ``values.values`` itself (caller gives it up)."""
        self._release(slots[self.written[slots]])
        if adopt:
            data = values.values.contiguous()
        else:
            data = torch.empty_like(values.values, memory_format=torch.contiguous_format)
            copy_rows(data, values.values)
        seg = self._next_seg
        self._next_seg += 1
        self._segments[seg] = data
        self._live[seg] = int(slots.size)
        offsets = values.offsets.numpy()
        self._seg[slots] = seg
        self._start[slots] = offsets[:-1]
        self._len[slots] = offsets[1:] - offsets[:-1]
        self.written[slots] = True

    def read(self, slots: np.ndarray, *, share: bool = False) -> Ragged:
        """Gather rows into one values buffer. ``share=True`` returns a view of the stored
        segment when the rows are one run of it: segments are never written after they are
        stored, so a reader that only sends the bytes on (a server) can skip the copy."""
        lens = self._len[slots]
        offsets = np.zeros(slots.size + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        runs: list[tuple[int, int, int]] = []  # (first row, end row, segment)
        if slots.size:
            segs, starts = self._seg[slots], self._start[slots]
            # A run continues while rows sit back to back in the same segment.
            cont = (segs[1:] == segs[:-1]) & (starts[1:] == starts[:-1] + lens[:-1])
            breaks = np.flatnonzero(~cont) + 1
            firsts = np.concatenate(([0], breaks)).tolist()
            ends = np.concatenate((breaks, [slots.size])).tolist()
            runs = [(a, b, int(segs[a])) for a, b in zip(firsts, ends, strict=True)]
        if share and len(runs) == 1:
            s0 = int(self._start[slots[0]])
            view = self._segments[runs[0][2]][s0 : s0 + total]
            return Ragged(view, torch.from_numpy(offsets))
        out = torch.empty((total, *self.spec.shape), dtype=self.spec.torch_dtype)
        for a, b, seg in runs:
            o0, o1 = int(offsets[a]), int(offsets[b])
            if o1 > o0:
                s0 = int(self._start[slots[a]])
                copy_rows(out[o0:o1], self._segments[seg][s0 : s0 + (o1 - o0)])
        return Ragged(out, torch.from_numpy(offsets))

    def free(self, slots: np.ndarray) -> None:
        self._release(slots[self.written[slots]])
        super().free(slots)

    def _release(self, slots: np.ndarray) -> None:
        if slots.size == 0:
            return
        segs, counts = np.unique(self._seg[slots], return_counts=True)
        for seg, c in zip(segs.tolist(), counts.tolist(), strict=True):
            left = self._live[seg] - c
            if left:
                self._live[seg] = left
            else:
                del self._live[seg], self._segments[seg]
        self._seg[slots] = -1


class ShapedColumn(RaggedColumn):
    """Rows of any shape: their elements as ragged rows, their shapes beside (per slot)."""

    def __init__(self, name: str, spec: FieldSpec, capacity: int) -> None:
        super().__init__(name, spec, capacity)
        self._shapes = np.zeros((capacity, spec.ndim), dtype=np.int64)

    def grow(self, capacity: int) -> None:
        old = self.capacity
        super().grow(capacity)
        if capacity > old:
            more = np.zeros((capacity - old, self.spec.ndim), dtype=np.int64)
            self._shapes = np.concatenate([self._shapes, more])

    def write(self, slots: np.ndarray, values: Ragged, *, adopt: bool = False) -> None:
        assert isinstance(values, Shaped)
        super().write(slots, values, adopt=adopt)
        self._shapes[slots] = values.shapes.numpy()

    def read(self, slots: np.ndarray, *, share: bool = False) -> Shaped:
        flat = super().read(slots, share=share)
        return Shaped(flat.values, flat.offsets, torch.from_numpy(self._shapes[slots]))


class ObjectColumn(_ColumnBase):
    """msgpack-able Python values, one per slot."""

    def __init__(self, name: str, spec: FieldSpec, capacity: int) -> None:
        super().__init__(name, spec, capacity)
        self._values: list[Any] = [None] * capacity

    def grow(self, capacity: int) -> None:
        old = self.capacity
        super().grow(capacity)
        if capacity > old:
            self._values.extend([None] * (capacity - old))

    def write(self, slots: np.ndarray, values: list[Any]) -> None:
        vals = self._values
        for s, v in zip(slots.tolist(), values, strict=True):
            vals[s] = v
        self.written[slots] = True

    def read(self, slots: np.ndarray) -> list[Any]:
        vals = self._values
        return [vals[s] for s in slots.tolist()]

    def free(self, slots: np.ndarray) -> None:
        vals = self._values
        for s in slots.tolist():
            vals[s] = None
        super().free(slots)


AnyColumn = DenseColumn | RaggedColumn | ShapedColumn | ObjectColumn


def make_column(name: str, spec: FieldSpec, capacity: int) -> AnyColumn:
    if spec.kind == "dense":
        return DenseColumn(name, spec, capacity)
    if spec.kind == "ragged":
        return RaggedColumn(name, spec, capacity)
    if spec.kind == "shaped":
        return ShapedColumn(name, spec, capacity)
    return ObjectColumn(name, spec, capacity)


def write_column(col: AnyColumn, slots: np.ndarray, data: Column, *, adopt: bool) -> None:
    """Write canonical column data (already checked against ``col.spec``)."""
    if isinstance(col, DenseColumn):
        assert isinstance(data, torch.Tensor | ChunkedTensor)
        col.write(slots, data)
    elif isinstance(col, RaggedColumn):
        assert isinstance(data, Ragged)
        col.write(slots, data, adopt=adopt)
    else:
        assert isinstance(data, list)
        col.write(slots, data)
