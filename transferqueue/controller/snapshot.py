"""The controller's state of partitions as plain data: exported at one instant, imported
into another controller. Used by store checkpoints (:mod:`transferqueue.client.checkpoint`) and
meant for a controller-restart journal too (hence the original ``indexes`` and ``units``,
and exact per-row task states, leases included: a journal restores what a save rounds off).

A part of the controller core (:class:`~transferqueue.controller.core.Controller`) that reads
and makes rows and tasks through the other parts::

    PartitionExport  name | declared | finished | per row, in index order: indexes, units,
                     groups, versions, lengths | ready {field: bool[N]} | custom metadata
                     (positions + msgpack maps) | tasks
    TaskExport       name | fields | sampler | options | states uint8[N] (waiting, queued,
                     leased, done: status.STATES) | queue: positions of the queued rows in
                     the order the sampler hands them out (None: the sampler cannot say) |
                     leases: positions of each open lease's rows, in lease order
    ExportHolds      rows of a snapshot whose payload must stay on the units until the
                     snapshot's reader is done (frees the controller decides meanwhile wait)

Only *committed* live rows are exported (rows a put allocated but has not committed yet are
not part of any snapshot). Importing is in two steps, so that payload can be written in
between: :meth:`Snapshots.import_rows` creates the rows (headers, no field ready; the partition is
*loading*: nobody may consume it), the loader writes and commits the fields,
:meth:`Snapshots.import_tasks` then creates the tasks with their consumed rows and queue order and
opens the partition.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.keys import KeyedRows
from transferqueue.controller.leases import Lease, LeaseTable
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.queues import Queues
from transferqueue.controller.rows import RowTable
from transferqueue.controller.samplers import get_sampler
from transferqueue.controller.state import Changes, TaskState
from transferqueue.controller.status import RowStatus
from transferqueue.controller.writes import Writes
from transferqueue.errors import BadRequestError, PartitionExistsError
from transferqueue.meta import BatchMeta
from transferqueue.wire.replies import (
    DONE,
    LEASED,
    QUEUED,
    WAITING,
    PartitionExport,
    TaskExport,
    TaskImport,
)

__all__ = ["ExportHolds", "Snapshots"]


class Snapshots:
    """Partitions exported and imported as plain data (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(
        self,
        rows: RowTable,
        partitions: Partitions,
        leases: LeaseTable,
        writes: Writes,
        queues: Queues,
        keys: KeyedRows,
        status: RowStatus,
    ) -> None:
        self._rows = rows
        self._partitions = partitions
        self._leases = leases
        self._writes = writes
        self._queues = queues
        self._keys = keys
        self._status = status

    # -- export ------------------------------------------------------------------------------
    def export_partition(self, name: str) -> PartitionExport:
        """``name``'s committed live rows, headers, readiness, custom metadata and tasks,
        copied (the controller goes on changing; the export does not)."""
        part = self._partitions.known(name)
        self.check_not_loading(name)  # (half loaded: its tasks are not there yet)
        h = self._rows.header
        live = self._rows.live_slots(part.id)
        slots = live[h["committed"][live]]
        indexes = h["index"][slots].copy()
        specs = self._rows.specs_of(name)
        ready = {f: arr[slots].copy() for f, arr in self._rows.ready.items() if f in specs}
        custom_pos, custom = self._status.custom_of(indexes)
        leases = self._leases.of_partition(part.id)
        tasks = [_export_task(t, indexes, slots, leases) for t in part.tasks.values()]
        key_rows, keys = self._export_keys(name, indexes)
        return PartitionExport(
            part.name,
            None if part.declared is None else list(part.declared),
            part.finished,
            indexes,
            h["unit"][slots].copy(),
            h["group"][slots].copy(),
            h["version"][slots].copy(),
            h["length"][slots].copy(),
            ready,
            custom_pos,
            custom,
            tasks,
            key_rows,
            keys,
        )

    def _export_keys(self, name: str, indexes: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """(positions among ``indexes``, keys) of the exported rows that have a string key."""
        bound = self._keys.export_keys(name).get(name)
        if bound is None:
            return np.empty(0, dtype=np.int64), []
        rows = bound["indexes"]
        pos = np.searchsorted(indexes, rows).clip(max=max(indexes.size - 1, 0))
        exported = (indexes[pos] == rows) if indexes.size else np.zeros(rows.size, dtype=bool)
        keys = [k for k, e in zip(bound["keys"], exported.tolist(), strict=True) if e]
        return pos[exported].astype(np.int64), keys

    # -- import ------------------------------------------------------------------------------
    @journaled
    def import_rows(
        self,
        partition: str,
        groups: np.ndarray,
        versions: np.ndarray,
        lengths: np.ndarray,
        *,
        first: bool,
        keys: Sequence[str] = (),
        key_rows: np.ndarray | None = None,
    ) -> BatchMeta:
        """New committed rows with these headers in ``partition``, no field ready yet.
        ``first``: the partition must be new (else :class:`PartitionExistsError`) and becomes
        *loading*; later calls add rows to a partition that is loading. ``keys``: string keys
        of the rows at positions ``key_rows`` (checked before any row is made)."""
        part = self._partitions.get(partition)
        if first:
            if part is not None and (part.rows_live or part.tasks or part.declared is not None):
                raise PartitionExistsError(
                    f"partition {partition!r} already exists in this store ({part.rows_live} "
                    f"rows, tasks {sorted(part.tasks)}); load into a new (or reset) store, or "
                    "clear and reset the partition's tasks first"
                )
        elif part is None or not part.loading:
            raise BadRequestError(f"partition {partition!r} is not being loaded; start with first")
        n = int(groups.size)
        if versions.size != n or lengths.size != n:
            raise BadRequestError(
                "import_rows: groups, versions and lengths need one value per row"
            )
        key_pos = np.empty(0, dtype=np.int64) if key_rows is None else np.asarray(key_rows)
        if key_pos.shape != (len(keys),) or (
            key_pos.size and not 0 <= key_pos.min() <= key_pos.max() < n
        ):
            raise BadRequestError(
                f"import_rows: {len(keys)} keys need as many positions among the {n} rows, "
                f"got key_rows of shape {key_pos.shape}"
            )
        if keys:
            self._keys.check_new_keys(partition, list(keys))
        meta = self._writes.allocate(
            n, partition, groups=groups, versions=versions, lengths=lengths
        )
        self._partitions.partition(partition).loading = True
        # Committed now, so that the reclaim of abandoned puts never takes rows a long load
        # holds.
        self._rows.header["committed"][self._rows.slots(meta.indexes)] = True
        if keys:
            self._keys.restore_keys(partition, list(keys), meta.indexes[key_pos])
        return meta

    @journaled
    def import_tasks(
        self,
        partition: str,
        tasks: Sequence[TaskImport],
        declared: list[str] | None,
        finished: bool,
    ) -> Changes:
        """Create the tasks of a loading partition (their consumed rows done, their queues in
        the given order), declare its tasks, mark it finished as saved, and open it to
        consumers."""
        part = self._partitions.get(partition)
        if part is None or not part.loading:
            raise BadRequestError(f"partition {partition!r} is not being loaded; import_rows first")
        if part.tasks:
            raise BadRequestError(f"partition {partition!r} got tasks while it loaded")
        rows = self._rows
        live = rows.live_slots(part.id)
        for t in tasks:
            for r in (t.consumed, t.queue, *t.leases):
                rows.slots(r)  # (rows that are not the partition's live rows: an error)
            get_sampler(t.sampler)  # (an unknown sampler: an error before anything changes)
        changes = Changes()
        for t in tasks:
            task = self._partitions.add_task(part, t.name, t.fields, t.sampler, t.options)
            done = rows.slots(t.consumed)
            task.state[done] = DONE
            task.done = int(done.size)
            # The saved queue first, in its order; then the rows leased at save time, given
            # back as an expired lease gives them back; then ready rows none names, by index.
            self._partitions.enqueue_ready(task, rows.slots(t.queue))
            for leased in t.leases:
                back = rows.slots(leased)
                back = back[task.state[back] == WAITING]
                task.state[back] = QUEUED
                task.sampler.add(rows.header["index"][back], returned=True)
            self._partitions.enqueue_ready(task, live)
            changes.woken.add(task.key)
        part.loading = False
        if declared is not None:
            self._queues.declare_tasks(partition, declared)
        part.finished = finished
        return changes

    def check_not_loading(self, partition: str) -> None:
        """Raise when ``partition`` is being loaded (a put or get_meta must wait for the
        load)."""
        part = self._partitions.get(partition)
        if part is not None and part.loading:
            raise BadRequestError(
                f"partition {partition!r} is being loaded from a save; consume or put into it "
                "once the load has finished"
            )

    @journaled
    def end_loading(self, partition: str | None) -> None:
        """A cleared partition (all if None) is no longer loading: a load that failed half
        way leaves it so until then."""
        for part in self._partitions:
            if partition is None or part.name == partition:
                part.loading = False


def _export_task(
    task: TaskState, indexes: np.ndarray, slots: np.ndarray, leases: list[Lease]
) -> TaskExport:
    states = task.state[slots]
    queued = task.sampler.queued()
    queue = None
    if queued is not None:
        # (the queue holds only exported rows: queued rows are committed and live)
        queue = np.searchsorted(indexes, queued).astype(np.int64)
    held = []
    for lease in leases:  # (in the order they were opened)
        if lease.task != task.key:
            continue
        pos = np.searchsorted(indexes, lease.indexes).clip(max=max(indexes.size - 1, 0))
        mine = (indexes[pos] == lease.indexes) if indexes.size else np.zeros(0, dtype=bool)
        pos = pos[mine]
        pos = pos[(states[pos] == LEASED) & (task.lease[slots[pos]] == lease.lease_id)]
        if pos.size:
            held.append(pos.astype(np.int64))
    return TaskExport(
        task.key[1],
        list(task.fields),
        task.sampler_name,
        dict(task.options),
        states.copy(),
        queue,
        held,
    )


# -- holds ---------------------------------------------------------------------------------------
Free = tuple[np.ndarray, np.ndarray]  # (row indexes, their units)


class ExportHolds:
    """Snapshots whose rows' payload must stay on the units while a save reads it.

    The controller frees rows as usual while a save runs (consumers go on acknowledging);
    only the messages that drop the payload from the units wait: :meth:`hold` keeps the
    frees of held rows back, :meth:`end` and :meth:`expire` hand them out once no snapshot
    holds them. A hold lasts ``hold_s`` from its last renewal, so a saver that died frees
    its rows in the end."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._holds: dict[int, tuple[float, np.ndarray]] = {}  # id -> (deadline, indexes)
        self._waiting: list[Free] = []

    def __len__(self) -> int:
        return len(self._holds)

    def open(self, indexes: np.ndarray, hold_s: float) -> int:
        hold_id = secrets.randbits(63) or 1
        self._holds[hold_id] = (self._clock() + hold_s, np.sort(indexes))
        return hold_id

    def renew(self, hold_id: int, hold_s: float) -> list[Free]:
        """Extend a hold by ``hold_s`` from now; ``hold_s == 0`` ends it (frees it kept back
        and no other hold keeps are returned)."""
        hold = self._holds.get(hold_id)
        if hold is None:
            raise BadRequestError(
                f"snapshot {hold_id} holds no rows (it ended, or its hold_s passed: rows "
                "acknowledged meanwhile may have been freed); save again with a longer hold_s"
            )
        if hold_s > 0:
            self._holds[hold_id] = (self._clock() + hold_s, hold[1])
            return []
        del self._holds[hold_id]
        return self._release()

    def expire(self) -> list[Free]:
        now = self._clock()
        gone = [k for k, (deadline, _) in self._holds.items() if deadline <= now]
        for k in gone:
            del self._holds[k]
        return self._release() if gone else []

    def hold(self, indexes: np.ndarray, units: np.ndarray) -> Free:
        """Of rows to free, those no snapshot holds; the others wait for their holds."""
        if not self._holds or indexes.size == 0:
            return indexes, units
        held = self._held(indexes)
        if held.any():
            self._waiting.append((indexes[held], units[held]))
        return indexes[~held], units[~held]

    def _held(self, indexes: np.ndarray) -> np.ndarray:
        held = np.zeros(indexes.size, dtype=bool)
        for _, rows in self._holds.values():
            pos = np.searchsorted(rows, indexes).clip(max=max(rows.size - 1, 0))
            held |= rows[pos] == indexes if rows.size else False
        return held

    def _release(self) -> list[Free]:
        waiting, self._waiting = self._waiting, []
        return [self.hold(i, u) for i, u in waiting]
