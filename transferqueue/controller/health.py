"""What the controller does when parts of the service fail, and the stats that report it.

A part of the controller core (:class:`~transferqueue.controller.core.Controller`):

- **a storage unit died** (:meth:`UnitHealth.lose_unit`, called by the controller's server
  when the unit stopped answering its heartbeats, see :mod:`transferqueue.wire.liveness`): its rows
  are *lost* at once. They leave every task's queue and every lease (a lease left with no row
  closes), the controller forgets them, and they are counted (``rows_lost`` in ``stats()``:
  per partition, and per task for the rows it had not consumed). No new row is placed on the
  unit until it is back (:meth:`UnitHealth.unit_back`). Who touches a lost row learns it
  through :class:`~transferqueue.errors.RowsLostError`: a commit (a producer's put: put
  again), a read (``get_data``: acknowledge the rest; ``ack`` skips lost rows);
- **a storage unit died, with replicas=2**: every row was written to two units (its
  ``unit`` and its ``replica``, see
  :meth:`~transferqueue.controller.placement.Placement.replicas_of`). A row with a copy on another
  unit is not lost: that copy becomes the row's only one (its ``unit``), and readers that still name
  the dead unit fall back to it (the client). Only rows with no other copy left (both units died, or
  the row was put while a single unit was alive) are lost as above. A unit that comes back is empty
  and takes new rows; the rows that had a copy on it keep **one copy**
  (``stats()["rows_one_copy"]``) until the controller's server has copied them again, unit to unit,
  onto another live unit (:mod:`transferqueue.controller.rereplicate`,
  :mod:`transferqueue.controller.recopy`; ``rows_recopied``), in bounded batches while it serves. A
  second unit death before that loses those of them whose one copy it held; after it, none: two
  copies survive any one death at a time. The embedded deployment does not copy again (its units die
  with its process);
- **a producer died** between allocating rows and committing them: every allocation has a
  deadline (``allocation_s``); rows still uncommitted after it are discarded and freed on
  their units (:meth:`UnitHealth.reclaim`), counted as ``rows_reclaimed``.

The indexes of lost and reclaimed rows are remembered (the most recent ``LOST_MEMORY``, see
:class:`~transferqueue.controller.rows.GoneRows`), so that a late commit or read gets "lost",
not "never existed". The calls a restarted controller makes to agree with its units
(:mod:`transferqueue.controller.recovery`) are here too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from transferqueue.controller.journal import Recorder, journaled, journaled_unless_same
from transferqueue.controller.leases import LeaseTable
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.placement import Placement
from transferqueue.controller.rereplicate import Copies
from transferqueue.controller.retire import Retirement
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes
from transferqueue.controller.writes import Writes
from transferqueue.wire.replies import DONE, LEASED, QUEUED

__all__ = ["ALLOCATION_S", "UnitHealth"]

ALLOCATION_S = 120.0
"""Default deadline of an allocation: a put must commit its rows within it (a put of GBs
takes seconds), else they are reclaimed as the rows of a producer that died."""


class UnitHealth:
    """Units that die and come back, allocations past their deadline (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(
        self,
        rows: RowTable,
        partitions: Partitions,
        leases: LeaseTable,
        placement: Placement,
        copies: Copies,
        retirement: Retirement,
        writes: Writes,
        *,
        clock: Callable[[], float],
        allocation_s: float = ALLOCATION_S,
    ) -> None:
        if not isinstance(allocation_s, int | float) or not 0 < allocation_s < float("inf"):
            raise ValueError(
                f"allocation_s must be a positive number of seconds, got {allocation_s!r}"
            )
        self._rows = rows
        self._partitions = partitions
        self._leases = leases
        self._placement = placement
        self._copies = copies
        self._retirement = retirement
        self._writes = writes
        self._clock = clock
        self.allocation_s = float(allocation_s)
        self._marks: deque[tuple[float, int]] = deque()  # (time, next index then)
        self._reclaimed_below = 0  # every older allocation was looked at
        self.rows_lost = 0
        self.rows_reclaimed = 0
        self.units_lost = 0

    # -- units -------------------------------------------------------------------------------
    @journaled
    def lose_unit(self, unit: int) -> Changes:
        """Storage unit ``unit`` died: its rows are lost (see the module); no row is placed
        on it until :meth:`unit_back`. Returns what changed (tasks to wake)."""
        self.check_unit(unit)
        if self._placement.alive[unit]:
            self.units_lost += 1
        self._copies.unit_epochs[unit] += 1  # (a copy to it under way does not count)
        self._placement.set_alive(unit, False)
        return self._lose(unit, None)

    @journaled
    def lose_rows(self, unit: int, indexes: np.ndarray) -> Changes:
        """Rows ``indexes`` are gone from unit ``unit``, which lives on (a controller that
        restarted found them missing from the unit's inventory: the unit restarted while
        the controller was down). Their copies there are lost as with :meth:`lose_unit`."""
        self.check_unit(unit)
        self._copies.unit_epochs[unit] += 1
        slots = self._rows.lookup(indexes)
        return self._lose(unit, slots[slots >= 0])

    def _lose(self, unit: int, among: np.ndarray | None) -> Changes:
        """Lose the copies on ``unit`` of the live rows (``among`` these slots; None: all)."""
        changes = Changes()
        h = self._rows.header
        if self._placement.replicas > 1:
            self._copies.drop_unit(unit, among)
        if among is None:
            slots = np.flatnonzero(h["live"] & (h["unit"] == unit))
        else:
            slots = among[h["live"][among] & (h["unit"][among] == unit)]
        if slots.size == 0:
            return changes
        self._rows.gone.remember(h["index"][slots])
        pids = h["partition"][slots]
        for pid in np.unique(pids).tolist():
            part = self._partitions.by_id(pid)
            assert part is not None
            mine = slots if pids.size == slots.size and (pids == pid).all() else slots[pids == pid]
            requeue = []
            self._retirement.partition_rows_lost(part, mine)
            for task in part.tasks.values():
                state = task.state[mine]
                task.lost += int((state != DONE).sum())
                self._retirement.rows_lost(task, mine)  # (before the leases drop them)
                self._leases.drop_rows(task.lease[mine[state == LEASED]])
                task.leased -= int((state == LEASED).sum())
                if (state == QUEUED).any():
                    requeue.append(task)
                changes.woken.add(task.key)
            freed = Changes()  # (nothing to free on a dead unit: its memory died with it)
            self._partitions.free(part, mine, freed)
            changes.space |= freed.space
            n = int(mine.size)
            part.rows_freed -= n
            part.rows_lost += n
            self.rows_lost += n
            self._partitions.requeue(part, requeue)  # (without the lost rows)
        return changes

    @journaled
    def unit_back(self, unit: int) -> None:
        """Storage unit ``unit`` serves again (restarted, empty): new rows may go to it."""
        self.check_unit(unit)
        self._placement.set_alive(unit, True)

    @journaled
    def set_unit_host(self, unit: int, host: str) -> None:
        """The host of unit ``unit`` (replicas go to another host's unit)."""
        self.check_unit(unit)
        self._placement.set_host(unit, host)

    def check_unit(self, unit: int) -> None:
        num_units = self._placement.num_units
        if not isinstance(unit, int) or not 0 <= unit < num_units:
            raise ValueError(f"unit must be in 0..{num_units - 1}, got {unit!r}")

    # -- allocations of producers that died --------------------------------------------------
    def _marked(self) -> tuple[object, ...]:
        """What :meth:`reclaim` changes when it discards nothing (its journal fingerprint)."""
        marks = self._marks
        return (len(marks), marks[0] if marks else None, marks[-1] if marks else None,
                self._reclaimed_below)  # fmt: skip

    @journaled_unless_same(_marked)
    def reclaim(self) -> Changes:
        """Discard the rows of allocations older than ``allocation_s`` that no commit has
        touched (their producer died mid-put); they are freed on their units. Called by the
        service's timer; allocations are contiguous in index, so a mark per call of the
        next index suffices to know which are old."""
        now = self._clock()
        marks = self._marks
        next_index = self._rows.next_index
        if not marks or marks[-1][1] != next_index:
            marks.append((now, next_index))
        below = None
        while marks and marks[0][0] <= now - self.allocation_s:
            below = marks.popleft()[1]
        if below is None or below <= self._reclaimed_below:
            return Changes()
        low, self._reclaimed_below = self._reclaimed_below, below
        h = self._rows.header
        idx = h["index"]
        stale = np.flatnonzero(h["live"] & ~h["committed"] & (idx < below) & (idx >= low))
        return self._reclaim_slots(stale)

    @journaled
    def reclaim_uncommitted(self) -> Changes:
        """Discard every row allocated and not committed (a restarted controller: the puts
        that allocated them failed with the old one); freed on their units, remembered as
        reclaimed (a late commit learns they were lost)."""
        h = self._rows.header
        return self._reclaim_slots(np.flatnonzero(h["live"] & ~h["committed"]))

    def _reclaim_slots(self, stale: np.ndarray) -> Changes:
        """Discard the uncommitted rows in slots ``stale``, freed on their units and
        remembered as reclaimed (a late commit learns they were lost)."""
        if stale.size == 0:
            return Changes()
        indexes = self._rows.header["index"][stale].copy()
        changes = self._writes.discard(indexes)
        self._rows.gone.remember(indexes)
        self.rows_reclaimed += int(indexes.size)
        return changes

    @journaled
    def clamp_deadlines(self) -> None:
        """Deadlines further away than their maximum (a clock that restarted: a controller
        recovered on another host) come closer: leases' and allocations'."""
        now = self._clock()
        self._leases.clamp()
        self._marks = deque((min(t, now), i) for t, i in self._marks)
