"""Second copies of rows (``replicas=2``), as the client writes and reads them.

A service started with ``replicas=2`` places every row on two storage units (its ``unit`` and,
in ``BatchMeta.replica_units``, its second one; see :mod:`transferqueue.controller.placement`), and
the controller keeps a row as long as one of its copies is on a live unit (see
:mod:`transferqueue.controller.health`). The client's side:

- **writes** (:func:`write_groups`, :func:`gather_copies`): a put writes each row to both
  units, under the controller's grants (one per unit, covering the rows of both copies). A
  write that fails because a unit is gone (:class:`PeerGoneError`, or
  :class:`UnknownRowError` from a unit restarted since) is fine as long as every row got one
  copy written: the commit names the units found gone (``Commit.dropped``) and the controller
  forgets the rows' copies there (and frees them there, should the unit be alive after all:
  a client can lose sight of a unit the controller still hears), as it does for every copy
  of a unit it declares dead (or, restarted, hears with a new incarnation);
- **reads** (:func:`fall_back`): rows are read from their first unit; when that unit's read
  fails so (it died, or restarted empty), those rows are read again from their second unit.
  Only when no copy answers does the read take the lost-rows path (``RowsLostError`` for the
  rows the controller lost, else the unit's error).

Puts of a client to a replicated service skip staging (the copy into a unit's write arena
while the rows are allocated, :meth:`~transferqueue.client.links.UnitLink.stage`): it stages for one
unit, and a put now writes two. Each copy still goes through its own unit's shared-memory
arenas when that unit is on the client's host.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

import numpy as np

from transferqueue.errors import PeerGoneError, UnknownRowError
from transferqueue.meta import BatchMeta

__all__ = ["UnitReadError", "fall_back", "gather_copies", "meta_units", "tag", "write_groups"]


class UnitReadError(Exception):
    """A read of unit ``unit`` failed with ``error`` (gone, or restarted without the rows):
    raised inside a replicated read so that the client knows which unit to avoid."""

    def __init__(self, unit: int, error: PeerGoneError | UnknownRowError) -> None:
        super().__init__(f"unit {unit}: {error}")
        self.unit = unit
        self.error = error


async def tag(unit: int, read: Awaitable[object]) -> object:
    """``read`` (of unit ``unit``), its failure of a unit gone as a :class:`UnitReadError`."""
    try:
        return await read
    except (PeerGoneError, UnknownRowError) as e:
        raise UnitReadError(unit, e) from e


def _groups(units: np.ndarray) -> list[tuple[int, np.ndarray]]:
    return [(int(u), np.flatnonzero(units == u)) for u in np.unique(units).tolist() if u >= 0]


def write_groups(meta: BatchMeta) -> list[tuple[int, np.ndarray]]:
    """(unit, ascending positions) of each write a put of ``meta``'s rows makes: the rows'
    first copies, then their second ones. A run of rows on one unit is one contiguous slice
    of the batch (a view, no copy) as the placement puts contiguous chunks on units."""
    assert meta.replica_units is not None
    return _groups(meta.units) + _groups(meta.replica_units)


async def gather_copies(
    groups: Sequence[tuple[int, np.ndarray]], writes: Sequence[Awaitable[None]], n: int
) -> list[int]:
    """Run the writes of both copies; fail only when a row got no copy written, or a write
    failed for another reason than its unit being gone (see the module). Returns the units
    found gone (for ``Commit.dropped``: the controller forgets the copies there)."""
    results = await asyncio.gather(*writes, return_exceptions=True)
    written = np.zeros(n, dtype=bool)
    gone: BaseException | None = None
    dropped: set[int] = set()
    for (unit, pos), result in zip(groups, results, strict=True):
        if result is None:
            written[pos] = True
        elif isinstance(result, PeerGoneError | UnknownRowError):
            gone = gone or result
            dropped.add(unit)
        else:
            raise result
    if gone is not None and not written.all():
        raise gone
    return sorted(dropped)


def fall_back(meta: BatchMeta, units: np.ndarray, dead: set[int]) -> np.ndarray | None:
    """Where to read each row from when the units ``dead`` failed: ``units`` with the rows
    on a dead unit moved to their other copy; None when one of them has no other copy."""
    copies = meta.replica_units
    if copies is None:
        return None
    avoid = np.fromiter(dead, dtype=np.int32)
    bad = np.isin(units, avoid)
    first = meta.units[bad]
    alt = np.where(units[bad] == first, copies[bad], first)  # (the copy not yet tried)
    if (alt < 0).any() or np.isin(alt, avoid).any():
        return None
    out = units.copy()
    out[bad] = alt
    return out


def meta_units(meta: BatchMeta) -> list[int]:
    """Every unit holding a copy of one of ``meta``'s rows."""
    units = meta.units if meta.replica_units is None else np.r_[meta.units, meta.replica_units]
    return [int(u) for u in np.unique(units).tolist() if u >= 0]
