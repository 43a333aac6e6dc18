"""``Partitions``: the partitions of the controller, their consumer tasks, and rows leaving.

Each partition (:class:`~transferqueue.controller.state.PartitionState`) has a small integer id
(the ``partition`` header column of its rows), its declared tasks, its tasks by name and row
counters. Each task (:class:`~transferqueue.controller.state.TaskState`) keeps a state per slot
(waiting / queued / leased / done), the lease of each leased row, and its sampler, the queue
of its rows that are ready (every field it consumes is written)::

    Partitions   by name {name: PartitionState} | by id {id: PartitionState}
    TaskState    state uint8[capacity] | lease int64[capacity] | sampler | counters

What every operation on rows shares lives here: putting the ready rows of a task into its
queue (:meth:`Partitions.enqueue_ready`), rebuilding queues once rows left
(:meth:`Partitions.requeue`), a task being done with rows (:meth:`Partitions.mark_done`: rows
every declared task is done with are freed) and rows leaving (:meth:`Partitions.free`: their
slots, their bytes on the units, their tasks' states; the parts that keep something per row,
custom metadata and keys, drop it through ``on_free``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from transferqueue.controller.journal import Recorder, journaled_unless_same
from transferqueue.controller.leases import Lease
from transferqueue.controller.placement import Placement
from transferqueue.controller.rows import RowTable
from transferqueue.controller.samplers import get_sampler
from transferqueue.controller.state import Changes, PartitionState, TaskState
from transferqueue.errors import BadRequestError, CapacityError, UnknownTaskError
from transferqueue.limits import MAX_TASKS
from transferqueue.wire.replies import DONE, QUEUED, WAITING

__all__ = ["OnClear", "OnFree", "OnNewTask", "Partitions"]

OnFree = Callable[[int, np.ndarray], None]
"""Told the partition id and indexes of rows that leave (what it keeps per row goes)."""
OnNewTask = Callable[[PartitionState, TaskState], None]
"""Told of a task new to a partition (its first poll), before its ready rows are queued."""
OnClear = Callable[[PartitionState], None]
"""Told of a partition cleared (what it keeps per partition goes)."""


class Partitions:
    """Partitions by name and id, their tasks, and what rows do in them (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, placement: Placement) -> None:
        self._rows = rows
        self._placement = placement
        self._by_name: dict[str, PartitionState] = {}
        self._by_id: dict[int, PartitionState] = {}
        self.on_free: list[OnFree] = []
        self.on_new_task: list[OnNewTask] = []
        self.on_clear: list[OnClear] = []
        rows.has_rows = self.has_rows

    def __iter__(self) -> Iterator[PartitionState]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)

    # -- partitions --------------------------------------------------------------------------
    def _count(self) -> int:
        return len(self._by_name)

    @journaled_unless_same(_count)
    def partition(self, name: str) -> PartitionState:
        """The partition ``name``, made if new."""
        part = self._by_name.get(name)
        if part is None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"partition must be a non-empty string, got {name!r}")
            if len(self._by_name) >= np.iinfo(np.int16).max:
                raise ValueError("too many partitions; clear unused ones")
            part = PartitionState(len(self._by_id), name)
            self._by_name[name] = part
            self._by_id[part.id] = part
        return part

    def has_rows(self, name: str) -> bool:
        """Whether partition ``name`` holds rows (allocated ones too)."""
        part = self._by_name.get(name)
        return part is not None and part.rows_live > 0

    def get(self, name: str) -> PartitionState | None:
        return self._by_name.get(name)

    def by_id(self, partition_id: int) -> PartitionState | None:
        return self._by_id.get(partition_id)

    def known(self, name: str) -> PartitionState:
        """The partition ``name``; an error naming the known ones if there is none."""
        part = self._by_name.get(name)
        if part is None:
            raise BadRequestError(
                f"partition {name!r} is unknown (known: {sorted(self._by_name)[:20]}); "
                "put rows into it or declare its tasks first"
            )
        return part

    # -- tasks -------------------------------------------------------------------------------
    def tasks(self) -> list[TaskState]:
        """Every task of every partition."""
        return [t for p in self._by_name.values() for t in p.tasks.values()]

    def task(
        self,
        part: PartitionState,
        name: str,
        fields: Sequence[str] | None,
        sampler: str,
        options: Mapping[str, Any],
    ) -> TaskState:
        """Task ``name`` of ``part``, made (its ready rows queued) if new; a task keeps its
        fields and its sampler."""
        if part.declared is not None and name not in part.declared:
            raise UnknownTaskError(
                f"task {name!r} is not declared for partition {part.name!r} (declared: "
                f"{part.declared}); add it to declare_tasks so its rows are not freed under it"
            )
        task = part.tasks.get(name)
        if task is None and sum(len(p.tasks) for p in self._by_name.values()) >= MAX_TASKS:
            raise CapacityError(f"this controller keeps at most {MAX_TASKS} tasks")
        if task is not None:
            if fields is not None and tuple(fields) != task.fields:
                raise ValueError(
                    f"task {name!r} consumes fields {list(task.fields)}, asked for "
                    f"{list(fields)}; one task has one field list (use another task name)"
                )
            if sampler != task.sampler_name or dict(options) != task.options:
                raise ValueError(
                    f"task {name!r} uses sampler {task.sampler_name!r} {task.options}, asked "
                    f"for {sampler!r} {dict(options)}; a task keeps its sampler"
                )
            return task
        if not fields:
            raise ValueError(f"task {name!r} is new: give the fields it consumes")
        task = self.add_task(part, name, fields, sampler, options)
        for hook in self.on_new_task:
            hook(part, task)
        self.enqueue_ready(task, self._rows.live_slots(part.id))
        return task

    def add_task(
        self,
        part: PartitionState,
        name: str,
        fields: Sequence[str],
        sampler: str,
        options: Mapping[str, Any],
    ) -> TaskState:
        """A new task of ``part`` with every row waiting (nothing queued yet)."""
        for f in fields:
            self._rows.ready_of(f)
        inst = get_sampler(sampler)(self._rows, **options)
        task = TaskState(
            (part.id, name), tuple(fields), inst, sampler, dict(options), self._rows.capacity
        )
        part.tasks[name] = task
        return task

    def known_task(self, part: PartitionState, name: str) -> TaskState | None:
        """The task's state; None for a declared task that has not asked for rows yet."""
        task = part.tasks.get(name)
        if task is None and (part.declared is None or name not in part.declared):
            known = sorted(set(part.tasks) | set(part.declared or ()))
            raise UnknownTaskError(
                f"task {name!r} has neither asked for rows of partition {part.name!r} nor "
                f"been declared for it (known tasks: {known}); check the name"
            )
        return task

    def task_of(self, lease: Lease) -> tuple[PartitionState, TaskState]:
        """The partition and task a lease is of."""
        part = self._by_id[lease.task[0]]
        return part, part.tasks[lease.task[1]]

    def cleared(self, part: PartitionState) -> None:
        """Every row of ``part`` left (``clear``): its tasks stay with empty queues and zero
        counters, it is open again, and the parts keeping something per partition drop it
        (``on_clear``)."""
        for task in part.tasks.values():
            task.sampler.clear()
            task.leased = task.done = task.dropped = task.lost = task.retired = 0
        part.rows_put = part.rows_freed = part.rows_lost = part.rows_retired = 0
        part.finished = False
        self._rows.forget_specs(part.name)
        for hook in self.on_clear:
            hook(part)

    # -- queues ------------------------------------------------------------------------------
    def enqueue_ready(self, task: TaskState, slots: np.ndarray) -> bool:
        """Queue those of ``slots`` waiting for ``task`` whose fields are all written;
        whether any was."""
        cand = slots[task.state[slots] == WAITING]
        if cand.size == 0:
            return False
        ok = np.ones(cand.size, dtype=bool)
        for name in task.fields:
            ok &= self._rows.ready_of(name)[cand]
        cand = cand[ok]
        if cand.size == 0:
            return False
        task.state[cand] = QUEUED
        task.sampler.add(self._rows.header["index"][cand])
        return True

    def requeue(self, part: PartitionState, tasks: list[TaskState]) -> None:
        """Rebuild the queues of ``tasks`` from their live queued rows (rows just left)."""
        index = self._rows.header["index"]
        for task in tasks:
            task.sampler.clear()
            live = self._rows.live_slots(part.id)
            queued = live[task.state[live] == QUEUED]
            if queued.size:
                task.sampler.add(index[queued])

    # -- done, freed -------------------------------------------------------------------------
    def mark_done(
        self, part: PartitionState, task: TaskState, slots: np.ndarray, *, dropped: bool
    ) -> Changes:
        """``task`` is done with rows ``slots`` (consumed, or ``dropped`` below a version);
        rows every declared task is done with are freed."""
        task.state[slots] = DONE
        task.done += int(slots.size)
        if dropped:
            task.dropped += int(slots.size)
        changes = Changes()
        if part.finished:  # other tasks' waits may now end (see Queues.poll)
            changes.woken |= {t.key for t in part.tasks.values()}
        if part.declared is not None and task.key[1] in part.declared:
            done = self._rows.header["done"]
            done[slots] += 1
            full = slots[done[slots] >= len(part.declared)]
            if full.size:
                self.free(part, full, changes)
        return changes

    def free(self, part: PartitionState, slots: np.ndarray, changes: Changes) -> None:
        """Rows ``slots`` of ``part`` leave: ``changes`` gets them (and their second copies)
        to free on their units; every task forgets them; counted as freed."""
        h = self._rows.header
        indexes = h["index"][slots].copy()
        changes.freed.append(indexes)
        changes.freed_units.append(h["unit"][slots].copy())
        changes.space = True
        nbytes = h["nbytes"][slots]
        self._placement.add_bytes(h["unit"][slots], -nbytes)
        if self._rows.replicas > 1:
            copies = h["replica"][slots]
            has = copies >= 0
            if has.any():
                changes.freed.append(indexes[has])
                changes.freed_units.append(copies[has].copy())
                self._placement.add_bytes(copies[has], -nbytes[has])
        for task in part.tasks.values():
            task.state[slots] = WAITING
            task.lease[slots] = -1
        self._rows.remove(slots)
        for drop in self.on_free:
            drop(part.id, indexes)
        n = int(slots.size)
        part.rows_live -= n
        part.rows_freed += n
