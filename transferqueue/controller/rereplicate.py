"""Re-replication (``replicas=2``): rows left with one copy get a second one again.

A unit that dies leaves the rows it shared with other units with one copy (see
:mod:`transferqueue.controller.health`); without more, a second unit death later loses rows a
producer was told were stored. The controller core plans the copies and records them; the data moves
unit to unit (the controller's server sends the source unit a
:class:`~transferqueue.wire.messages.CopyRows`, the source writes the rows to the target like a
client's put, see :mod:`transferqueue.controller.recopy`). A part of the controller core:

- :meth:`Copies.plan_copies` picks committed live rows with one copy, all on one
  source unit S and with the same committed fields, and a target unit T (alive, not S, on
  another host than S where one is alive, holding the least bytes), up to a bound of rows and
  bytes. Each row is marked with the plan's id (header ``copying``);
- :meth:`Copies.copies_made` (the copy's outcome) makes T the second copy of the rows
  still live and still marked, if T has not died since the plan (its ``unit_epochs`` count
  is unchanged). Every other row of the plan is freed on T: nothing the controller does not
  know stays there;
- a commit of fields to rows (:meth:`~transferqueue.controller.writes.Writes.commit`, with
  ``copies``: the second unit of
  each row the writer wrote, from its meta) clears their marks (a copy under way may have read
  the rows without the new fields), and forgets a second copy the writer did not write (it
  took its meta before the row got that copy: the copy lacks the new fields). Such rows have
  one copy again and are copied again later;
- :meth:`Copies.abandon_copies`: a controller that restarted forgets the plans of the
  process that died (their copies on T are freed by the reconciliation with the units'
  inventories, :mod:`transferqueue.controller.recovery`).

Every one of these calls changes the core and is journaled
(:mod:`transferqueue.controller.journaled`).

The embedded deployment does not re-replicate: its units live in the caller's process and die
with it; its rows keep one copy only when a write to a unit failed (a unit link a test broke).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from transferqueue.controller.journal import Recorder, journaled, journaled_unless_same
from transferqueue.controller.placement import Placement
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes

__all__ = ["COPY_BYTES", "COPY_ROWS", "Copies", "CopyPlan"]

COPY_ROWS = 4096
"""Rows of one copy at most (a unit's loop is busy with one copy at a time)."""
COPY_BYTES = 16 << 20
"""Bytes of one copy at most, as the rows' puts reported them (at least one row)."""


@dataclass
class CopyPlan:
    """One copy to make: ``indexes`` from unit ``source`` to unit ``target``, ``fields``
    (every field committed to each of the rows). ``epoch``: the target's death count when
    planned (:meth:`Copies.copies_made` refuses the copy if it died since)."""

    plan_id: int
    source: int
    target: int
    indexes: np.ndarray
    fields: list[str]
    epoch: int
    nbytes: int
    partition: int = -1  # (the rows' partition id: their fields' specs are its)


class Copies:
    """Second copies of rows: which unit each row's is on (header ``replica``), the copies
    to make again (see the module), and the units' deaths that void them."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, placement: Placement) -> None:
        self._rows = rows
        self._placement = placement
        self.unit_epochs = np.zeros(placement.num_units, dtype=np.int64)  # deaths per unit
        self.plans = 0  # plans made (the id of the last one)
        self.rows_recopied = 0  # second copies made
        self.copies_refused = 0  # rows of plans whose copy did not count (failed, changed)

    def _planned(self) -> int:
        return self.plans

    @journaled_unless_same(_planned)
    def plan_copies(
        self, max_rows: int = COPY_ROWS, max_bytes: int = COPY_BYTES
    ) -> CopyPlan | None:
        """The next copy to make (see the module), or None: nothing to copy, or no unit to
        copy to. Called by the controller server's copier, one plan at a time."""
        h = self._rows.header
        ready = self._rows.ready
        alive = self._placement.alive
        if self._placement.replicas == 1 or int(alive.sum()) < 2:
            return None
        one = h["live"] & h["committed"] & (h["replica"] < 0) & (h["copying"] < 0)
        cand = np.flatnonzero(one)
        if cand.size == 0:
            return None
        first = cand[np.argmin(h["index"][cand])]  # (the oldest row first)
        source = int(h["unit"][first])
        target = self._copy_target(source)
        if target < 0:
            return None
        pid = int(h["partition"][first])
        cand = cand[(h["unit"][cand] == source) & (h["partition"][cand] == pid)]
        names = sorted(ready)
        if names:  # (rows of one copy carry the same fields: one read, one write)
            fields_of = np.stack([ready[n][cand] for n in names], axis=1)
            cand = cand[(fields_of == fields_of[cand == first][0]).all(axis=1)]
            fields = [n for n in names if ready[n][first]]
        else:
            fields = []
        cand = cand[np.argsort(h["index"][cand], kind="stable")][:max_rows]
        sizes = np.cumsum(h["nbytes"][cand])
        cand = cand[: max(1, int(np.searchsorted(sizes, max_bytes, side="right")))]
        self.plans += 1
        h["copying"][cand] = self.plans
        return CopyPlan(
            self.plans,
            source,
            target,
            h["index"][cand].copy(),
            fields,
            int(self.unit_epochs[target]),
            int(h["nbytes"][cand].sum()),
            pid,
        )

    def _copy_target(self, source: int) -> int:
        """The live unit other than ``source`` holding the least bytes, on another host
        than ``source`` where one is alive; -1 if none."""
        place = self._placement
        others = [u for u in np.flatnonzero(place.alive).tolist() if u != source]
        far = [u for u in others if place.hosts[u] != place.hosts[source]]
        pool = far or others
        if not pool:
            return -1
        return min(pool, key=lambda u: (int(place.unit_bytes[u]), u))

    @journaled
    def copies_made(
        self, plan_id: int, target: int, indexes: np.ndarray, epoch: int, ok: bool
    ) -> Changes:
        """The copy of plan ``plan_id`` (rows ``indexes`` to unit ``target``) is done
        (``ok``) or failed. Rows still live, still marked with the plan and without another
        second copy get ``target`` as theirs, if ``target`` did not die meanwhile (``epoch``);
        the rest are freed on ``target`` (the copy may have landed). Returns what to free."""
        h = self._rows.header
        num_units = self._placement.num_units
        indexes = np.asarray(indexes, dtype=np.int64)
        slots = self._rows.lookup(indexes)
        slots = slots[slots >= 0]
        mine = slots[h["copying"][slots] == plan_id]
        h["copying"][mine] = -1
        counts = (
            ok
            and 0 <= target < num_units
            and bool(self._placement.alive[target])
            and int(self.unit_epochs[target]) == epoch
        )
        good = np.empty(0, dtype=np.int64)
        if counts:
            good = mine[h["live"][mine] & (h["replica"][mine] < 0) & (h["unit"][mine] != target)]
            h["replica"][good] = target
            self._placement.add_bytes(np.full(good.size, target, np.int32), h["nbytes"][good])
            self.rows_recopied += int(good.size)
        changes = Changes()
        bad = indexes[~np.isin(indexes, h["index"][good])]
        self.copies_refused += int(bad.size)
        if bad.size and 0 <= target < num_units:
            changes.freed.append(bad)
            changes.freed_units.append(np.full(bad.size, target, dtype=np.int32))
        return changes

    @journaled
    def abandon_copies(self) -> None:
        """Forget every plan under way (a restarted controller: the copier died with the
        old process; the copies it made are freed by the reconciliation)."""
        self._rows.header["copying"][:] = -1

    def landed(self, slots: np.ndarray, copies: np.ndarray | None) -> Changes:
        """Fields were written to rows ``slots`` (a commit, before it marks them ready):
        copies under way of them are refused, and a second copy that the writer did not
        write (``copies``: the second unit of each row it wrote; None: not known) is
        forgotten and freed (see the module)."""
        changes = Changes()
        h = self._rows.header
        if self._placement.replicas == 1:
            return changes
        h["copying"][slots] = -1
        if copies is None:
            return changes
        wrote = np.broadcast_to(np.asarray(copies, dtype=np.int64), slots.shape)
        rep = h["replica"][slots]
        stale = (rep >= 0) & (rep != wrote)
        if stale.any():
            gone = slots[stale]
            units = rep[stale].astype(np.int32)
            self._placement.add_bytes(units, -h["nbytes"][gone])
            h["replica"][gone] = -1
            changes.freed.append(h["index"][gone].copy())
            changes.freed_units.append(units)
        return changes

    def drop_unit(self, unit: int, slots: np.ndarray | None = None) -> np.ndarray:
        """The rows (of ``slots``; default: every live row) with a copy on ``unit`` and
        another elsewhere keep the other one only (a row whose first copy is dropped is now
        on its second's unit). Returns the slots whose copy was dropped."""
        h = self._rows.header
        if slots is None:
            slots = np.flatnonzero(h["live"])
        second = slots[h["replica"][slots] == unit]
        first = slots[(h["unit"][slots] == unit) & (h["replica"][slots] >= 0)]
        gone = np.concatenate([second, first])
        self._placement.add_bytes(np.full(gone.size, unit, dtype=np.int32), -h["nbytes"][gone])
        h["unit"][first] = h["replica"][first]
        h["replica"][gone] = -1
        return gone

    @journaled
    def drop_copies(self, indexes: np.ndarray, units: list[int]) -> Changes:
        """A writer could not write the copies of rows ``indexes`` on ``units`` (it found
        them gone; ``Commit.dropped``): those copies are forgotten where the row keeps
        another (a row whose only copy is there keeps it: it is lost with the unit, if the
        unit died), and freed on the unit in case the write landed after all."""
        changes = Changes()
        if self._placement.replicas == 1:
            return changes
        slots = self._rows.lookup(indexes)
        slots = slots[slots >= 0]
        for unit in sorted(set(units)):
            if 0 <= unit < self._placement.num_units:
                gone = self.drop_unit(unit, slots)
                if gone.size:
                    changes.freed.append(self._rows.header["index"][gone].copy())
                    changes.freed_units.append(np.full(gone.size, unit, dtype=np.int32))
        return changes

    def one_copy(self) -> int:
        """Live rows with a single copy although the service keeps two (0 with replicas=1)."""
        if self._placement.replicas == 1:
            return 0
        h = self._rows.header
        return int((h["live"] & (h["replica"] < 0)).sum())
