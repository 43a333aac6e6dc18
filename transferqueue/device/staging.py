"""Device columns to and from host memory through a bounded pool of pinned chunks.

A put of CUDA tensors (``Client.put``) and a read onto a device (``get_data(meta,
device="cuda:N")``) move the bytes a *chunk* of rows at a time through the pool
(:class:`~transferqueue.device.pinned.PinnedPool`), on a copy stream of their own, two chunks
in flight, so that the copy of one chunk overlaps the other's host-side work:

| direction | chunk ``i`` on the copy stream          | meanwhile, on the host                  |
|-----------|-----------------------------------------|-----------------------------------------|
| put       | device rows -> pinned chunk (D2H)       | chunk ``i - 1`` written to its unit     |
| read      | pinned chunk -> device output (H2D)     | chunk ``i + 1`` gathered into a chunk   |

A chunk holds whole rows of every device column of the part being moved (each column at a
64-byte aligned offset); a row larger than a chunk goes alone, through memory of its own.
The copy stream first waits for the work the caller queued on its stream (``ready``), so a put
reads the tensors as the caller's kernels leave them; a read returns only once its copies are
done, so its tensors are ready on any stream.

The copies go through a :class:`Copier`: :class:`CudaCopier` (a CUDA stream and events) where
there is a GPU, :class:`HostCopier` (synchronous) otherwise, which is how the chunking and the
pool's bookkeeping run in the CPU tests.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from transferqueue.device.pinned import PinnedPool
from transferqueue.ragged import Ragged

__all__ = [
    "CHUNK_BYTES",
    "PINNED_BYTES",
    "Copier",
    "CudaCopier",
    "DeviceStaging",
    "HostCopier",
    "StagedChunk",
    "is_device",
    "row_chunks",
]

PINNED_BYTES = 512 << 20
"""Default pinned memory of a TransferQueue handle's pool (``configure_device``)."""
CHUNK_BYTES = 64 << 20
"""Default chunk: large enough for the copy engine's full speed, small enough to pipeline."""
_ALIGN = 64


class Fence(Protocol):
    def synchronize(self) -> None:
        """Block until the copies issued before the fence are done."""
        ...


class Copier(Protocol):
    """Issues copies on a copy stream of its own (see the module doc)."""

    def wait_for(self, ready: Any) -> None:
        """Later copies start after ``ready`` (a fence of the caller's stream, or None)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, queued on the copy stream."""
        ...

    def fence(self) -> Fence:
        """A fence after every copy queued so far."""
        ...


class _Done:
    def synchronize(self) -> None:
        pass


class HostCopier:
    """Copies at once, on the calling thread (no GPU: the pipeline degenerates to a loop)."""

    def wait_for(self, ready: Any) -> None:
        del ready

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def fence(self) -> Fence:
        return _Done()


class CudaCopier:
    """A copy stream on ``device``; fences are CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def wait_for(self, ready: Any) -> None:
        if ready is not None:
            self.stream.wait_event(ready)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # The tensor on the device may be a temporary (a gather, a contiguous copy) made on
        # the caller's stream: the allocator must not hand its memory out again before this
        # stream read it.
        for t in (dst, src):
            if t.device.type == "cuda":
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def is_device(col: object) -> bool:
    """Whether a column lives on an accelerator (a tensor, a Ragged's values, or a list of
    tensors not on the CPU)."""
    if isinstance(col, torch.Tensor):
        return col.device.type != "cpu"
    if isinstance(col, Ragged):
        return col.values.device.type != "cpu"
    if isinstance(col, list | tuple) and col and isinstance(col[0], torch.Tensor):
        return col[0].device.type != "cpu"
    return False


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _row_bytes(col: torch.Tensor | Ragged) -> np.ndarray | int:
    """Bytes per row: one number for a dense column, per-row for a Ragged."""
    if isinstance(col, Ragged):
        inner = col.values[0:0].element_size() * int(np.prod(col.inner_shape or (1,)))
        return np.diff(col.offsets.cpu().numpy()) * inner
    return int(col[0:0].element_size() * int(np.prod(col.shape[1:] or (1,))))


def row_chunks(
    cols: Mapping[str, torch.Tensor | Ragged], rows: int, chunk_bytes: int
) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[a, b)`` whose device bytes (every column, each aligned) fit
    ``chunk_bytes``; a row that does not fit alone gets a range of its own."""
    per_row = np.zeros(rows, dtype=np.int64)
    for col in cols.values():
        per_row += _row_bytes(col)
    slack = _ALIGN * len(cols)  # each column starts aligned in the chunk
    cum = np.concatenate([[0], np.cumsum(per_row)])
    budget = chunk_bytes - slack
    chunks: list[tuple[int, int]] = []
    start = 0
    while start < rows:  # the most rows from ``start`` that fit (at least one)
        end = int(np.searchsorted(cum, cum[start] + budget, side="right")) - 1
        end = min(max(end, start + 1), rows)
        chunks.append((start, end))
        start = end
    return chunks or [(0, rows)]


def _rows(col: torch.Tensor | Ragged, a: int, b: int) -> torch.Tensor | Ragged:
    return col.slice(a, b) if isinstance(col, Ragged) else col[a:b]


@dataclass
class StagedChunk:
    """Rows ``[a, b)`` of a part, copied (or being copied) to host memory."""

    a: int
    b: int
    columns: dict[str, Any]
    fence: Fence
    lent: list[torch.Tensor] = field(default_factory=list)


class DeviceStaging:
    """The pool and the copy streams of one TransferQueue handle (see the module doc)."""

    def __init__(
        self,
        capacity_bytes: int = PINNED_BYTES,
        chunk_bytes: int = CHUNK_BYTES,
        *,
        pin: bool | None = None,
        host_copies: bool | None = None,
    ) -> None:
        self.pool = PinnedPool(capacity_bytes, chunk_bytes, pin=pin)
        if self.pool.limit < 2:
            raise ValueError("the pinned pool needs room for two chunks (one per side)")
        self._host = not torch.cuda.is_available() if host_copies is None else host_copies
        self._copiers: dict[torch.device, Copier] = {}
        self._lock = threading.Lock()

    def copier(self, device: torch.device) -> Copier:
        if self._host or device.type != "cuda":
            return HostCopier()
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            if device not in self._copiers:
                self._copiers[device] = CudaCopier(device)
            return self._copiers[device]

    def close(self) -> None:
        self.pool.close()

    # -- put: device -> host ------------------------------------------------------------------

    def chunks_to_host(
        self, part: Mapping[str, Any], rows: int, ready: Any = None
    ) -> Generator[StagedChunk, None, None]:
        """The part's rows a chunk at a time, each one's device columns copied into a pinned
        chunk (host columns as they are). Yields a chunk once its copy is *queued*; the caller
        waits on ``chunk.fence``, uses it, then :meth:`release` s it. Blocks while the pool's
        chunks are all lent."""
        dev = {k: v for k, v in part.items() if is_device(v)}
        if not dev:
            yield StagedChunk(0, rows, dict(part), _Done())
            return
        device = next(iter(dev.values()))
        device = device.values.device if isinstance(device, Ragged) else device.device
        copier = self.copier(device)
        copier.wait_for(ready)
        for a, b in row_chunks(dev, rows, self.pool.chunk_bytes):
            cols: dict[str, Any] = {k: _rows(v, a, b) for k, v in part.items() if k not in dev}
            staged = StagedChunk(a, b, cols, _Done())
            need = sum(_aligned(_nbytes(_rows(v, a, b))) for v in dev.values())
            buf = self._buffer(need, staged)
            offset = 0
            for name, col in dev.items():
                piece = _rows(col, a, b)
                src = piece.values if isinstance(piece, Ragged) else piece
                src = src if src.is_contiguous() else src.contiguous()
                n = src.numel() * src.element_size()
                dst = buf[offset : offset + n].view(src.dtype).view(src.shape)
                if n:
                    copier.copy(dst, src)
                offset += _aligned(n)
                if isinstance(piece, Ragged):
                    cols[name] = piece.with_values(dst, piece.offsets.cpu())
                else:
                    cols[name] = dst
            staged.columns = cols
            staged.fence = copier.fence()
            yield staged

    def _buffer(self, need: int, staged: StagedChunk) -> torch.Tensor:
        if need <= self.pool.chunk_bytes:
            chunk = self.pool.acquire()
            staged.lent.append(chunk)
            return chunk
        # one row larger than a chunk: memory of its own, pinned where it can be
        return torch.empty(need, dtype=torch.uint8, pin_memory=self.pool.pin)

    def release(self, staged: StagedChunk) -> None:
        """Give the chunk's pinned memory back (its copy must be done and its use over)."""
        for chunk in staged.lent:
            self.pool.release(chunk)
        staged.lent.clear()

    # -- read: host -> device -----------------------------------------------------------------

    def to_device(self, cols: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
        """Host columns onto ``device`` through pinned chunks; object columns as they are.
        Blocks until every copy is done (run it off the event loop)."""
        out: dict[str, Any] = {}
        moving: dict[str, torch.Tensor | Ragged] = {}
        for name, col in cols.items():
            if not isinstance(col, torch.Tensor | Ragged):
                out[name] = col
            elif is_device(col):  # already on a device (a shared column): a device copy
                out[name] = _to(col, device)
            else:
                moving[name] = col
        if not moving:
            return {name: out[name] for name in cols}
        rows = len(next(iter(moving.values())))
        dsts: dict[str, torch.Tensor] = {}
        for name, col in moving.items():
            src = col.values if isinstance(col, Ragged) else col
            dsts[name] = torch.empty(src.shape, dtype=src.dtype, device=device)
        copier = self.copier(device)
        in_flight: list[StagedChunk] = []
        try:
            for a, b in row_chunks(moving, rows, self.pool.chunk_bytes):
                staged = StagedChunk(a, b, {}, _Done())
                parts = {k: _rows(v, a, b) for k, v in moving.items()}
                need = sum(_aligned(_nbytes(p)) for p in parts.values())
                buf = self._buffer(need, staged)
                offset = 0
                for name, piece in parts.items():
                    src = piece.values if isinstance(piece, Ragged) else piece
                    n = src.numel() * src.element_size()
                    if n:
                        pinned = buf[offset : offset + n].view(src.dtype).view(src.shape)
                        _host_copy(pinned, src)
                        start = _value_start(moving[name], a)
                        copier.copy(dsts[name][start : start + src.shape[0]], pinned)
                    offset += _aligned(n)
                staged.fence = copier.fence()
                in_flight.append(staged)
                if len(in_flight) >= 2:  # the chunk before last is free again
                    done = in_flight.pop(0)
                    done.fence.synchronize()
                    self.release(done)
            for staged in in_flight:
                staged.fence.synchronize()
        finally:
            for staged in in_flight:
                with contextlib.suppress(Exception):
                    staged.fence.synchronize()
                self.release(staged)
        for name, col in moving.items():
            if isinstance(col, Ragged):
                out[name] = col.with_values(dsts[name])
            else:
                out[name] = dsts[name]
        return {name: out[name] for name in cols}


def _to(col: torch.Tensor | Ragged, device: torch.device) -> torch.Tensor | Ragged:
    if isinstance(col, Ragged):
        return col.with_values(col.values.to(device))
    return col.to(device)


def _value_start(col: torch.Tensor | Ragged, row: int) -> int:
    return int(col.offsets[row]) if isinstance(col, Ragged) else row


def _nbytes(col: torch.Tensor | Ragged) -> int:
    if isinstance(col, Ragged):
        return col.values.numel() * col.values.element_size()
    return col.numel() * col.element_size()


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One plain memcpy (torch's copy spreads tiny copies over busy threads)."""
    from transferqueue.memcpy import copy_rows

    if src.dim() == 0:
        dst.copy_(src)
    else:
        copy_rows(dst, src if src.is_contiguous() else src.contiguous())
