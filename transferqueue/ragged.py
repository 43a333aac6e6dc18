"""``Ragged``: a batch of variable-length rows as one values buffer plus offsets.

The layout is Arrow's list layout::

    values   [N, *inner]   all rows back to back (N = total elements)
    offsets  [B + 1] int64 row i is values[offsets[i]:offsets[i + 1]]; offsets[0] == 0

Row views (``ragged[i]``, ``unbind``) share memory with ``values``; nothing is copied until
``to_padded`` or ``take``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Ragged"]


class Ragged:
    """Variable-length rows (token ids, per-token logprobs) in one contiguous buffer."""

    __slots__ = ("offsets", "values")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"offsets must be 1-D with B + 1 >= 1 entries, got {offsets.shape}")
        if offsets.dtype != torch.int64:
            offsets = offsets.to(torch.int64)
        if values.dim() < 1:
            raise ValueError("values must have at least one dimension (the element axis)")
        # numpy on CPU: these checks run on every batch that crosses the wire
        o: Any = offsets.numpy() if offsets.device.type == "cpu" else offsets
        first, last = int(o[0]), int(o[-1])
        if first != 0 or last != values.shape[0]:
            raise ValueError(
                f"offsets must start at 0 and end at len(values)={values.shape[0]}, "
                f"got {first}..{last}"
            )
        if o.shape[0] > 1 and bool((o[1:] < o[:-1]).any()):
            raise ValueError("offsets must be non-decreasing")
        self.values = values
        self.offsets = offsets

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls, rows: Sequence[torch.Tensor | np.ndarray], dtype: torch.dtype | None = None
    ) -> Ragged:
        """Concatenate rows (one copy). All rows must share dtype and inner shape."""
        tensors = [torch.as_tensor(r) for r in rows]
        if dtype is None:
            dtype = tensors[0].dtype if tensors else torch.int64
        lengths = [int(t.shape[0]) if t.dim() > 0 else 1 for t in tensors]
        offsets = torch.zeros(len(tensors) + 1, dtype=torch.int64)
        if tensors:
            offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
            parts = [t.reshape(-1) if t.dim() == 0 else t for t in tensors]
            inner = parts[0].shape[1:]
            for i, p in enumerate(parts):
                if p.shape[1:] != inner:
                    raise ValueError(
                        f"row {i} has inner shape {tuple(p.shape[1:])}, row 0 has {tuple(inner)}"
                    )
                if p.dtype != dtype:
                    raise ValueError(f"row {i} has dtype {p.dtype}, expected {dtype}")
            values = torch.cat(parts) if parts else torch.empty((0,), dtype=dtype)
        else:
            values = torch.empty((0,), dtype=dtype)
        return cls(values, offsets)

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[Any]], dtype: torch.dtype) -> Ragged:
        """Build from nested Python lists (e.g. token ids from a tokenizer)."""
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = [x for r in rows for x in r]
        values = torch.tensor(flat, dtype=dtype) if flat else torch.empty((0,), dtype=dtype)
        return cls(values, torch.from_numpy(offsets))

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor | np.ndarray) -> Ragged:
        """Wrap ``values`` split into rows of the given lengths (no copy)."""
        lens = torch.as_tensor(lengths, dtype=torch.int64)
        offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        return cls(values, offsets)

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor | Sequence[int]) -> Ragged:
        """Inverse of :meth:`to_padded`: keep the first ``lengths[i]`` elements of row i."""
        lens = torch.as_tensor(lengths, dtype=torch.int64)
        if padded.shape[0] != lens.numel():
            raise ValueError(f"padded has {padded.shape[0]} rows, lengths has {lens.numel()}")
        width = padded.shape[1] if padded.dim() > 1 else 0
        mask = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)  # [B, T]
        return cls.from_lengths(padded[mask], lens)

    # -- properties --------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def inner_shape(self) -> tuple[int, ...]:
        """Shape of one element (``()`` for token ids)."""
        return tuple(self.values.shape[1:])

    @property
    def lengths(self) -> torch.Tensor:
        """Row lengths, [B] int64."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        i %= n
        return self.values[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.unbind())

    def __repr__(self) -> str:
        return (
            f"Ragged(rows={len(self)}, elements={self.values.shape[0]}, "
            f"dtype={self.dtype}, inner_shape={self.inner_shape})"
        )

    def __eq__(self, other: object) -> bool:
        """Bit-exact equality of layout and content (NaNs compare by bits)."""
        if not isinstance(other, Ragged):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.values.shape == other.values.shape
            and torch.equal(self.offsets, other.offsets)
            and _bits_equal(self.values, other.values)
        )

    __hash__ = None  # type: ignore[assignment]

    # -- views and copies --------------------------------------------------------------------
    def unbind(self) -> list[torch.Tensor]:
        """Row views sharing memory with ``values`` (zero copy)."""
        if len(self) == 0:
            return []
        sizes = self.lengths.tolist()
        return list(torch.split(self.values, sizes, dim=0))

    def to_padded(
        self, pad_value: float | int = 0, *, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy into a ``[B, width, *inner]`` tensor; returns (padded, lengths)."""
        lens = self.lengths
        max_len = int(lens.max()) if len(self) else 0
        width = max_len if width is None else width
        if width < max_len:
            raise ValueError(f"width {width} is shorter than the longest row ({max_len})")
        out = torch.full((len(self), width, *self.inner_shape), pad_value, dtype=self.dtype)
        mask = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)  # [B, width]
        out[mask] = self.values
        return out, lens

    def slice(self, start: int, stop: int) -> Ragged:
        """Rows ``start:stop`` as a view (zero copy; offsets rebased to 0)."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"rows {start}:{stop} out of range for {len(self)} rows")
        offs = self.offsets[start : stop + 1]
        base = int(offs[0])
        return Ragged(self.values[base : int(offs[-1])], offs - base)

    def take(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> Ragged:
        """Gather rows into a new contiguous Ragged (one copy of the selected values)."""
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        starts = self.offsets[:-1][idx]
        lens = self.lengths[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offsets[1:])
        total = int(offsets[-1])
        # element j of the output comes from starts[row(j)] + (j - offsets[row(j)])
        gather = torch.repeat_interleave(starts - offsets[:-1], lens) + torch.arange(total)
        return Ragged(self.values.index_select(0, gather.to(self.values.device)), offsets)

    def clone(self) -> Ragged:
        return Ragged(self.values.clone(), self.offsets.clone())

    def with_values(self, values: torch.Tensor, offsets: torch.Tensor | None = None) -> Ragged:
        """The same rows over another values buffer (a copy elsewhere: device, shared memory);
        a subclass keeps what it adds (a :class:`~transferqueue.Shaped` keeps its shapes)."""
        return Ragged(values, self.offsets if offsets is None else offsets)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equality of the raw bytes (so NaN == NaN and -0.0 != 0.0, as a round trip requires)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a8 = a.contiguous().reshape(-1).view(torch.uint8)
    b8 = b.contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(a8, b8))
