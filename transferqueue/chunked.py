"""``ChunkedTensor``: a tensor that arrived as several frames and has not been joined.

The wire splits large buffers into frames of at most ``CHUNK_BYTES`` (ZeroMQ moves 1-16 MiB
frames far faster than one huge frame). Joining them is a full copy into fresh memory; a
storage unit skips it: it copies the frames straight into its column buffers, so a received
column is copied once, not twice. Everywhere else a ChunkedTensor is joined at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["ChunkedTensor"]


class ChunkedTensor:
    """``dtype``/``shape`` of a contiguous tensor whose bytes are ``parts`` back to back."""

    def __init__(self, dtype: torch.dtype, shape: Sequence[int], parts: Sequence[memoryview]):
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.parts = [memoryview(p).cast("B") for p in parts]
        expected = self.shape.numel() * dtype.itemsize
        got = sum(p.nbytes for p in self.parts)
        if got != expected:
            raise ValueError(f"chunks hold {got} bytes, dtype and shape need {expected}")

    def __len__(self) -> int:
        return int(self.shape[0]) if len(self.shape) else 1

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def copy_into(self, dst: torch.Tensor) -> None:
        """Copy the bytes into ``dst`` (contiguous, same dtype and shape)."""
        if not dst.is_contiguous() or dst.dtype != self.dtype or dst.shape != self.shape:
            raise ValueError(
                f"copy_into needs a contiguous {self.dtype} tensor of shape {tuple(self.shape)}"
            )
        out = dst.reshape(-1).view(torch.uint8).numpy()
        pos = 0
        for part in self.parts:
            n = part.nbytes
            np.copyto(out[pos : pos + n], np.frombuffer(part, dtype=np.uint8))
            pos += n

    def materialize(self) -> torch.Tensor:
        """Join into one new tensor (one copy)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(out)
        return out
