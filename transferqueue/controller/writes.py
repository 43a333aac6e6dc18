"""``Writes``: a producer's side of the controller: new rows, and fields that land in them.

A put of new rows is ``allocate`` (indexes, units from :mod:`transferqueue.controller.placement`,
headers), the payload written to the units by the client, then ``commit`` (the fields are
ready: the tasks that consume them queue the rows; a put that names a lease acknowledges it).
A put that failed half way gives its rows back with ``discard``. Everything a call checks is
checked before any state changes, so a failed call leaves the controller as it was.

``capacity_rows`` bounds the rows held at once (None: no bound): an ``allocate`` beyond it is
a :class:`~transferqueue.errors.CapacityError` (the service makes it wait for room first).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.placement import Placement
from transferqueue.controller.queues import Queues
from transferqueue.controller.rereplicate import Copies
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes, header_column
from transferqueue.errors import BadRequestError, CapacityError, FinishedError, UnknownFieldError
from transferqueue.limits import MAX_ROWS
from transferqueue.meta import BatchMeta
from transferqueue.wire.replies import WAITING

__all__ = ["Writes"]


class Writes:
    """``allocate``, ``commit``, ``discard`` (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(
        self,
        rows: RowTable,
        partitions: Partitions,
        placement: Placement,
        queues: Queues,
        copies: Copies,
        capacity_rows: int | None = None,
    ) -> None:
        self._rows = rows
        self._partitions = partitions
        self._placement = placement
        self._queues = queues
        self._copies = copies
        self.capacity_rows = capacity_rows

    def can_allocate(self, n: int) -> bool:
        return self.capacity_rows is None or self._rows.live + n <= self.capacity_rows

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

    @journaled
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
        """New rows in ``partition``: indexes, units (see
        :meth:`~transferqueue.controller.placement.Placement.place`) and headers.

        ``nbytes`` (the payload's size, if the writer knows it) decides over how many units
        the rows spread; ``producer`` (a name the writer keeps for all its puts) lets its
        small puts stay on one unit for a while."""
        self.check_allocate(n, partition)
        if producer is not None and not isinstance(producer, str):
            raise TypeError(f"producer must be a string naming the writer, got {producer!r}")
        rows = self._rows
        if not self.can_allocate(n):
            raise CapacityError(
                f"TransferQueue holds {rows.live} rows; {n} more exceed "
                f"capacity_rows={self.capacity_rows}. Consumers must acknowledge rows "
                "(declared tasks) or the partition must be cleared"
            )
        g = None if groups is None else header_column("group", groups, n, default=-1)
        v = header_column("version", versions, n, default=-1)
        ln = header_column("length", lengths, n, default=-1)
        part = self._partitions.partition(partition)
        if rows.free_count < n:
            cap = rows.capacity
            rows.grow(cap + max(n - rows.free_count, cap // 2, 1024), self._partitions.tasks())
        units = self._placement.place(n, nbytes, producer)
        copies = self._placement.replicas_of(units)  # (None with replicas=1)
        indexes, slots = rows.add(part.id, units, g, v, ln)
        h = rows.header
        if nbytes and n:
            share = np.full(n, nbytes // n, dtype=np.int64)
            share[: nbytes % n] += 1
            h["nbytes"][slots] = share
            self._placement.add_bytes(units, share)
            if copies is not None:
                self._placement.add_bytes(copies[copies >= 0], share[copies >= 0])
        if copies is not None:
            h["replica"][slots] = copies
        part.rows_put += n
        part.rows_live += n
        return BatchMeta(
            indexes,
            units,
            h["group"][slots],
            v,
            ln,
            partition=part.name,
            replica_units=copies,
        )

    @journaled
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
        ``copies``: the second unit of each row the writer wrote (see
        :meth:`~transferqueue.controller.rereplicate.Copies.landed`).

        Validates everything (rows live, fields registered, the lease) before changing state.
        A commit sent again after its reply was lost (its lease acked by the first, its fields
        ready on every row still live) is a no-op.
        """
        indexes = np.asarray(indexes, dtype=np.int64)
        if lease_id is not None and self._queues.acked_already(lease_id, indexes, fields):
            return Changes()
        rows = self._rows
        slots = rows.slots(indexes)
        pids = rows.header["partition"][slots]
        upids = np.unique(pids)
        for pid in upids.tolist():
            part = self._partitions.by_id(pid)
            assert part is not None
            specs = rows.specs_of(part.name)
            for name in fields:
                if name not in specs:
                    raise UnknownFieldError(
                        f"field {name!r} has no registered spec in partition {part.name!r}; "
                        "register_fields before commit (a clear of the partition during the "
                        "put forgets its specs: put again)"
                    )
        n = indexes.size
        v = None if versions is None else header_column("version", versions, n, default=-1)
        ln = None if lengths is None else header_column("length", lengths, n, default=-1)
        lease = None
        if lease_id is not None:
            lease = self._queues.held(lease_id, indexes, slots, owner)
        h = rows.header
        h["committed"][slots] = True
        if v is not None:
            h["version"][slots] = v
        if ln is not None:
            h["length"][slots] = ln
        changes = self._copies.landed(slots, copies)
        for name in fields:
            rows.ready_of(name)[slots] = True
        fset = set(fields)
        for pid in upids.tolist():
            part = self._partitions.by_id(pid)
            assert part is not None
            in_part = slots if upids.size == 1 else slots[pids == pid]
            for task in part.tasks.values():
                if fset.intersection(task.fields) and self._partitions.enqueue_ready(task, in_part):
                    changes.woken.add(task.key)
        if lease is not None:
            changes.merge(self._queues.finish_rows(lease, slots, acked=True))
        return changes

    @journaled
    def discard(self, indexes: np.ndarray) -> Changes:
        """Undo an ``allocate`` whose payload never arrived (a put that failed half way)."""
        slots = self._rows.lookup(indexes)
        slots = slots[slots >= 0]
        changes = Changes()
        pids = self._rows.header["partition"]
        for pid in np.unique(pids[slots]).tolist():
            part = self._partitions.by_id(pid)
            assert part is not None
            mine = slots[pids[slots] == pid]
            for task in part.tasks.values():
                if (task.state[mine] != WAITING).any():
                    raise ValueError("discard is only for rows no task has seen yet")
            self._partitions.free(part, mine, changes)
            part.rows_put -= int(mine.size)
            part.rows_freed -= int(mine.size)
            changes.woken |= {t.key for t in part.tasks.values()}
        return changes
