"""Bulk copies of tensor rows as plain single-threaded memcpy (through numpy byte views).

Why not ``Tensor.copy_``: torch parallelizes element copies over its intra-op thread pool.
On a machine whose cores are busy with other work (an RL loop: generation, training, reward
all at once) the pool's threads wait for each other and a 2 MB copy measured 5-7 ms (0.3 GB/s)
where ``np.copyto`` took 0.35 ms (6 GB/s). Every copy TransferQueue makes is a memory-bound
move of whole rows, which one thread does at memory speed, so this module does them on bytes.

All functions take tensors whose first axis is the row axis; any dtype (bf16 included: the
bytes are what is copied); :func:`copy_bytes` takes flat byte arrays.

One thread copies at about half the host's memory speed: a 78.6 MB copy took 12.8 ms on one
thread and 6.5 ms split over two on the 2-core reference host (under load; four threads:
6.0 ms). :func:`copy_bytes` splits a large copy in two, the second half on a worker thread
(numpy drops the GIL while it copies).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["as_bytes", "copy_bytes", "copy_rows", "gather_rows", "scatter_rows"]

SPLIT_BYTES = 8 << 20
"""A :func:`copy_bytes` of at least this many bytes is split over two threads."""
_helper: ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = ThreadPoolExecutor(1, thread_name_prefix="tq-memcpy")
        return _helper


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` for flat uint8 arrays of one size; from :data:`SPLIT_BYTES` on, the
    second half is copied on a worker thread meanwhile (waited for, also on an error)."""
    n = dst.size
    if n < SPLIT_BYTES:
        np.copyto(dst, src)
        return
    half = (n // 2) & ~63
    rest = _helper_pool().submit(np.copyto, dst[half:], src[half:])
    try:
        np.copyto(dst[:half], src[:half])
    finally:
        rest.result()


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A ``[rows, row_bytes]`` uint8 numpy view of a contiguous tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    rows = t.shape[0] if t.dim() else 1
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return flat.numpy().reshape(rows, -1) if rows else flat.numpy().reshape(0, 0)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:] = src`` for tensors of one shape and dtype."""
    if dst.numel() == 0:
        return
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype:
        np.copyto(as_bytes(dst), as_bytes(src))
    else:
        dst.copy_(src)


def gather_rows(dst: torch.Tensor, src: torch.Tensor, rows: np.ndarray) -> None:
    """``dst[:] = src[rows]`` (one pass over the selected rows)."""
    if dst.numel() == 0:
        return
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype:
        np.take(as_bytes(src), rows, axis=0, out=as_bytes(dst))
    else:
        dst.copy_(src[torch.from_numpy(rows)])


def scatter_rows(dst: torch.Tensor, rows: np.ndarray, src: torch.Tensor) -> None:
    """``dst[rows] = src``."""
    if src.numel() == 0:
        return
    if dst.is_contiguous() and dst.dtype == src.dtype:
        s = src if src.is_contiguous() else src.contiguous()
        as_bytes(dst)[rows] = as_bytes(s)
    else:
        dst[torch.from_numpy(rows)] = src
