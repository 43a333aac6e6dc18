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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from transferqueue.memcpy import copy_rows
from transferqueue.ragged import Ragged, _bits_equal

__all__ = ["Shaped"]


class Shaped(Ragged):
    """Rows of any shape (fixed dtype and number of axes) in one contiguous buffer."""

    __slots__ = ("shapes",)

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, shapes: torch.Tensor) -> None:
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
    def ndim(self) -> int:
        """Number of axes of every row."""
        return int(self.shapes.shape[1])

    def with_values(self, values: torch.Tensor, offsets: torch.Tensor | None = None) -> Shaped:
        return Shaped(values, self.offsets if offsets is None else offsets, self.shapes)

    def __getitem__(self, i: int) -> torch.Tensor:
        flat = super().__getitem__(i)
        return flat.view(self.shapes[i % len(self)].tolist())

    def __repr__(self) -> str:
        return (
            f"Shaped(rows={len(self)}, elements={self.values.shape[0]}, "
            f"dtype={self.dtype}, ndim={self.ndim})"
        )

    def __eq__(self, other: object) -> bool:
        """Bit-exact equality of shapes and content (NaNs compare by bits)."""
        if not isinstance(other, Shaped):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and torch.equal(self.shapes, other.shapes)
            and torch.equal(self.offsets, other.offsets)
            and _bits_equal(self.values, other.values)
        )

    __hash__ = None

    # -- views and copies --------------------------------------------------------------------
    def unbind(self) -> list[torch.Tensor]:
        """Row views of their own shapes, sharing memory with ``values`` (zero copy)."""
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
        r = super().slice(start, stop)
        return Shaped(r.values, r.offsets, self.shapes[start:stop])

    def take(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> Shaped:
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        r = super().take(idx)
        return Shaped(r.values, r.offsets, self.shapes.index_select(0, idx))

    def clone(self) -> Shaped:
        return Shaped(self.values.clone(), self.offsets.clone(), self.shapes.clone())
