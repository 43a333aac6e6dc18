"""``Controller``: the metadata of TransferQueue (never payload).

It allocates row indexes and places rows on storage units; records which fields of which
rows are ready; keeps, per consumer task, which rows are queued, leased and done; hands out
batches through the task's sampler; frees rows once every task declared for their partition
has acknowledged them. State is columnar, indexed by slot (see :mod:`transferqueue.slots`)::

    header   index int64 | partition int16 | unit int32 | group int64 | version int64 |
             length int64 | done int16 (declared tasks done) | live bool
    ready    {field: bool[cap]}
    per task state uint8[cap] (0 waiting, 1 queued, 2 leased, 3 done) | lease int64[cap]

When a field lands, only the tasks that consume it look at only the rows written, so per-task
ready queues are maintained incrementally and a batch costs O(batch) to hand out.

This is a plain synchronous class: no I/O, no waiting. :class:`ControllerService` adds
blocking ``get_meta``, lease timers and freeing of payload on storage units.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from transferqueue.controller.health import ALLOCATION_S, UnitHealth
from transferqueue.controller.keys import KeyedRows
from transferqueue.controller.lease_calls import LeaseCalls
from transferqueue.controller.leases import LeaseTable
from transferqueue.controller.placement import SPREAD_BYTES, Placement
from transferqueue.controller.retire import Retirement
from transferqueue.controller.samplers import get_sampler
from transferqueue.controller.state import HEADER, Changes, PartitionState, TaskState, header_column
from transferqueue.controller.status import RowStatus
from transferqueue.errors import (
    BadRequestError,
    CapacityError,
    FinishedError,
    SchemaError,
    UnknownFieldError,
    UnknownTaskError,
)
from transferqueue.limits import MAX_FIELDS, MAX_LEASE_S, MAX_ROWS, MAX_TASKS
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.slots import ExtentAllocator, SlotMap
from transferqueue.wire.replies import DONE, LEASED, QUEUED, WAITING

__all__ = ["SPREAD_BYTES", "Changes", "Controller"]


class Controller(UnitHealth, Retirement, RowStatus, KeyedRows, LeaseCalls):
    """Row metadata, readiness, per-task queues and leases. Not thread-safe by design.
    What happens when a unit or a producer dies, and ``stats``:
    :mod:`transferqueue.controller.health`; loss logs per task and retiring groups to put them
    again: :mod:`transferqueue.controller.retire`; status queries, consumption resets and custom
    metadata: :mod:`transferqueue.controller.status`; string keys of rows (the key-value calls):
    :mod:`transferqueue.controller.keys`.
    """

    def __init__(
        self,
        num_units: int = 1,
        *,
        capacity_rows: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        spread_bytes: int = SPREAD_BYTES,
        max_lease_s: float = MAX_LEASE_S,
        allocation_s: float = ALLOCATION_S,
        replicas: int = 1,
    ) -> None:
        """``replicas=2``: each row is written to two units (see
        :mod:`transferqueue.controller.health`)."""
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        if spread_bytes < 0:
            raise ValueError(f"spread_bytes must be >= 0 (0: always spread), got {spread_bytes}")
        self.num_units = num_units
        self.spread_bytes = spread_bytes
        self.capacity_rows = capacity_rows
        self.clock = clock
        self.leases = LeaseTable(clock, max_lease_s)
        self._map = SlotMap()
        self._alloc = ExtentAllocator(0)
        self._h: dict[str, np.ndarray] = {
            k: np.full(0, fill, dtype=dt) for k, (dt, fill) in HEADER.items()
        }
        self._ready: dict[str, np.ndarray] = {}
        self._specs: dict[str, FieldSpec] = {}
        self._partitions: dict[str, PartitionState] = {}
        self._by_id: dict[int, PartitionState] = {}
        self._next_index = 0
        self.placement = Placement(num_units, spread_bytes, replicas)
        self._rows_live = 0
        if not isinstance(allocation_s, int | float) or not 0 < allocation_s < float("inf"):
            raise ValueError(
                f"allocation_s must be a positive number of seconds, got {allocation_s!r}"
            )
        self.allocation_s = float(allocation_s)
        self._init_health()
        self._init_retirement()
        self._init_status()
        self._init_keys()

    # -- schema ------------------------------------------------------------------------------
    @property
    def specs(self) -> dict[str, FieldSpec]:
        return dict(self._specs)

    def register_fields(self, specs: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
        """Register new fields; a spec that disagrees with a registered one is an error."""
        if len(set(self._ready) | set(specs)) > MAX_FIELDS:
            raise CapacityError(f"this controller keeps at most {MAX_FIELDS} fields")
        for name, spec in specs.items():
            known = self._specs.get(name)
            if known is not None and known != spec:
                raise SchemaError(
                    f"field {name!r}: expected {known.describe()}, received {spec.describe()}; "
                    "convert the column or write it under a new field name"
                )
        for name, spec in specs.items():
            self._specs.setdefault(name, spec)
            self._ready_of(name)
        return {n: self._specs[n] for n in specs}

    def _ready_of(self, name: str) -> np.ndarray:
        arr = self._ready.get(name)
        if arr is None:
            if len(self._ready) >= MAX_FIELDS:  # (a bitmap per field name: bounded)
                raise CapacityError(f"this controller keeps at most {MAX_FIELDS} fields")
            arr = self._ready[name] = np.zeros(self._alloc.capacity, dtype=bool)
        return arr

    # -- header view for samplers ------------------------------------------------------------
    def _slots(self, indexes: np.ndarray) -> np.ndarray:
        slots = self._map.lookup(indexes)
        if (slots < 0).any():
            raise self._missing(indexes[slots < 0])  # (lost with a unit, or never there)
        return slots

    def groups(self, indexes: np.ndarray) -> np.ndarray:
        return self._h["group"][self._slots(indexes)]

    def versions(self, indexes: np.ndarray) -> np.ndarray:
        return self._h["version"][self._slots(indexes)]

    def lengths(self, indexes: np.ndarray) -> np.ndarray:
        return self._h["length"][self._slots(indexes)]

    # -- rows --------------------------------------------------------------------------------
    def partition(self, name: str) -> PartitionState:
        part = self._partitions.get(name)
        if part is None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"partition must be a non-empty string, got {name!r}")
            if len(self._partitions) >= np.iinfo(np.int16).max:
                raise ValueError("too many partitions; clear unused ones")
            part = PartitionState(len(self._by_id), name)
            self._partitions[name] = part
            self._by_id[part.id] = part
        return part

    def can_allocate(self, n: int) -> bool:
        return self.capacity_rows is None or self._rows_live + n <= self.capacity_rows

    def allocate(
        self,
        n: int,
        partition: str,
        *,
        groups: np.ndarray | int | None = None,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        nbytes: int | None = None,
        producer: str | None = None,
    ) -> BatchMeta:
        """New rows in ``partition``: indexes, units (see :meth:`_place`) and headers.

        ``nbytes`` (the payload's size, if the writer knows it) decides over how many units
        the rows spread; ``producer`` (a name the writer keeps for all its puts) lets its
        small puts stay on one unit for a while. Everything is checked before any state
        changes, so a failed allocate leaves the controller as it was."""
        self.check_allocate(n, partition)
        if producer is not None and not isinstance(producer, str):
            raise TypeError(f"producer must be a string naming the writer, got {producer!r}")
        if not self.can_allocate(n):
            raise CapacityError(
                f"TransferQueue holds {self._rows_live} rows; {n} more exceed "
                f"capacity_rows={self.capacity_rows}. Consumers must acknowledge rows "
                "(declared tasks) or the partition must be cleared"
            )
        g_given = None if groups is None else header_column("group", groups, n, default=-1)
        v = header_column("version", versions, n, default=-1)
        ln = header_column("length", lengths, n, default=-1)
        part = self.partition(partition)
        if self._alloc.free_count < n:
            cap = self._alloc.capacity
            self._grow(cap + max(n - self._alloc.free_count, cap // 2, 1024))
        slots = self._alloc.allocate(n)
        assert slots is not None
        indexes = np.arange(self._next_index, self._next_index + n, dtype=np.int64)
        self._next_index += n
        g = indexes.copy() if g_given is None else g_given
        self._map.insert(indexes, slots)
        units = self.placement.place(n, nbytes, producer)
        copies = self.placement.replicas_of(units)  # (None with replicas=1)
        h = self._h
        h["index"][slots] = indexes
        h["partition"][slots] = part.id
        h["unit"][slots] = units
        h["group"][slots] = g
        h["version"][slots] = v
        h["length"][slots] = ln
        h["done"][slots] = 0
        h["live"][slots] = True
        if nbytes and n:
            share = np.full(n, nbytes // n, dtype=np.int64)
            share[: nbytes % n] += 1
            h["nbytes"][slots] = share
            self.placement.add_bytes(units, share)
            if copies is not None:
                self.placement.add_bytes(copies[copies >= 0], share[copies >= 0])
        if copies is not None:
            h["replica"][slots] = copies
        part.rows_put += n
        part.rows_live += n
        self._rows_live += n
        return BatchMeta(indexes, units, g, v, ln, partition=part.name, replica_units=copies)

    def check_allocate(self, n: int, partition: str) -> None:
        """Raise the errors no wait for capacity can cure: a bad row count, a put larger than
        capacity, a finished partition."""
        if not isinstance(n, int) or not 0 <= n <= MAX_ROWS:
            raise BadRequestError(f"a put allocates 0..{MAX_ROWS} rows, got n={n!r}; split it")
        if self.capacity_rows is not None and n > self.capacity_rows:
            raise CapacityError(
                f"a put of {n} rows exceeds capacity_rows={self.capacity_rows}; "
                "split the put or raise capacity_rows"
            )
        part = self._partitions.get(partition)
        if part is not None and part.finished:
            raise FinishedError(
                f"partition {partition!r} is finished: its consumers may have ended and would "
                "never see new rows; put into another partition, or clear this one first"
            )

    def _grow(self, capacity: int) -> None:
        """Every per-slot array grown to ``capacity``: all built first, then swapped in, so a
        MemoryError half way leaves every array (and the allocator) as it was."""
        extra = capacity - self._alloc.capacity
        header = {
            k: np.concatenate([self._h[k], np.full(extra, fill, dtype=dt)])
            for k, (dt, fill) in HEADER.items()
        }
        ready = {
            n: np.concatenate([a, np.zeros(extra, dtype=bool)]) for n, a in self._ready.items()
        }
        tasks = [t for p in self._partitions.values() for t in p.tasks.values()]
        grown = [t.grown(capacity) for t in tasks]
        self._h, self._ready = header, ready
        for task, arrays in zip(tasks, grown, strict=True):
            task.state, task.lease = arrays
        self._alloc.grow(capacity)

    def commit(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        *,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        lease_id: int | None = None,
        owner: str | None = None,
        copies: np.ndarray | None = None,
    ) -> Changes:
        """Fields of these rows are stored: update headers, mark ready, enqueue, ack a lease.
        ``copies``: the second unit of each row the writer wrote (see _landed, rereplicate).

        Validates everything (rows live, fields registered, the lease) before changing state.
        A commit sent again after its reply was lost (its lease acked by the first, its fields
        ready on every row still live) is a no-op.
        """
        indexes = np.asarray(indexes, dtype=np.int64)
        if lease_id is not None and self._committed_already(lease_id, indexes, fields):
            return Changes()
        slots = self._slots(indexes)
        for name in fields:
            if name not in self._specs:
                raise UnknownFieldError(
                    f"field {name!r} has no registered spec; register_fields before commit"
                )
        n = indexes.size
        v = None if versions is None else header_column("version", versions, n, default=-1)
        ln = None if lengths is None else header_column("length", lengths, n, default=-1)
        lease = self._held(lease_id, indexes, slots, owner) if lease_id is not None else None
        self._h["committed"][slots] = True
        if v is not None:
            self._h["version"][slots] = v
        if ln is not None:
            self._h["length"][slots] = ln
        changes = self._landed(slots, copies)
        for name in fields:
            self._ready_of(name)[slots] = True
        fset = set(fields)
        pids = self._h["partition"][slots]
        upids = np.unique(pids)
        for pid in upids.tolist():
            part = self._by_id[pid]
            in_part = slots if upids.size == 1 else slots[pids == pid]
            for task in part.tasks.values():
                if fset.intersection(task.fields) and self._enqueue_ready(task, in_part):
                    changes.woken.add(task.key)
        if lease is not None:
            changes.merge(self._finish_rows(lease, slots, acked=True))
        return changes

    def _committed_already(self, lease_id: int, indexes: np.ndarray, fields: Sequence[str]) -> bool:
        """Whether a commit acking ``lease_id`` landed before: the lease was acked and the
        rows still live have every field (freed rows were consumed by every task)."""
        if self.leases.closed_reason(lease_id) != "acked":
            return False
        slots = self._map.lookup(indexes)
        slots = slots[slots >= 0]
        return all(name in self._specs and self._ready_of(name)[slots].all() for name in fields)

    def _enqueue_ready(self, task: TaskState, slots: np.ndarray) -> bool:
        cand = slots[task.state[slots] == WAITING]
        if cand.size == 0:
            return False
        ok = np.ones(cand.size, dtype=bool)
        for name in task.fields:
            ok &= self._ready_of(name)[cand]
        cand = cand[ok]
        if cand.size == 0:
            return False
        task.state[cand] = QUEUED
        task.sampler.add(self._h["index"][cand])
        return True

    # -- tasks -------------------------------------------------------------------------------
    def declare_tasks(self, partition: str, tasks: Sequence[str]) -> None:
        """Name every consumer task of ``partition``: rows are freed once all acknowledged.

        Call it before consumers acknowledge anything; until a partition has declared tasks
        its rows are kept until ``clear`` (a task that starts late must find its rows).
        """
        part = self.partition(partition)
        names = list(dict.fromkeys(tasks))
        if not names or not all(isinstance(t, str) and t for t in names):
            raise ValueError(f"declare_tasks needs non-empty task names, got {tasks!r}")
        if part.declared is not None and set(names) == set(part.declared):
            return
        if part.rows_freed:
            raise ValueError(
                f"partition {partition!r} already freed {part.rows_freed} rows acknowledged by "
                f"tasks {part.declared}; declare every task before consumption starts, or "
                "clear the partition first"
            )
        part.declared = names
        live = self._live_slots(part)
        done = np.zeros(live.size, dtype=np.int64)
        for t in names:
            task = part.tasks.get(t)
            if task is not None:
                done += task.state[live] == DONE
        self._h["done"][live] = done

    def _task(
        self,
        part: PartitionState,
        name: str,
        fields: Sequence[str] | None,
        sampler: str,
        options: Mapping[str, Any],
    ) -> TaskState:
        if part.declared is not None and name not in part.declared:
            raise UnknownTaskError(
                f"task {name!r} is not declared for partition {part.name!r} (declared: "
                f"{part.declared}); add it to declare_tasks so its rows are not freed under it"
            )
        task = part.tasks.get(name)
        if task is None and sum(len(p.tasks) for p in self._partitions.values()) >= MAX_TASKS:
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
        for f in fields:
            self._ready_of(f)
        inst = get_sampler(sampler)(self, **options)
        task = TaskState(
            (part.id, name), tuple(fields), inst, sampler, dict(options), self._alloc.capacity
        )
        part.tasks[name] = task
        self._enqueue_ready(task, self._live_slots(part))
        return task

    def _live_slots(self, part: PartitionState) -> np.ndarray:
        h = self._h
        slots = np.flatnonzero(h["live"] & (h["partition"] == part.id))
        return slots[np.argsort(h["index"][slots], kind="stable")]

    def poll(
        self,
        *,
        task: str,
        partition: str,
        fields: Sequence[str] | None,
        batch_size: int,
        lease_s: float,
        sampler: str = "fifo",
        sampler_options: Mapping[str, Any] | None = None,
        min_version: int | None = None,
        max_group: int | None = None,
        short_ok: bool = False,
        owner: str | None = None,
    ) -> tuple[BatchMeta | None, Changes]:
        """Hand out a batch if one is due: full, end of stream, or (``short_ok``) whatever is
        queued. Returns (None, changes) when the caller should wait. The lease is ``owner``'s
        (the client's key). A wait that can never end is an error (see :meth:`_never`)."""
        self.leases.check_lease_s(lease_s)
        part = self.partition(partition)
        t = self._task(part, task, fields, sampler, sampler_options or {})
        t.sampler.check_batch_size(batch_size)
        if max_group is not None and not t.sampler.supports_max_group:
            raise ValueError(
                f"task {task!r}: max_group needs a sampler that orders by group id "
                '(sampler="group" or "balanced" with group_size, order="group"); its sampler '
                "is " + repr(t.sampler_name)
            )
        changes = Changes()
        if min_version is not None:
            dropped = t.sampler.drop_below(min_version)
            if dropped.size:
                changes.merge(self._mark_done(part, t, self._slots(dropped), dropped=True))
        avail = t.sampler.available(max_group)
        full = avail >= t.sampler.batch_rows(batch_size)
        # Finished and nothing still waiting for upstream fields: no wait can fill the batch.
        queued = avail if max_group is None else t.sampler.available()
        drained = part.finished and t.done + t.lost + t.leased + queued == part.rows_put
        if not (full or short_ok or (drained and (avail > 0 or t.leased == 0))):
            if part.finished and avail == 0 and t.leased == 0:
                self._never(part, t)
            return None, changes
        sel = t.sampler.sample(batch_size, max_group)
        slots = self._slots(sel.indexes)
        if drained and t.leased == 0 and t.sampler.available() == 0:
            reason = "end"  # after this batch the task has nothing left to receive
        elif full:
            reason = "full"
        else:
            reason = "drain" if drained else "timeout"
        lease_id = None
        if sel.indexes.size:
            lease = self.leases.open(t.key, sel.indexes, lease_s, owner)
            lease_id = lease.lease_id
            t.state[slots] = LEASED
            t.lease[slots] = lease_id
            t.leased += int(slots.size)
        h = self._h
        meta = BatchMeta(
            sel.indexes,
            h["unit"][slots],
            h["group"][slots],
            h["version"][slots],
            h["length"][slots],
            partition=part.name,
            fields=t.fields,
            task=task,
            lease_id=lease_id,
            lease_s=lease_s if lease_id is not None else None,
            reason=reason,
            splits=sel.splits,
            replica_units=self._copies(slots),
        )
        return meta, changes

    def _never(self, part: PartitionState, task: TaskState) -> None:
        """Raise when ``task`` waits for fields nobody ever wrote while nothing in its finished
        partition is still being processed (a misspelt field: no row will ever get them).
        Another task with rows left, or a declared task not started yet, may write them."""
        missing = [f for f in task.fields if f not in self._specs]
        if not missing or task.done + task.lost == part.rows_put:
            return
        if part.declared is not None and set(part.declared) - set(part.tasks):
            return  # a declared task has not started yet
        for other in part.tasks.values():
            if other is not task and other.done + other.lost < part.rows_put:
                return
        raise UnknownFieldError(
            f"task {task.key[1]!r} waits for fields {missing} of partition {part.name!r}, "
            "which no producer has written; the partition is finished and no other task has "
            f"rows left, so they will never come. Known fields: {sorted(self._specs)}"
        )

    # -- consumption done, freeing -----------------------------------------------------------
    def _mark_done(
        self, part: PartitionState, task: TaskState, slots: np.ndarray, *, dropped: bool
    ) -> Changes:
        task.state[slots] = DONE
        task.done += int(slots.size)
        if dropped:
            task.dropped += int(slots.size)
        changes = Changes()
        if part.finished:  # other tasks' waits may now end (see _never)
            changes.woken |= {t.key for t in part.tasks.values()}
        if part.declared is not None and task.key[1] in part.declared:
            done = self._h["done"]
            done[slots] += 1
            full = slots[done[slots] >= len(part.declared)]
            if full.size:
                self._free(part, full, changes)
        return changes

    def _free(self, part: PartitionState, slots: np.ndarray, changes: Changes) -> None:
        h = self._h
        indexes = h["index"][slots].copy()
        changes.freed.append(indexes)
        changes.freed_units.append(h["unit"][slots].copy())
        changes.space = True
        self.placement.add_bytes(h["unit"][slots], -h["nbytes"][slots])
        self._free_copies(slots, indexes, changes)
        for arr in self._ready.values():
            arr[slots] = False
        for task in part.tasks.values():
            task.state[slots] = WAITING
            task.lease[slots] = -1
        for k, (_, fill) in HEADER.items():
            h[k][slots] = fill
        self._map.remove(indexes)
        self._drop_custom_meta(indexes)
        self._drop_keys(part, indexes)
        self._alloc.free(slots)
        n = int(slots.size)
        part.rows_live -= n
        part.rows_freed += n
        self._rows_live -= n

    def discard(self, indexes: np.ndarray) -> Changes:
        """Undo an ``allocate`` whose payload never arrived (a put that failed half way)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        slots = self._map.lookup(indexes)
        slots = slots[slots >= 0]
        changes = Changes()
        for pid in np.unique(self._h["partition"][slots]).tolist():
            part = self._by_id[pid]
            mine = slots[self._h["partition"][slots] == pid]
            for task in part.tasks.values():
                if (task.state[mine] != WAITING).any():
                    raise ValueError("discard is only for rows no task has seen yet")
            self._free(part, mine, changes)
            part.rows_put -= int(mine.size)
            part.rows_freed -= int(mine.size)
            changes.woken |= {t.key for t in part.tasks.values()}
        return changes

    def finish(self, partition: str) -> Changes:
        """No more rows will be put into ``partition``: consumers get ``end`` once drained."""
        part = self.partition(partition)
        part.finished = True
        return Changes(woken={t.key for t in part.tasks.values()})

    def clear(self, partition: str | None = None) -> Changes:
        """Drop every row of ``partition`` (all partitions if None), acked or not.

        Leases on them end; tasks stay registered with empty queues and zero counters, the
        partition is open again (not finished) and may declare its tasks anew.
        """
        changes = Changes()
        parts = (
            list(self._partitions.values()) if partition is None else [self.partition(partition)]
        )
        for part in parts:
            for lease in self.leases.of_partition(part.id):
                self.leases.close(lease, "cleared")
            live = self._live_slots(part)
            if live.size:
                self._free(part, live, changes)
            for task in part.tasks.values():
                task.sampler.clear()
                task.leased = task.done = task.dropped = task.lost = 0
                changes.woken.add(task.key)
            part.rows_put = part.rows_freed = part.rows_lost = 0
            part.finished = False
        return changes
