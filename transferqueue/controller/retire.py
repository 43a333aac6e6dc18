"""Lost rows a task never consumed, and retiring whole groups: what lets a producer
regenerate what a dead storage unit took with it.

A part of the controller core (:class:`~transferqueue.controller.core.Controller`), told by
:mod:`transferqueue.controller.health` of the rows of a dead unit, and by the lease table of
each lease that ends:

- **the loss log of a task** (:meth:`Retirement.lost_rows`): every committed row lost
  *before the task consumed it*, with its group id, in the order the losses became definite.
  A row that was waiting or queued for the task is logged when it is lost. A row that the
  task held leased is logged only if the lease ends without an ack (released, expired,
  reset): a consumer that acknowledges a batch says it consumed it, lost rows included (it
  read them before the unit died; ``ack`` skips the rows that are gone). So a group in a
  task's log is
  a group the task did not get whole, and one it did get whole never is: an RL driver that
  regenerates the groups in the train task's log trains each group exactly once. The log is
  read with a cursor; the most recent ``LOSS_LOG_ROWS`` rows per task are kept (a reader that
  fell further behind learns how many it missed).
- **losses before a task's first poll**: a task exists from its first poll on, but the rows
  its partition lost or retired before then were pending for it as for any other (a late
  consumer must find them, see ``declare_tasks``): a new task starts with the partition's
  counts of lost and retired rows and with its loss log (every committed row it lost so far),
  so its end of stream comes once what survives is consumed (:meth:`Retirement.catch_up`).
  ``lost_rows`` of a task that has not polled yet reads that partition log: the same rows at
  the same cursors as the task's own log will hold.
- **retiring groups** (:meth:`Retirement.retire_groups`): every live row of the named groups
  leaves every task's queue and lease and is freed on its unit, as if lost, but deliberately
  (counted as ``retired``, never logged as lost). A group a task holds leased right now is
  left alone and reported busy (ask again once the lease ends). A producer that is about to
  put a group again retires the survivors of the old one first, so no task ever sees a group
  made of two generations, and late writes to retired rows fail with ``RowsLostError``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.leases import Lease, LeaseTable
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes, PartitionState, TaskState
from transferqueue.errors import BadRequestError
from transferqueue.wire.replies import DONE, LEASED, QUEUED, LostRows, Retired

__all__ = ["LOSS_LOG_ROWS", "Retirement"]

LOSS_LOG_ROWS = 1 << 20
"""Rows each task's loss log keeps (the oldest are dropped first; a reader is told)."""


class LossLog:
    """One task's log: pages of (indexes, groups) with a running row count."""

    def __init__(self) -> None:
        self._pages: deque[tuple[int, np.ndarray, np.ndarray]] = deque()  # (first, idx, grp)
        self.total = 0  # rows ever logged (the cursor of the next one)
        self._kept = 0

    def append(self, indexes: np.ndarray, groups: np.ndarray) -> None:
        if indexes.size == 0:
            return
        self._pages.append((self.total, indexes.copy(), groups.copy()))
        self.total += int(indexes.size)
        self._kept += int(indexes.size)
        while self._kept > LOSS_LOG_ROWS and len(self._pages) > 1:
            self._kept -= int(self._pages.popleft()[1].size)

    def copy(self) -> LossLog:
        """A log holding the same rows at the same cursors (the pages are never changed)."""
        out = LossLog()
        out._pages = deque(self._pages)
        out.total, out._kept = self.total, self._kept
        return out

    def read(self, after: int, limit: int) -> LostRows:
        first_kept = self._pages[0][0] if self._pages else self.total
        missed = max(0, first_kept - after)
        start = max(after, first_kept)
        idx: list[np.ndarray] = []
        grp: list[np.ndarray] = []
        got = 0
        for first, i, g in self._pages:
            end = first + int(i.size)
            if end <= start or got >= limit:
                continue
            lo = max(0, start - first)
            hi = min(int(i.size), lo + limit - got)
            idx.append(i[lo:hi])
            grp.append(g[lo:hi])
            got += hi - lo
        cat = np.concatenate if idx else (lambda _: np.empty(0, dtype=np.int64))
        return LostRows(cat(idx), cat(grp), start + got, missed)


class Retirement:
    """Loss logs per task and per partition, and group retirement (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, partitions: Partitions, leases: LeaseTable) -> None:
        self._rows = rows
        self._partitions = partitions
        self._leases = leases
        self._logs: dict[tuple[int, str], LossLog] = {}
        self._partition_logs: dict[int, LossLog] = {}  # committed rows lost, per partition
        self.rows_retired = 0
        leases.on_close = self._lease_closed
        partitions.on_new_task.append(self.catch_up)
        partitions.on_clear.append(self._forget)

    def _log(self, task: TaskState) -> LossLog:
        log = self._logs.get(task.key)
        if log is None:
            log = self._logs[task.key] = LossLog()
        return log

    # -- rows lost with a unit (told by UnitHealth) ------------------------------------------
    def partition_rows_lost(self, part: PartitionState, slots: np.ndarray) -> None:
        """``slots`` of ``part`` are lost now: the committed ones join the partition's log
        (what a task that has not polled yet lost, see the module)."""
        h = self._rows.header
        slots = slots[h["committed"][slots]]
        log = self._partition_logs.get(part.id)
        if log is None:
            log = self._partition_logs[part.id] = LossLog()
        log.append(h["index"][slots], h["group"][slots])

    def catch_up(self, part: PartitionState, task: TaskState) -> None:
        """``task`` is new to ``part`` (its first poll): every row the partition lost or
        retired so far was pending for it (see the module). Told by ``Partitions``."""
        task.lost = part.rows_lost
        task.retired = part.rows_retired
        log = self._partition_logs.get(part.id)
        if log is not None:
            self._logs[task.key] = log.copy()

    def _forget(self, part: PartitionState) -> None:
        """``part`` was cleared: a task new to it from now on has lost nothing (the logs of
        its tasks keep their rows: readers hold cursors into them)."""
        self._partition_logs.pop(part.id, None)

    def rows_lost(self, task: TaskState, slots: np.ndarray) -> None:
        """``slots`` (of ``task``'s partition) are lost now: log those the task had not
        consumed and did not hold; leave those it held with their lease until it ends. Rows
        no commit reached are not logged: their put fails and its producer puts them again."""
        h = self._rows.header
        slots = slots[h["committed"][slots]]
        state = task.state[slots]
        unheld = slots[state < LEASED]  # waiting or queued
        self._log(task).append(h["index"][unheld], h["group"][unheld])
        held = slots[state == LEASED]
        if held.size == 0:
            return
        lease_ids = task.lease[held]
        for lid in np.unique(lease_ids).tolist():
            lease = self._leases.active(lid)
            if lease is not None:
                mine = held[lease_ids == lid]
                lease.lost.append((h["index"][mine].copy(), h["group"][mine].copy()))

    def _lease_closed(self, lease: Lease, why: str) -> None:
        """A lease ended: its lost rows were consumed if it was acknowledged, else logged."""
        if not lease.lost:
            return
        pending, lease.lost = lease.lost, []
        if why == "acked":
            return
        part = self._partitions.by_id(lease.task[0])
        task = None if part is None else part.tasks.get(lease.task[1])
        if task is not None and why != "cleared":
            log = self._log(task)
            for indexes, groups in pending:
                log.append(indexes, groups)

    # -- queries -------------------------------------------------------------------------------
    def lost_rows(
        self, partition: str, task: str, after: int = 0, limit: int = 1 << 16
    ) -> LostRows:
        """Rows of ``partition`` lost before ``task`` consumed them, logged after cursor
        ``after`` (at most ``limit``); pass the reply's ``next`` as ``after`` next time."""
        part = self._partitions.partition(partition)
        t = part.tasks.get(task)
        if not isinstance(after, int) or after < 0:
            raise BadRequestError(f"lost_rows: after must be a cursor >= 0, got {after!r}")
        if t is not None:
            log = self._log(t)
        elif part.declared is None or task in part.declared:  # (a task yet to poll)
            log = self._partition_logs.get(part.id) or LossLog()
        else:
            return LostRows(np.empty(0, np.int64), np.empty(0, np.int64), after)
        if after > log.total:
            raise BadRequestError(
                f"lost_rows: cursor {after} is past the end of task {task!r}'s loss log "
                f"({log.total} rows logged); pass the `next` a previous call returned"
            )
        return log.read(after, limit)

    @journaled
    def retire_groups(
        self, partition: str, groups: Sequence[int] | np.ndarray, unless_leased_by: str | None
    ) -> tuple[Retired, Changes]:
        """Retire every live row of ``groups`` in ``partition`` (see the module): returns the
        rows retired and the groups left alone because task ``unless_leased_by`` holds one
        of their rows leased, and what changed."""
        part = self._partitions.partition(partition)
        wanted = np.unique(np.asarray(groups, dtype=np.int64))
        changes = Changes()
        h = self._rows.header
        live = self._rows.live_slots(part.id)
        slots = live[np.isin(h["group"][live], wanted)]
        busy = np.empty(0, dtype=np.int64)
        if unless_leased_by is not None and unless_leased_by in part.tasks:
            holder = part.tasks[unless_leased_by]
            busy = np.unique(h["group"][slots[holder.state[slots] == LEASED]])
            slots = slots[~np.isin(h["group"][slots], busy)]
        if slots.size == 0:
            return Retired(0, busy), changes
        self._rows.gone.remember(h["index"][slots])
        requeue = []
        for task in part.tasks.values():
            state = task.state[slots]
            self._leases.drop_rows(task.lease[slots[state == LEASED]])
            task.leased -= int((state == LEASED).sum())
            task.retired += int((state != DONE).sum())
            if (state == QUEUED).any():
                requeue.append(task)
            changes.woken.add(task.key)
        self._partitions.free(part, slots, changes)
        n = int(slots.size)
        part.rows_freed -= n
        part.rows_retired += n
        self.rows_retired += n
        self._partitions.requeue(part, requeue)  # (without the retired rows)
        return Retired(n, busy), changes
