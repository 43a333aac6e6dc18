"""``Shaped``: a batch of tensors whose whole shape varies per row, as one values buffer.

Images ``[3, H, W]`` with H and W varying per row, or any other tensors that share a dtype and
a number of axes but not their sizes. The layout is a ragged column of the rows' flattened
elements plus each row's shape::

    values   [N]            all rows' elements back to back, each row in C order
    offsets  [B + 1] int64  row i is values[offsets[i]:offsets[i + 1]]; offsets[0] == 0
    shapes   [B, ndim] int64 row i has shape shapes[i]; prod(shapes[i]) == its element count

A ``Shaped`` is a :class:`~transferqueue.Ragged` (its values are flat), so every path that
moves ragged values (frames, shared memory, write arenas, device staging) moves these too;
``shapes`` travels beside the offsets. Row views (``shaped[i]``, ``unbind``) share memory
with ``values``; nothing is copied until ``to_padded`` or ``take``.

A read of several storage units' rows is a Shaped over the units' buffers
(:meth:`Shaped.concat`, no gather): the offsets and shapes are the batch's, the values lie
in one buffer per run of rows::

    chunks   [Shaped, ...]  rows 0..a of the batch, then a..b, ...: each over its own buffer
    values   [N]            gathered into one buffer on first use (then the chunks are dropped)

Rows, ``unbind``, ``to_padded``, ``slice``, ``take``, ``clone`` and equality work on the
chunks as they lie; ``values`` (an Arrow export, a device copy, a put of the column) gathers
once. An image batch's rows are large, so a read that skips the gather saves a copy of the
whole batch (78 MB in ``bench.peer``'s multimodal case at four units).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from transferqueue.memcpy import as_bytes, copy_bytes, copy_rows
from transferqueue.ragged import Ragged, _bits_equal

__all__ = ["Shaped"]

# Ragged's ``values`` slot; a Shaped reads it behind a property (its values may be chunks).
_VALUES_SLOT: Any = Ragged.__dict__["values"]


class Shaped(Ragged):
    """Rows of any shape (fixed dtype and number of axes) in one contiguous buffer, or in
    several (:meth:`concat`)."""

    __slots__ = ("_alloc", "_chunk_rows", "_chunks", "shapes")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor) -> None:
        self._chunks: tuple[Shaped, ...] = ()
        self._chunk_rows = np.zeros(1, dtype=np.int64)
        self._alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
        if values.dim() != 1:
            raise ValueError(f"values must be 1-D (the rows' elements), got {tuple(values.shape)}")
        super().__init__(values, offsets)
        if shapes.dtype != torch.int64:
            shapes = shapes.to(torch.int64)
        shapes = shapes.cpu()
        rows = self.offsets.numel() - 1
        if shapes.dim() != 2 or shapes.shape[0] != rows:
            raise ValueError(f"shapes must be [rows={rows}, ndim], got {tuple(shapes.shape)}")
        s = shapes.numpy()
        if bool((s < 0).any()):
            raise ValueError("shapes must not be negative")
        o = self.offsets.cpu().numpy()
        if not np.array_equal(np.prod(s, axis=1, dtype=np.int64), o[1:] - o[:-1]):
            raise ValueError(
                "each row's element count (offsets) must equal the product of its shape"
            )
        self.shapes = shapes

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls, rows: Sequence[torch.Tensor | np.ndarray], dtype: torch.dtype | None = None
    ) -> Shaped:
        """Flatten and concatenate rows (one copy). All rows share dtype and number of axes."""
        tensors = [torch.as_tensor(r) for r in rows]
        if dtype is None:
            dtype = tensors[0].dtype if tensors else torch.float32
        ndim = tensors[0].dim() if tensors else 0
        for i, t in enumerate(tensors):
            if t.dtype != dtype:
                raise ValueError(f"row {i} has dtype {t.dtype}, expected {dtype}")
            if t.dim() != ndim:
                raise ValueError(f"row {i} has {t.dim()} axes, row 0 has {ndim}")
        shapes = torch.tensor([list(t.shape) for t in tensors], dtype=torch.int64)
        shapes = shapes.reshape(len(tensors), ndim)
        offsets = torch.zeros(len(tensors) + 1, dtype=torch.int64)
        if tensors:
            offsets[1:] = torch.cumsum(shapes.prod(dim=1), 0)
        # (one memcpy per row, not torch.cat: its intra-op threads stall on busy cores)
        values = torch.empty((int(offsets[-1]),), dtype=dtype)
        ends = offsets.tolist()
        for t, a, b in zip(tensors, ends[:-1], ends[1:], strict=True):
            copy_rows(values[a:b], t.reshape(-1))
        return cls(values, offsets, shapes)

    @classmethod
    def concat(
        cls,
        parts: Sequence[Shaped],
        *,
        alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ) -> Shaped:
        """The rows of ``parts`` one after another, over the parts' own buffers (no copy:
        the result keeps them alive; ``values`` gathers them into one on first use, in
        ``alloc(shape, dtype)``'s memory: default ``torch.empty``). All parts share dtype
        and number of axes."""
        parts = [p for p in parts if len(p)] or list(parts[:1])
        if not parts:
            raise ValueError("concat needs at least one part")
        first = parts[0]
        for i, p in enumerate(parts):
            if p.dtype != first.dtype or p.ndim != first.ndim:
                raise ValueError(
                    f"part {i} holds {p.dtype} rows of {p.ndim} axes, part 0 {first.dtype} "
                    f"rows of {first.ndim} axes"
                )
        chunks = [c for p in parts for c in p.chunks()]
        if len(chunks) == 1:
            return chunks[0]
        rows = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum([len(c) for c in chunks], out=rows[1:])
        offsets = np.zeros(int(rows[-1]) + 1, dtype=np.int64)
        for c, a in zip(chunks, rows[:-1].tolist(), strict=True):
            o = c.offsets.cpu().numpy()
            offsets[a + 1 : a + 1 + len(c)] = o[1:] + offsets[a]
        out = cls.__new__(cls)
        _VALUES_SLOT.__set__(out, None)
        out.offsets = torch.from_numpy(offsets)
        out.shapes = torch.cat([c.shapes.cpu() for c in chunks])
        out._chunks = tuple(chunks)
        out._chunk_rows = rows
        out._alloc = alloc
        return out

    @classmethod
    def from_dense(cls, batch: torch.Tensor) -> Shaped:
        """A dense batch ``[B, *shape]`` as rows of ``shape`` each, over the same memory when
        it is contiguous (a view; otherwise one copy). No loop over rows."""
        rows, shape = int(batch.shape[0]), [int(d) for d in batch.shape[1:]]
        per_row = 1
        for d in shape:
            per_row *= d
        offsets = torch.arange(rows + 1, dtype=torch.int64) * per_row
        shapes = torch.tensor(shape, dtype=torch.int64).expand(rows, len(shape)).contiguous()
        return cls(batch.reshape(-1), offsets, shapes)

    @classmethod
    def from_padded(  # type: ignore[override]
        cls, padded: torch.Tensor, shapes: torch.Tensor | Sequence[Sequence[int]]
    ) -> Shaped:
        """Inverse of :meth:`to_padded`: row i is ``padded[i]`` cut to ``shapes[i]``."""
        sh = torch.as_tensor(shapes, dtype=torch.int64)
        rows = [padded[i][tuple(slice(0, d) for d in sh[i].tolist())] for i in range(len(sh))]
        return cls.from_tensors(rows, padded.dtype)

    # -- properties --------------------------------------------------------------------------
    @property
    def values(self) -> torch.Tensor:
        """All rows' elements in one buffer (a read over several buffers gathers them here,
        once)."""
        v: torch.Tensor | None = _VALUES_SLOT.__get__(self, Shaped)
        if v is None:
            shape = (int(self.offsets[-1]),)
            device = self._chunks[0].values.device
            if self._alloc is not None and device.type == "cpu":
                v = self._alloc(shape, self.dtype)
            else:
                v = torch.empty(shape, dtype=self.dtype, device=device)
            o = self.offsets.numpy()
            for c, (a, b) in zip(
                self._chunks, itertools.pairwise(self._chunk_rows.tolist()), strict=True
            ):
                dst, src = v[int(o[a]) : int(o[b])], c.values
                if src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous():
                    copy_bytes(as_bytes(dst).reshape(-1), as_bytes(src).reshape(-1))
                else:
                    dst.copy_(src)
            _VALUES_SLOT.__set__(self, v)
            self._chunks = ()
            self._chunk_rows = np.zeros(1, dtype=np.int64)
            self._alloc = None
        return v

    @values.setter
    def values(self, values: torch.Tensor) -> None:
        _VALUES_SLOT.__set__(self, values)

    @property
    def dtype(self) -> torch.dtype:
        return self._chunks[0].dtype if self._chunks else self.values.dtype

    @property
    def inner_shape(self) -> tuple[int, ...]:
        return ()  # (values are flat; a row's shape is in ``shapes``)

    @property
    def nbytes(self) -> int:
        if not self._chunks:
            return super().nbytes
        return sum(c.nbytes for c in self._chunks)

    @property
    def ndim(self) -> int:
        """Number of axes of every row."""
        return int(self.shapes.shape[1])

    def chunks(self) -> list[Shaped]:
        """The buffers the rows lie in, in row order, each a Shaped of its own (``[self]``
        when they lie in one)."""
        return list(self._chunks) if self._chunks else [self]

    def with_values(self, values: torch.Tensor, offsets: torch.Tensor | None = None) -> Shaped:
        return Shaped(values, self.offsets if offsets is None else offsets, self.shapes)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not self._chunks:
            flat = super().__getitem__(i)
            return flat.view(self.shapes[i % len(self)].tolist())
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        k = int(np.searchsorted(self._chunk_rows, i, side="right")) - 1
        return self._chunks[k][i - int(self._chunk_rows[k])]

    def __repr__(self) -> str:
        return (
            f"Shaped(rows={len(self)}, elements={int(self.offsets[-1])}, "
            f"dtype={self.dtype}, ndim={self.ndim}, chunks={len(self.chunks())})"
        )

    def __eq__(self, other: object) -> bool:
        """Bit-exact equality of shapes and content (NaNs compare by bits), however either
        side's rows are chunked."""
        if not isinstance(other, Shaped):
            return NotImplemented
        if not (
            self.dtype == other.dtype
            and torch.equal(self.shapes, other.shapes)
            and torch.equal(self.offsets, other.offsets)
        ):
            return False
        if not self._chunks and not other._chunks:
            return _bits_equal(self.values, other.values)
        mine, theirs = self._spans(), other._spans()
        cuts = sorted({0, int(self.offsets[-1]), *mine, *theirs})
        return all(
            _bits_equal(self._elements(a, b, mine), other._elements(a, b, theirs))
            for a, b in itertools.pairwise(cuts)
        )

    def _spans(self) -> dict[int, torch.Tensor]:
        """Each chunk's values by the element index it starts at."""
        if not self._chunks:
            return {0: _VALUES_SLOT.__get__(self, Shaped)}
        o = self.offsets.numpy()
        return {
            int(o[a]): c.values
            for c, a in zip(self._chunks, self._chunk_rows[:-1].tolist(), strict=True)
        }

    @staticmethod
    def _elements(a: int, b: int, spans: dict[int, torch.Tensor]) -> torch.Tensor:
        """Elements ``a:b`` of the rows, which lie within one span."""
        start = max(s for s in spans if s <= a)
        return spans[start][a - start : b - start]

    __hash__ = None

    # -- views and copies --------------------------------------------------------------------
    def unbind(self) -> list[torch.Tensor]:
        """Row views of their own shapes, sharing memory with ``values`` (zero copy)."""
        if self._chunks:
            return [row for c in self._chunks for row in c.unbind()]
        flat = super().unbind()
        return [t.view(s) for t, s in zip(flat, self.shapes.tolist(), strict=True)]

    def to_padded(  # type: ignore[override]
        self, pad_value: float | int = 0, *, shape: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy into ``[B, *shape]`` (default: the largest size per axis); returns (padded,
        mask) where ``mask`` is True on the elements that belong to a row. (A Ragged returns
        its lengths instead of a mask, and takes a ``width``: rows of any shape need both.)"""
        most = self.shapes.amax(dim=0).tolist() if len(self) else [0] * self.ndim
        size = most if shape is None else [int(d) for d in shape]
        if len(size) != self.ndim or any(s < m for s, m in zip(size, most, strict=True)):
            raise ValueError(f"shape {size} does not hold every row (largest sizes {most})")
        out = torch.full((len(self), *size), pad_value, dtype=self.dtype)
        mask = torch.zeros((len(self), *size), dtype=torch.bool)
        for i, row in enumerate(self.unbind()):
            region: tuple[int | slice, ...] = (i, *(slice(0, d) for d in row.shape))
            out[region] = row
            mask[region] = True
        return out, mask

    def slice(self, start: int, stop: int) -> Shaped:
        if self._chunks:
            if not 0 <= start <= stop <= len(self):
                raise IndexError(f"rows {start}:{stop} out of range for {len(self)} rows")
            bounds = self._chunk_rows.tolist()
            parts = [
                c.slice(max(start, a) - a, min(stop, b) - a)
                for c, a, b in zip(self._chunks, bounds[:-1], bounds[1:], strict=True)
                if a < stop and start < b
            ]
            return Shaped.concat(parts) if parts else self._chunks[0].slice(0, 0)
        r = super().slice(start, stop)
        return Shaped(r.values, r.offsets, self.shapes[start:stop])

    def take(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> Shaped:
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        if self._chunks:  # (row by row from the chunks: no gather of the whole batch first)
            picked = [self[i] for i in idx.tolist()]
            out = Shaped.from_tensors(picked, self.dtype)
            return Shaped(out.values, out.offsets, self.shapes.index_select(0, idx))
        r = super().take(idx)
        return Shaped(r.values, r.offsets, self.shapes.index_select(0, idx))

    def clone(self) -> Shaped:
        if self._chunks:  # (the gather is the copy)
            return self.take(np.arange(len(self)))
        return Shaped(self.values.clone(), self.offsets.clone(), self.shapes.clone())
