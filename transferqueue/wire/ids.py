"""Random 63-bit ids (lease ids, request ids) from the operating system's CSPRNG, drawn in
blocks.

One ``getrandom`` call per id costs 10-15 µs on some virtual machines: on the controller that
was half of the work of a ``get_meta`` of 64 rows, for the lease id it draws. Ids are drawn
:data:`BLOCK` at a time instead; they are as random as before (the same source), one
process's pool is never shared with a forked child (it is emptied in the child), and a pool
is a plain list (``pop`` is atomic: threads may draw at once).
"""

from __future__ import annotations

import os
import struct

__all__ = ["BLOCK", "random_id63"]

BLOCK = 512
"""Ids drawn per call to the OS."""

_UNPACK = struct.Struct(f"<{BLOCK}Q").unpack
_pool: list[int] = []
os.register_at_fork(after_in_child=_pool.clear)


def random_id63() -> int:
    """A random id in ``[1, 2**63)``."""
    while True:
        try:
            return _pool.pop()
        except IndexError:
            _pool.extend(v >> 1 for v in _UNPACK(os.urandom(8 * BLOCK)) if v >> 1)
