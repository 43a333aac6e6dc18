"""``Queues``: what consumer tasks get: batches (``poll``), and the calls on their leases.

A task asks for a batch (:meth:`Queues.poll`): its sampler picks rows from its queue, which
become *leased* under a new lease (:mod:`transferqueue.controller.leases`). The lease ends by
``ack`` (consumed: done for the task), ``release`` (back to the queue), or its deadline
(``expire``: back to the queue); ``renew`` extends it. An ack, a release or a renew sent
again after its reply was lost changes nothing (clients send them again through a controller
restart, see :mod:`transferqueue.client.controller_link`). ``reset_consumption`` replays a
partition to a task:

- every live row of the partition the task has leased or consumed goes back to the task's
  queue. The task's open leases on the partition close first (``reset``), so a late ack or
  put of one gets :class:`~transferqueue.errors.UnknownLeaseError` and consumes nothing: each
  live row is delivered to the task once more, once. Rows already *freed* (every declared
  task acknowledged them) are gone and are not replayed; a partition keeps its rows for a
  replay while it has no declared tasks (rows stay until ``clear``) or while a declared task
  has not consumed them.

Partitions are finished (no more rows: consumers get ``end`` once drained), declared (the
tasks that must all consume a row before it is freed) and cleared here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from transferqueue.controller.journal import Recorder, journaled, journaled_unless_same
from transferqueue.controller.leases import Lease, LeaseTable
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes, PartitionState, TaskState
from transferqueue.errors import UnknownFieldError, UnknownLeaseError
from transferqueue.meta import BatchMeta
from transferqueue.wire.replies import DONE, LEASED, QUEUED, WAITING

__all__ = ["Queues"]


class Queues:
    """Batches for tasks, and their leases (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, partitions: Partitions, leases: LeaseTable) -> None:
        self._rows = rows
        self._partitions = partitions
        self.leases = leases

    # -- tasks of a partition ----------------------------------------------------------------
    @journaled
    def declare_tasks(self, partition: str, tasks: Sequence[str]) -> None:
        """Name every consumer task of ``partition``: rows are freed once all acknowledged.

        Call it before consumers acknowledge anything; until a partition has declared tasks
        its rows are kept until ``clear`` (a task that starts late must find its rows).
        """
        part = self._partitions.partition(partition)
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
        live = self._rows.live_slots(part.id)
        done = np.zeros(live.size, dtype=np.int64)
        for t in names:
            task = part.tasks.get(t)
            if task is not None:
                done += task.state[live] == DONE
        self._rows.header["done"][live] = done

    @journaled
    def finish(self, partition: str) -> Changes:
        """No more rows will be put into ``partition``: consumers get ``end`` once drained."""
        part = self._partitions.partition(partition)
        part.finished = True
        return Changes(woken={t.key for t in part.tasks.values()})

    @journaled
    def clear(self, partition: str | None = None) -> Changes:
        """Drop every row of ``partition`` (all partitions if None), acked or not.

        Leases on them end; tasks stay registered with empty queues and zero counters, the
        partition is open again (not finished) and may declare its tasks anew.
        """
        changes = Changes()
        parts = (
            list(self._partitions) if partition is None else [self._partitions.partition(partition)]
        )
        for part in parts:
            for lease in self.leases.of_partition(part.id):
                self.leases.close(lease, "cleared")
            live = self._rows.live_slots(part.id)
            if live.size:
                self._partitions.free(part, live, changes)
            self._partitions.cleared(part)
            changes.woken |= {task.key for task in part.tasks.values()}
        if partition is None:
            self._rows.specs.clear()  # (also of partitions that never held a row)
        return changes

    # -- batches -----------------------------------------------------------------------------
    @journaled
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
        holder: str | None = None,
        consume: bool = False,
        request_id: int | None = None,
    ) -> tuple[BatchMeta | None, Changes]:
        """Hand out a batch if one is due: full, end of stream, or (``short_ok``) whatever is
        queued. Returns (None, changes) when the caller should wait. The lease is ``owner``'s
        (the client's key) and ``holder``'s (the handle that took it, see
        :meth:`return_holders`). A wait that can never end is an error (see :meth:`_never`).

        ``consume`` (``get_meta(consume=True)``, at most once): a batch of ``batch_size`` rows
        is consumed as it is handed out, as if acknowledged at once (``acked``; its lease id
        is recorded as acked, see :meth:`LeaseTable.acked_at_once`), without the lease that
        an ``ack`` in the same call would open and close; a short batch is leased.

        ``request_id`` (the client's, one per call, kept by every sending of it): when a lease
        that request took is still active, its batch is answered again and nothing changes.
        A call whose reply was lost (its controller died after journaling the lease) and that
        is sent again to the restarted controller so gets the rows it was given, instead of
        leaving them leased to nobody until the lease's deadline."""
        self.leases.check_lease_s(lease_s)
        part = self._partitions.partition(partition)
        t = self._partitions.task(part, task, fields, sampler, sampler_options or {})
        if request_id is not None:
            again = self._again(part, t, request_id, owner, lease_s)
            if again is not None:
                return again, Changes()
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
                slots = self._rows.slots(dropped)
                changes.merge(self._partitions.mark_done(part, t, slots, dropped=True))
        avail = t.sampler.available(max_group)
        full = avail >= t.sampler.batch_rows(batch_size)
        drained = self.drained(part, t)
        if not (full or short_ok or (drained and (avail > 0 or t.leased == 0))):
            if part.finished and avail == 0 and t.leased == 0:
                self._never(part, t)
            return None, changes
        sel = t.sampler.sample(batch_size, max_group)
        slots = self._rows.slots(sel.indexes)
        if drained and t.leased == 0 and t.sampler.available() == 0:
            reason = "end"  # after this batch the task has nothing left to receive
        elif full:
            reason = "full"
        else:
            reason = "drain" if drained else "timeout"
        lease_id = None
        consumed = consume and sel.indexes.size == batch_size
        if consumed:
            lease_id = self.leases.acked_at_once()
        elif sel.indexes.size:
            lease = self.leases.open(t.key, sel.indexes, lease_s, owner, holder, request_id)
            lease.reason, lease.splits = reason, sel.splits
            lease_id = lease.lease_id
            t.state[slots] = LEASED
            t.lease[slots] = lease_id
            t.leased += int(slots.size)
        meta = self._rows.meta(
            slots,
            part.name,
            fields=t.fields,
            task=task,
            lease_id=lease_id,
            lease_s=lease_s if lease_id is not None else None,
            reason=reason,
            splits=sel.splits,
        )
        if consumed:  # (after the meta: rows every declared task is done with are freed)
            meta.acked = True
            changes.merge(self._partitions.mark_done(part, t, slots, dropped=False))
            changes.woken.add(t.key)
        return meta, changes

    def _again(
        self,
        part: PartitionState,
        task: TaskState,
        request_id: int,
        owner: str | None,
        lease_s: float,
    ) -> BatchMeta | None:
        """The batch of the active lease request ``request_id`` took (see :meth:`poll`), as
        its first reply gave it; None when there is none (or none of its rows is left)."""
        lease = self.leases.of_request(request_id, task.key, owner)
        if lease is None:
            return None
        slots = self._leased_slots(lease, task)
        if slots.size == 0:
            return None
        whole = slots.size == lease.indexes.size  # (else rows were lost: no splits)
        return self._rows.meta(
            slots,
            part.name,
            fields=task.fields,
            task=task.key[1],
            lease_id=lease.lease_id,
            lease_s=lease_s,  # (every sending asks the same)
            reason=lease.reason,
            splits=lease.splits if whole else None,
        )

    @staticmethod
    def drained(part: PartitionState, task: TaskState) -> bool:
        """The end-of-stream rule: ``part`` is finished and no row of it still waits for
        ``task``'s fields. Every row ever put is then consumed, lost or retired (counted for
        the task even when it happened before its first poll, see
        :meth:`~transferqueue.controller.retire.Retirement.catch_up`), leased, or held by its
        sampler; a leased one may come back, a held one is handed out or can never be (a
        group that will never be whole), so no wait can bring more."""
        settled = task.done + task.lost + task.retired
        return part.finished and settled + task.leased + task.sampler.held() == part.rows_put

    def _never(self, part: PartitionState, task: TaskState) -> None:
        """Raise when ``task`` waits for fields nobody ever wrote while nothing in its finished
        partition is still being processed (a misspelt field: no row will ever get them).
        Another task with rows left, or a declared task not started yet, may write them."""
        specs = self._rows.specs_of(part.name)
        missing = [f for f in task.fields if f not in specs]
        if not missing or task.done + task.lost + task.retired == part.rows_put:
            return
        if part.declared is not None and set(part.declared) - set(part.tasks):
            return  # a declared task has not started yet
        for other in part.tasks.values():
            if other is not task and other.done + other.lost + other.retired < part.rows_put:
                return
        raise UnknownFieldError(
            f"task {task.key[1]!r} waits for fields {missing} of partition {part.name!r}, "
            "which no producer has written; the partition is finished and no other task has "
            f"rows left, so they will never come. Known fields: {sorted(specs)}"
        )

    # -- leases ------------------------------------------------------------------------------
    @journaled
    def ack(
        self, lease_id: int, indexes: np.ndarray | None = None, owner: str | None = None
    ) -> Changes:
        """Consume the lease's rows (all, or ``indexes`` of them). Acking a lease that was
        fully acknowledged already is a no-op (an ack sent again: its reply was lost)."""
        if self.leases.closed_reason(lease_id) in ("lost", "acked"):
            return Changes()  # (a lease whose rows were all lost with a unit: nothing left)
        lease = self.leases.get(lease_id, owner)
        return self.finish_rows(lease, self._lease_slots(lease, indexes), acked=True)

    @journaled
    def release(
        self, lease_id: int, indexes: np.ndarray | None = None, owner: str | None = None
    ) -> Changes:
        """Give rows back unconsumed (a consumer that cannot process them); no-op if acked,
        or released already (a release sent again)."""
        closed = self.leases.closed_reason(lease_id)
        if closed in ("lost", "released") or (indexes is None and closed == "acked"):
            return Changes()
        lease = self.leases.get(lease_id, owner)
        return self.finish_rows(lease, self._lease_slots(lease, indexes), acked=False)

    @journaled
    def renew(
        self,
        lease_id: int,
        lease_s: float,
        indexes: np.ndarray | None = None,
        owner: str | None = None,
    ) -> None:
        """Extend the deadline (a producer about to write results for the lease's rows)."""
        self.leases.check_lease_s(lease_s)
        if self.leases.closed_reason(lease_id) == "lost":
            return  # (its rows were lost with a unit: a commit says so)
        lease = self.leases.get(lease_id, owner)
        if indexes is not None:
            self._lease_slots(lease, indexes)
        self.leases.renew(lease, lease_s)

    def _expired(self) -> int:
        return self.leases.expired

    @journaled_unless_same(_expired)
    def expire(self) -> Changes:
        """Return the rows of leases past their deadline to their tasks' queues."""
        changes = Changes()
        for lease in self.leases.due():
            self._requeue(lease, changes)
        return changes

    @journaled
    def return_holders(self, holders: Sequence[str], owner: str | None = None) -> Changes:
        """The clients ``holders`` are gone (silent past the liveness bound, closed, or
        replaced): every lease they hold closes as ``returned`` and its rows go back to their
        task's queue now, as at a deadline (a late ack is refused the same way). With keys in
        use, only the leases of ``owner`` (the caller's key) are returned."""
        changes = Changes()
        for holder in holders:
            for lease in self.leases.of_holder(holder):
                if owner is not None and lease.owner is not None and lease.owner != owner:
                    continue
                rows = self._requeue(lease, changes)
                self.leases.give_back(lease, rows)
        return changes

    def _requeue(self, lease: Lease, changes: Changes) -> int:
        """The live rows ``lease`` holds go back to its task's queue (front of their
        version); returns how many."""
        _, task = self._partitions.task_of(lease)
        slots = self._leased_slots(lease, task)
        task.leased -= int(slots.size)
        task.lease[slots] = -1
        task.state[slots] = QUEUED
        task.sampler.add(self._rows.header["index"][slots], returned=True)
        changes.woken.add(task.key)
        return int(slots.size)

    def next_deadline(self) -> float | None:
        return self.leases.next_deadline()

    def held(
        self, lease_id: int, indexes: np.ndarray, slots: np.ndarray, owner: str | None = None
    ) -> Lease:
        """Lease ``lease_id``, which must hold rows ``indexes`` (in ``slots``) now."""
        lease = self.leases.get(lease_id, owner)
        _, task = self._partitions.task_of(lease)
        held = (task.lease[slots] == lease_id) & (task.state[slots] == LEASED)
        if not held.all():
            rows = indexes[~held][:5].tolist()
            raise UnknownLeaseError(
                f"rows {rows} are not held by lease {lease_id} (acknowledged already or "
                "never part of it)"
            )
        return lease

    def acked_already(self, lease_id: int, indexes: np.ndarray, fields: Sequence[str]) -> bool:
        """Whether a commit acking ``lease_id`` landed before: the lease was acked and the
        rows still live have every field (freed rows were consumed by every task)."""
        if self.leases.closed_reason(lease_id) != "acked":
            return False
        slots = self._rows.lookup(indexes)
        slots = slots[slots >= 0]
        rows = self._rows
        known = rows.field_names()
        return all(name in known and rows.ready_of(name)[slots].all() for name in fields)

    def finish_rows(self, lease: Lease, slots: np.ndarray, *, acked: bool) -> Changes:
        """Rows ``slots`` of ``lease`` are acknowledged (done for its task) or released
        (queued again); the lease closes with its last row."""
        part, task = self._partitions.task_of(lease)
        n = int(slots.size)
        task.leased -= n
        task.lease[slots] = -1
        lease.remaining -= n
        if lease.remaining <= 0:
            self.leases.close(lease, "acked" if acked else "released")
        if acked:
            changes = self._partitions.mark_done(part, task, slots, dropped=False)
        else:
            task.state[slots] = QUEUED
            task.sampler.add(self._rows.header["index"][slots], returned=True)
            changes = Changes()
        changes.woken.add(task.key)
        return changes

    def _leased_slots(self, lease: Lease, task: TaskState) -> np.ndarray:
        """The slots of the live rows ``lease`` holds now."""
        slots = self._rows.lookup(lease.indexes)
        slots = slots[slots >= 0]
        return slots[(task.lease[slots] == lease.lease_id) & (task.state[slots] == LEASED)]

    def _lease_slots(self, lease: Lease, indexes: np.ndarray | None) -> np.ndarray:
        if indexes is None:
            return self._leased_slots(lease, self._partitions.task_of(lease)[1])
        indexes = self._rows.without_lost(np.asarray(indexes, dtype=np.int64))
        slots = self._rows.slots(indexes)
        self.held(lease.lease_id, indexes, slots, lease.owner)
        return slots

    # -- replay ------------------------------------------------------------------------------
    @journaled
    def reset_consumption(self, partition: str, task: str) -> tuple[int, Changes]:
        """Give every live row of ``partition`` that ``task`` leased or consumed back to the
        task's queue (see the module). Returns the number of rows given back."""
        part = self._partitions.known(partition)
        t = self._partitions.known_task(part, task)
        if t is None:
            return 0, Changes()  # (a declared task that has not started: all is waiting)
        for lease in self.leases.of_partition(part.id):
            if lease.task == t.key:
                self.leases.close(lease, "reset")
        live = self._rows.live_slots(part.id)
        state = t.state[live]
        back = live[(state == LEASED) | (state == DONE)]
        done = live[state == DONE]
        if part.declared is not None and task in part.declared:
            self._rows.header["done"][done] -= 1  # (freed only once all tasks are done again)
        t.done -= int(done.size)
        t.dropped = min(t.dropped, t.done)  # (which rows were dropped is not kept per row)
        t.leased = 0  # (the task's leases are all on this partition: a task is per partition)
        t.lease[back] = -1
        # The queue is rebuilt in index order from every ready row, as after a unit loss:
        # rows given back join the queued ones (a group sampler sees whole groups again).
        requeue = live[(state == QUEUED) | (state == LEASED) | (state == DONE)]
        t.state[requeue] = WAITING
        t.sampler.clear()
        self._partitions.enqueue_ready(t, requeue)
        return int(back.size), Changes(woken={t.key})
