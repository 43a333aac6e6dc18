"""Pair process groups and the byte ranges the ``broadcast`` transport moves over them.

A *link* is a torch.distributed process group of exactly two ranks (0 sends, 1 receives),
built over the sender's ``TCPStore`` under its own prefix, so a process can be in many links
and a link can be thrown away (aborted) without touching the others. Versions travel as the
*image* of :func:`engines.weights_io.plan_state` (every tensor at a 64-byte aligned offset of
one flat byte space, tied names once), cut into *ranges* of at most ``chunk_bytes``:

| range kind | source at the sender                            | when                             |
|------------|-------------------------------------------------|----------------------------------|
| direct     | the trainer's own tensor bytes (zero copy)      | contiguous, on the wire's device,|
|            |                                                 | no cast, at least 1 MiB          |
| packed     | a reused bucket that small tensors (or parts of | everything else                  |
|            | a large one) are copied into                    |                                  |

Receivers receive every range straight into their staged image (``staging[start:end]``), so
the image they keep is the packed layout and ``unpack_buffer`` gives zero-copy views. Every
range starts at a multiple of 64 bytes, so any dtype can be viewed at any part's offset.
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from asyncflow.transport.base import TransportError, TransportTimeoutError
from engines.weights_io import StatePlan

__all__ = [
    "LinkWaiter",
    "Range",
    "abort",
    "host_image",
    "open_store",
    "pair_group",
    "plan_ranges",
    "recv_ranges",
    "send_ranges",
]

_ALIGN = 64
DIRECT_MIN_BYTES = 1 << 20
"""Tensors at least this large are sent from their own memory (smaller ones are packed:
one message per tiny tensor would cost more than the copy)."""


def open_store(host: str, port: int, *, master: bool, timeout_s: float) -> dist.TCPStore:
    """The sender's rendezvous store (``master``: listen on ``port``, 0 for a free one), or a
    receiver's client of it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if master:
        return dist.TCPStore(
            "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timeout
        )
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def pair_group(store: dist.Store, prefix: str, rank: int, *, backend: str, timeout_s: float) -> Any:
    """A two-rank process group under ``prefix``; blocks until the peer builds its side, at
    most ``timeout_s`` (then :class:`TransportTimeoutError`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = dist.PrefixStore(prefix, store)
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(scoped, rank, 2, timeout)
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise TransportError("backend 'nccl' needs a torch build with NCCL (a CUDA build)")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(scoped, rank, 2, options)
    except (RuntimeError, dist.DistError) as e:
        raise TransportTimeoutError(
            f"link {prefix!r} (rank {rank}): the peer did not connect within {timeout_s} s: {e}"
        ) from e


def abort(group: Any) -> None:
    """Stop a link now: its pending operations fail at both ends (best effort)."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.abort()


@dataclass
class Range:
    """Bytes ``[start, end)`` of the image and where the sender takes them from."""

    start: int
    end: int
    direct: torch.Tensor | None = None
    """uint8 view of the caller's own tensor bytes (a direct range)."""
    parts: list[tuple[torch.Tensor, torch.dtype, int, int, int]] = field(default_factory=list)
    """packed range: ``(flat tensor, dtype, first element, end element, byte offset)``."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def pack(self, bucket: torch.Tensor) -> torch.Tensor:
        """The range's bytes: its direct view, or its parts copied into ``bucket``."""
        if self.direct is not None:
            return self.direct
        out = bucket[: self.nbytes]
        for flat, dtype, first, end, offset in self.parts:
            size = (end - first) * dtype.itemsize
            out[offset : offset + size].view(dtype).copy_(flat[first:end])
        return out


def plan_ranges(plan: StatePlan, *, chunk_bytes: int, device: str) -> list[Range]:
    """Cut the image of ``plan`` into ranges of at most ``chunk_bytes`` (a multiple of 64);
    ``device`` is where the wire wants tensors ("cpu" for gloo, "cuda" for NCCL)."""
    if chunk_bytes < _ALIGN or chunk_bytes % _ALIGN:
        raise ValueError(f"chunk_bytes must be a positive multiple of {_ALIGN}, got {chunk_bytes}")
    ranges: list[Range] = []
    current: Range | None = None
    for tensor, dtype, offset in plan.pieces:
        item, numel = dtype.itemsize, tensor.numel()
        if numel == 0:
            continue
        source = tensor.detach()
        if (
            source.dtype == dtype
            and source.is_contiguous()
            and source.device.type == device
            and numel * item >= DIRECT_MIN_BYTES
        ):
            if current is not None:
                ranges.append(current)
                current = None
            raw = source.reshape(-1).view(torch.uint8)
            for a in range(0, raw.numel(), chunk_bytes):
                b = min(a + chunk_bytes, raw.numel())
                ranges.append(Range(offset + a, offset + b, direct=raw[a:b]))
            continue
        # One flat copy of a non-contiguous tensor (rare in state dicts); a view otherwise.
        flat = source.reshape(-1)
        first = 0
        while first < numel:
            position = offset + first * item
            if current is not None and current.start + chunk_bytes - position < item:
                ranges.append(current)
                current = None
            if current is None:
                current = Range(position, position)
            take = min(numel - first, (current.start + chunk_bytes - position) // item)
            current.parts.append((flat, dtype, first, first + take, position - current.start))
            first += take
            current.end = offset + first * item
    if current is not None:
        ranges.append(current)
    return ranges


def host_image(nbytes: int) -> torch.Tensor:
    """A fresh uint8 host buffer for a received image, backed by transparent huge pages where
    the kernel offers them: a transfer into fresh 4 KiB pages page-faults every page (on the
    reference machine 0.5 GB/s, against 2.5 GB/s with huge pages and 4.2 into warm memory)."""
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < (2 << 20) or advise is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):
        area.madvise(advise)
    return torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive


def seconds(timeout_s: float) -> datetime.timedelta:
    """A wait bound for ``Work.wait`` (0 would mean "no bound" there)."""
    return datetime.timedelta(seconds=max(0.001, timeout_s))


def send_ranges(
    group: Any, image: torch.Tensor, ranges: Sequence[Sequence[int]], step_s: float
) -> None:
    """Send ``image[start:end]`` of every range to rank 1 of ``group`` (a holder serving a
    newcomer from its staged image); raises when the peer fails or a range takes longer than
    ``step_s``. The image is not changed meanwhile, so a peer can never see mixed bytes."""
    for tag, (start, end) in enumerate(ranges):
        group.send([image[start:end]], 1, tag).wait(seconds(step_s))


def recv_ranges(
    group: Any,
    image: torch.Tensor,
    ranges: Sequence[Sequence[int]],
    step_s: float,
    *,
    bucket: torch.Tensor | None = None,
) -> None:
    """Receive every range from rank 0 of ``group`` into ``image[start:end]``, each within
    ``step_s`` of asking for it (a sender may pause on a slow peer between ranges); with a
    device ``bucket`` (NCCL), receive there first and copy to the host image."""
    for tag, (start, end) in enumerate(ranges):
        if bucket is None:
            group.recv([image[start:end]], 0, tag).wait(seconds(step_s))
        else:
            staged = bucket[: end - start]
            group.recv([staged], 0, tag).wait(seconds(step_s))
            image[start:end].copy_(staged)


class LinkWaiter:
    """Waits on one link's sends in its own thread, so the sender can stop waiting for a
    link (its receiver was declared lost) while the others go on.

    A gloo ``Work`` completes only inside ``wait``, and a ``wait`` that times out closes the
    link, so the sender cannot poll: each link gets a thread that waits its sends in order
    and reports ``done`` (the last range sent) or ``error`` under the sender's condition.
    """

    def __init__(self, name: str, cond: threading.Condition, deadline: float) -> None:
        self.name = name
        self.done = -1
        self.error: str | None = None
        self._cond = cond
        self._deadline = deadline
        self._works: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"send-{name}", daemon=True)
        self._thread.start()

    def add(self, index: int, work: Any) -> None:
        self._works.put((index, work))

    def stop(self) -> None:
        """No more sends; the thread ends after the one it waits on (bounded by the deadline)."""
        self._works.put(None)

    def _run(self) -> None:
        while (item := self._works.get()) is not None:
            index, work = item
            try:
                work.wait(seconds(self._deadline - time.monotonic()))
            except Exception as e:
                with self._cond:
                    self.error = f"range {index}: {e}"
                    self._cond.notify_all()
                return
            with self._cond:
                self.done = index
                self._cond.notify_all()
