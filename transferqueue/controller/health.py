"""What the controller does when parts of the service fail, and the stats that report it.

A mixin of :class:`~transferqueue.controller.core.Controller` (kept apart so that the controller
module holds the row bookkeeping and this one the failure handling):

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

The indexes of lost and reclaimed rows are remembered (the most recent ``LOST_MEMORY``), so
that a late commit or read gets "lost", not "never existed".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from transferqueue.controller.keys import KeyMap
from transferqueue.controller.leases import LeaseTable
from transferqueue.controller.placement import Placement
from transferqueue.controller.rereplicate import Rereplication
from transferqueue.controller.state import Changes, PartitionState
from transferqueue.errors import RowsLostError, UnknownRowError
from transferqueue.schema import FieldSpec
from transferqueue.slots import ExtentAllocator, SlotMap
from transferqueue.wire.replies import DONE, LEASED, QUEUED

__all__ = ["ALLOCATION_S", "LOST_MEMORY", "UnitHealth"]

ALLOCATION_S = 120.0
"""Default deadline of an allocation: a put must commit its rows within it (a put of GBs
takes seconds), else they are reclaimed as the rows of a producer that died."""
LOST_MEMORY = 1 << 22
"""Lost or reclaimed row indexes remembered for error messages (the oldest are forgotten)."""


class UnitHealth(Rereplication):
    """Unit loss, allocation deadlines and stats; mixed into the Controller (with the
    re-replication of rows left with one copy, :mod:`transferqueue.controller.rereplicate`)."""

    # (the Controller's state this mixin works on)
    num_units: int
    capacity_rows: int | None
    clock: Callable[[], float]
    leases: LeaseTable
    placement: Placement
    allocation_s: float
    _h: dict[str, np.ndarray]
    _ready: dict[str, np.ndarray]
    _specs: dict[str, FieldSpec]
    _partitions: dict[str, PartitionState]
    _by_id: dict[int, PartitionState]
    _map: SlotMap
    _alloc: ExtentAllocator
    _next_index: int
    _rows_live: int
    _custom: dict[int, bytes]  # (custom metadata by row, see transferqueue.controller.status)
    _custom_bytes: int
    rows_retired: int  # (transferqueue.controller.retire's)
    _lost_for_task: Callable[[Any, np.ndarray], None]  # (transferqueue.controller.retire's)
    _keys: dict[int, KeyMap]  # (keys of rows by partition id, see transferqueue.controller.keys)

    def _init_health(self) -> None:
        self._gone: deque[np.ndarray] = deque()  # lost and reclaimed indexes, oldest first
        self._gone_rows = 0
        self._gone_sorted: np.ndarray | None = None  # all of them, sorted (built on demand)
        self._marks: deque[tuple[float, int]] = deque()  # (time, next index then)
        self._reclaimed_below = 0  # every older allocation was looked at
        self.rows_lost = 0
        self.rows_reclaimed = 0
        self.units_lost = 0
        self._init_copies()

    def _free(self, part: PartitionState, slots: np.ndarray, changes: Changes) -> None:
        raise NotImplementedError  # (the Controller's)

    # -- lost rows ---------------------------------------------------------------------------
    def _remember(self, indexes: np.ndarray) -> None:
        self._gone.append(indexes.copy())
        self._gone_rows += int(indexes.size)
        while self._gone_rows > LOST_MEMORY and len(self._gone) > 1:
            self._gone_rows -= int(self._gone.popleft().size)
        self._gone_sorted = None

    def lost(self, indexes: np.ndarray) -> np.ndarray:
        """Those of ``indexes`` that were lost (or reclaimed), as far as remembered."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if not self._gone or indexes.size == 0:
            return np.empty(0, dtype=np.int64)
        if self._gone_sorted is None:
            self._gone_sorted = np.sort(np.concatenate(self._gone))
        gone = self._gone_sorted
        pos = np.clip(np.searchsorted(gone, indexes), 0, gone.size - 1)
        return indexes[gone[pos] == indexes]

    def _without_lost(self, indexes: np.ndarray) -> np.ndarray:
        """``indexes`` less the lost ones (an ack of a batch that lost rows acks the rest)."""
        if not self._gone:
            return indexes
        lost = self.lost(indexes)
        return indexes if lost.size == 0 else indexes[~np.isin(indexes, lost)]

    def _missing(self, indexes: np.ndarray) -> Exception:
        """The error for rows the controller does not hold: lost, or never there."""
        lost = self.lost(indexes)
        if lost.size:
            return RowsLostError(
                f"rows {lost[:5].tolist()} were lost: the storage unit holding them died, "
                "their group was retired to be put again, or their put did not commit them "
                "before its allocation's deadline "
                f"(allocation_s={self.allocation_s:g}); put them again",
                lost,
            )
        return UnknownRowError(
            f"rows {indexes[:5].tolist()} are not in TransferQueue (never allocated, freed "
            "after every declared task acknowledged them, or cleared)"
        )

    def lose_unit(self, unit: int) -> Changes:
        """Storage unit ``unit`` died: its rows are lost (see the module); no row is placed
        on it until :meth:`unit_back`. Returns what changed (tasks to wake)."""
        self._check_unit(unit)
        if self.placement.alive[unit]:
            self.units_lost += 1
        self.unit_epochs[unit] += 1  # (a copy to it under way does not count)
        self.placement.set_alive(unit, False)
        return self._lose(unit, None)

    def lose_rows(self, unit: int, indexes: np.ndarray) -> Changes:
        """Rows ``indexes`` are gone from unit ``unit``, which lives on (a controller that
        restarted found them missing from the unit's inventory: the unit restarted while
        the controller was down). Their copies there are lost as with :meth:`lose_unit`."""
        self._check_unit(unit)
        self.unit_epochs[unit] += 1
        slots = self._map.lookup(np.asarray(indexes, dtype=np.int64))
        return self._lose(unit, slots[slots >= 0])

    def _lose(self, unit: int, among: np.ndarray | None) -> Changes:
        """Lose the copies on ``unit`` of the live rows (``among`` these slots; None: all)."""
        changes = Changes()
        h = self._h
        if self.placement.replicas > 1:
            self._drop_copies(unit, among)
        if among is None:
            slots = np.flatnonzero(h["live"] & (h["unit"] == unit))
        else:
            slots = among[h["live"][among] & (h["unit"][among] == unit)]
        if slots.size == 0:
            return changes
        self._remember(h["index"][slots])
        pids = h["partition"][slots]
        for pid in np.unique(pids).tolist():
            part = self._by_id[pid]
            mine = slots if pids.size == slots.size and (pids == pid).all() else slots[pids == pid]
            requeue = []
            for task in part.tasks.values():
                state = task.state[mine]
                task.lost += int((state != DONE).sum())
                self._lost_for_task(task, mine)  # (before the leases drop them)
                self._drop_leased(task.lease[mine[state == LEASED]])
                task.leased -= int((state == LEASED).sum())
                if (state == QUEUED).any():
                    requeue.append(task)
                changes.woken.add(task.key)
            freed = Changes()  # (nothing to free on a dead unit: its memory died with it)
            self._free(part, mine, freed)
            changes.space |= freed.space
            n = int(mine.size)
            part.rows_freed -= n
            part.rows_lost += n
            self.rows_lost += n
            self._requeue(part, requeue)  # (without the lost rows)
        return changes

    def _requeue(self, part: PartitionState, tasks: list[Any]) -> None:
        """Rebuild the queues of ``tasks`` from their live queued rows (rows just left)."""
        h = self._h
        for task in tasks:
            task.sampler.clear()
            live = self._live_slots(part)
            queued = live[task.state[live] == QUEUED]
            if queued.size:
                task.sampler.add(h["index"][queued])

    # -- second copies (replicas=2) ----------------------------------------------------------
    def _copies(self, slots: np.ndarray) -> np.ndarray | None:
        """The units of the rows' second copies (for a BatchMeta); None with replicas=1."""
        return None if self.placement.replicas == 1 else self._h["replica"][slots]

    def _free_copies(self, slots: np.ndarray, indexes: np.ndarray, changes: Changes) -> None:
        """Rows are freed: their second copies are freed too (from ``Controller._free``)."""
        if self.placement.replicas == 1:
            return
        copies = self._h["replica"][slots]
        has = copies >= 0
        if has.any():
            changes.freed.append(indexes[has])
            changes.freed_units.append(copies[has].copy())
            self.placement.add_bytes(copies[has], -self._h["nbytes"][slots[has]])

    def _drop_copies(self, unit: int, slots: np.ndarray | None = None) -> np.ndarray:
        """The rows (of ``slots``; default: every live row) with a copy on ``unit`` and
        another elsewhere keep the other one only (a row whose first copy is dropped is now
        on its second's unit). Returns the slots whose copy was dropped."""
        h = self._h
        if slots is None:
            slots = np.flatnonzero(h["live"])
        second = slots[h["replica"][slots] == unit]
        first = slots[(h["unit"][slots] == unit) & (h["replica"][slots] >= 0)]
        gone = np.concatenate([second, first])
        self.placement.add_bytes(np.full(gone.size, unit, dtype=np.int32), -h["nbytes"][gone])
        h["unit"][first] = h["replica"][first]
        h["replica"][gone] = -1
        return gone

    def drop_copies(self, indexes: np.ndarray, units: list[int]) -> Changes:
        """A writer could not write the copies of rows ``indexes`` on ``units`` (it found
        them gone; ``Commit.dropped``): those copies are forgotten where the row keeps
        another (a row whose only copy is there keeps it: it is lost with the unit, if the
        unit died), and freed on the unit in case the write landed after all."""
        changes = Changes()
        if self.placement.replicas == 1:
            return changes
        slots = self._map.lookup(np.asarray(indexes, dtype=np.int64))
        slots = slots[slots >= 0]
        for unit in sorted(set(units)):
            if 0 <= unit < self.num_units:
                gone = self._drop_copies(unit, slots)
                if gone.size:
                    changes.freed.append(self._h["index"][gone].copy())
                    changes.freed_units.append(np.full(gone.size, unit, dtype=np.int32))
        return changes

    def _drop_leased(self, lease_ids: np.ndarray) -> None:
        """Lost rows leave the leases holding them; a lease left empty closes, unless it
        must learn whether its holder consumed them (see transferqueue.controller.retire): then it
        stays open until acknowledged, released or expired."""
        if lease_ids.size == 0:
            return
        ids, counts = np.unique(lease_ids, return_counts=True)
        for lid, count in zip(ids.tolist(), counts.tolist(), strict=True):
            lease = self.leases.active(lid)
            if lease is not None:
                lease.remaining -= count
                if lease.remaining <= 0 and not lease.lost:
                    self.leases.close(lease, "lost")

    def unit_back(self, unit: int) -> None:
        """Storage unit ``unit`` serves again (restarted, empty): new rows may go to it."""
        self._check_unit(unit)
        self.placement.set_alive(unit, True)

    def _check_unit(self, unit: int) -> None:
        if not isinstance(unit, int) or not 0 <= unit < self.num_units:
            raise ValueError(f"unit must be in 0..{self.num_units - 1}, got {unit!r}")

    def _live_slots(self, part: PartitionState) -> np.ndarray:
        raise NotImplementedError  # (the Controller's)

    def discard(self, indexes: np.ndarray) -> Changes:
        raise NotImplementedError  # (the Controller's)

    # -- allocations of producers that died --------------------------------------------------
    def reclaim(self) -> Changes:
        """Discard the rows of allocations older than ``allocation_s`` that no commit has
        touched (their producer died mid-put); they are freed on their units. Called by the
        service's timer; allocations are contiguous in index, so a mark per call of the
        next index suffices to know which are old."""
        now = self.clock()
        marks = self._marks
        if not marks or marks[-1][1] != self._next_index:
            marks.append((now, self._next_index))
        below = None
        while marks and marks[0][0] <= now - self.allocation_s:
            below = marks.popleft()[1]
        if below is None or below <= self._reclaimed_below:
            return Changes()
        low, self._reclaimed_below = self._reclaimed_below, below
        h = self._h
        idx = h["index"]
        stale = np.flatnonzero(h["live"] & ~h["committed"] & (idx < below) & (idx >= low))
        return self._reclaim_slots(stale)

    def _reclaim_slots(self, stale: np.ndarray) -> Changes:
        """Discard the uncommitted rows in slots ``stale``, freed on their units and
        remembered as reclaimed (a late commit learns they were lost)."""
        if stale.size == 0:
            return Changes()
        indexes = self._h["index"][stale].copy()
        changes = self.discard(indexes)
        self._remember(indexes)
        self.rows_reclaimed += int(indexes.size)
        return changes

    # -- introspection -----------------------------------------------------------------------
    def _one_copy(self) -> int:
        """Live rows with a single copy although the service keeps two (0 with replicas=1)."""
        if self.placement.replicas == 1:
            return 0
        h = self._h
        return int((h["live"] & (h["replica"] < 0)).sum())

    def stats(self) -> dict[str, Any]:
        parts = {}
        for part in self._partitions.values():
            tasks = {}
            for name, t in part.tasks.items():
                queued = t.sampler.available()
                tasks[name] = {
                    "fields": list(t.fields),
                    "sampler": t.sampler_name,
                    "queued": queued,
                    "leased": t.leased,
                    "done": t.done,
                    "dropped": t.dropped,
                    "lost": t.lost,
                    "retired": t.retired,
                    "waiting": part.rows_put - t.done - t.leased - queued - t.lost - t.retired,
                }
            parts[part.name] = {
                "rows_put": part.rows_put,
                "rows_live": part.rows_live,
                "rows_freed": part.rows_freed,
                "rows_lost": part.rows_lost,
                "rows_retired": part.rows_retired,
                "keys": len(self._keys.get(part.id) or ()),
                "finished": part.finished,
                "declared_tasks": part.declared,
                "tasks": tasks,
            }
        return {
            "rows_live": self._rows_live,
            "capacity_rows": self.capacity_rows,
            "next_index": self._next_index,
            "active_leases": len(self.leases),
            "expired_leases": self.leases.expired,
            "unit_bytes": self.placement.unit_bytes.tolist(),
            "units_alive": self.placement.alive.tolist(),
            "units_lost": self.units_lost,
            "rows_lost": self.rows_lost,
            "rows_reclaimed": self.rows_reclaimed,
            "rows_retired": self.rows_retired,
            "replicas": self.placement.replicas,
            "rows_one_copy": self._one_copy(),
            "rows_recopied": self.rows_recopied,
            "copies_refused": self.copies_refused,
            "custom_meta_rows": len(self._custom),
            "custom_meta_bytes": self._custom_bytes,
            "allocation_s": self.allocation_s,
            "fields": {n: s.describe() for n, s in self._specs.items()},
            "partitions": parts,
        }
