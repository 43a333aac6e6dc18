"""Allocator settings for TransferQueue server processes: keep freed payload memory for reuse.

A storage unit allocates a buffer for each put whose payload it copies (ragged values that
arrive in a client's shared-memory arena, frames ZeroMQ receives) and frees it once the rows
are consumed. glibc hands large freed blocks straight back to the kernel: a block above the
mmap threshold is unmapped, and free space at the top of the heap beyond the trim threshold is
trimmed. Both thresholds adapt to the sizes the process has freed so far, so whether a unit
reuses its memory depends on the order of sizes it happened to see. When it does not, every
put lands in fresh pages that the kernel must fault in and zero one by one: measured, a
4.4 MB ragged put cost a unit 1,066 page faults and about 1.3 ms of CPU more per put than in a
run whose thresholds had settled the other way.

:func:`keep_freed_memory` fixes both thresholds, so blocks up to ``mmap_threshold`` come from
the heap and up to ``trim_threshold`` bytes of freed memory stay in the process for the next
put. The server entry points (local processes, Ray actors) call it; it changes only the process
it runs in, so client processes (user code) are left alone. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Blocks below this come from the heap (glibc's largest allowed value on 64-bit)."""
TRIM_THRESHOLD = 256 << 20
"""Freed memory kept at the top of the heap before any is returned to the kernel."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
ENV_DISABLE = "TRANSFERQUEUE_DEFAULT_MALLOC"
"""Set to ``1`` to keep the allocator's own (adaptive) settings in server processes."""


def keep_freed_memory(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True if they were set.

    Returns False (and changes nothing) when the C library is not glibc, or when
    ``TRANSFERQUEUE_DEFAULT_MALLOC=1`` is set in the environment.
    """
    if mmap_threshold <= 0 or trim_threshold <= 0:
        raise ValueError(
            f"thresholds must be > 0, got mmap {mmap_threshold} and trim {trim_threshold}"
        )
    if os.environ.get(ENV_DISABLE) == "1":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 when a value is out of range.
    ok = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
    return mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1 and ok
