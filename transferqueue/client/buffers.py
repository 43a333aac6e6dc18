"""``ResultBuffers``: warm host memory that reads assemble dense columns into.

A read whose rows come from several storage units (or, embedded, from a unit's buffers) gathers
each dense field into one new tensor. Fresh memory for it is cheap to allocate and dear to
touch: the kernel faults in and zeroes every 4 KiB page on first write. For the 302 MB dense
batch over 4 units that was 73,700 page faults and 0.4-0.6 s of client CPU per read on the
reference machine (2 cores), against 0.04 s for the whole cycle with one unit, whose reads
return views of a reused shared-memory arena; it made 4 units slower than 1.

So a handle keeps the buffers of past results and lends each again once the last tensor of
its result is gone, as :class:`~transferqueue.storage.shm.ReadArenas` lends read arenas: a result
the caller keeps keeps its buffer (nothing is ever overwritten under a live tensor), and
``max_bytes`` bounds what is kept and lent together; past it, reads allocate fresh memory as
before. Layout of one lent buffer (each field's tensor a view of it)::

    | field 0 rows | pad to 64 B | field 1 rows | pad | ... |
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from transferqueue.storage.shm import align

__all__ = ["RESULT_BUFFER_BYTES", "ResultBuffers"]

RESULT_BUFFER_BYTES = 1 << 30
"""Default bound of the result buffers one handle keeps (free and lent together)."""
_MIN_BYTES = 1 << 20  # below this, malloc's own reuse is as good: allocate as usual


class _Lent:
    """One buffer lent to one result: ends when the last view handed out is gone."""

    __slots__ = ("__weakref__", "buf", "live", "owner", "sealed")

    def __init__(self, buf: np.ndarray, owner: ResultBuffers) -> None:
        self.buf = buf
        self.owner = owner
        self.live = 0
        self.sealed = False


class ResultBuffers:
    """Reusable buffers for read results, shared by the clients of one handle; thread-safe
    (a result may be dropped on any thread). The client asks for :meth:`tensors` before a
    read that assembles dense columns and fills them."""

    def __init__(self, max_bytes: int = RESULT_BUFFER_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lent_bytes = 0
        self.reused = 0  # reads served from a buffer that was already touched
        # Re-entrant: a result may be collected (and its buffer come back) inside a locked
        # section, on this very thread.
        self._lock = threading.RLock()

    @property
    def bytes(self) -> int:
        """Bytes kept: free buffers and lent ones."""
        with self._lock:
            return self._lent_bytes + sum(b.nbytes for b in self._free)

    def tensors(
        self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor] | None:
        """Uninitialized tensors of the given shapes and dtypes, views of one lent buffer;
        None when the request is small or no buffer fits the bound (allocate as usual)."""
        sizes = {
            f: int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size()
            for f, (shape, dt) in shapes.items()
        }
        total = sum(align(n) for n in sizes.values())
        if total < _MIN_BYTES or total > self.max_bytes:
            return None
        buf = self._take(total)
        if buf is None:
            return None
        lent = _Lent(buf, self)
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for f, (shape, dt) in shapes.items():
            n = sizes[f]
            if n == 0:
                out[f] = torch.empty(shape, dtype=dt)
                continue
            mv = buf[offset : offset + n].data
            lent.live += 1
            weakref.finalize(mv, _drop, lent)
            out[f] = torch.frombuffer(mv, dtype=dt).view(shape)
            offset = align(offset + n)
        with self._lock:
            lent.sealed = True
            ended = lent.live == 0
        if ended:
            self._give_back(lent)
        return out

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One uninitialized tensor: in a warm buffer when it is large and one fits the
        bound, else fresh memory."""
        got = self.tensors({"t": (shape, dtype)})
        return got["t"] if got else torch.empty(shape, dtype=dtype)

    def _take(self, nbytes: int) -> np.ndarray | None:
        """The smallest free buffer holding ``nbytes``, or a new one within the bound
        (dropping free buffers, smallest first, to make room)."""
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.nbytes)
                self._drop_free(buf)
                self._lent_bytes += buf.nbytes
                self.reused += 1
                return buf
            used = self._lent_bytes + sum(b.nbytes for b in self._free)
            for b in sorted(self._free, key=lambda b: b.nbytes):
                if used + nbytes <= self.max_bytes:
                    break
                self._drop_free(b)
                used -= b.nbytes
            if used + nbytes > self.max_bytes:
                return None
            self._lent_bytes += nbytes
        return np.empty(nbytes, dtype=np.uint8)

    def _drop_free(self, buf: np.ndarray) -> None:
        """Remove ``buf`` itself from the free list (``list.remove`` would compare arrays
        element-wise: an error for buffers of other sizes)."""
        self._free = [b for b in self._free if b is not buf]

    def _give_back(self, lent: _Lent) -> None:
        with self._lock:
            self._lent_bytes -= lent.buf.nbytes
            used = self._lent_bytes + sum(b.nbytes for b in self._free)
            if used + lent.buf.nbytes <= self.max_bytes:
                self._free.append(lent.buf)

    def clear(self) -> None:
        """Drop the free buffers (lent ones go when their results do)."""
        with self._lock:
            self._free.clear()


def _drop(lent: _Lent) -> None:
    owner = lent.owner
    with owner._lock:
        lent.live -= 1
        ended = lent.sealed and lent.live == 0
    if ended:
        owner._give_back(lent)
