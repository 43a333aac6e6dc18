"""The controller's state of partitions as plain data: exported at one instant, imported
into another controller. Used by store checkpoints (:mod:`transferqueue.client.checkpoint`) and
meant for a controller-restart journal too (hence the original ``indexes`` and ``units``,
and exact per-row task states, leases included: a journal restores what a save rounds off).

A companion of :class:`~transferqueue.controller.core.Controller` that reads and writes its
columns, as the mixins of :mod:`transferqueue.controller.health` and
:mod:`transferqueue.controller.status` do::

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
between: :func:`import_rows` creates the rows (headers, no field ready; the partition is
*loading*: nobody may consume it), the loader writes and commits the fields,
:func:`import_tasks` then creates the tasks with their consumed rows and queue order and
opens the partition.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from transferqueue.controller.leases import Lease
from transferqueue.controller.samplers import get_sampler
from transferqueue.controller.state import Changes, PartitionState, TaskState
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

if TYPE_CHECKING:
    from transferqueue.controller.core import Controller

__all__ = [
    "ExportHolds",
    "check_not_loading",
    "end_loading",
    "export_partition",
    "import_rows",
    "import_tasks",
]


def export_partition(ctl: Controller, name: str) -> PartitionExport:
    """``name``'s committed live rows, headers, readiness, custom metadata and tasks, copied
    (the controller goes on changing; the export does not)."""
    part = ctl._known_partition(name)
    check_not_loading(ctl, name)  # (half loaded: its tasks are not there yet)
    h = ctl._h
    live = ctl._live_slots(part)
    slots = live[h["committed"][live]]
    indexes = h["index"][slots].copy()
    ready = {f: arr[slots].copy() for f, arr in ctl._ready.items() if f in ctl._specs}
    custom_pos = [k for k, i in enumerate(indexes.tolist()) if i in ctl._custom]
    custom = [ctl._custom[int(indexes[k])] for k in custom_pos]
    leases = ctl.leases.of_partition(part.id)
    tasks = [_export_task(t, indexes, slots, leases) for t in part.tasks.values()]
    key_rows, keys = _export_keys(ctl, name, indexes)
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
        np.asarray(custom_pos, dtype=np.int64),
        custom,
        tasks,
        key_rows,
        keys,
    )


def _export_keys(ctl: Controller, name: str, indexes: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(positions among ``indexes``, keys) of the exported rows that have a string key."""
    bound = ctl.export_keys(name).get(name)
    if bound is None:
        return np.empty(0, dtype=np.int64), []
    rows = bound["indexes"]
    pos = np.searchsorted(indexes, rows).clip(max=max(indexes.size - 1, 0))
    exported = (indexes[pos] == rows) if indexes.size else np.zeros(rows.size, dtype=bool)
    keys = [k for k, e in zip(bound["keys"], exported.tolist(), strict=True) if e]
    return pos[exported].astype(np.int64), keys


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


# -- import --------------------------------------------------------------------------------------
def import_rows(
    ctl: Controller,
    partition: str,
    groups: np.ndarray,
    versions: np.ndarray,
    lengths: np.ndarray,
    *,
    first: bool,
    keys: Sequence[str] = (),
    key_rows: np.ndarray | None = None,
) -> BatchMeta:
    """New committed rows with these headers in ``partition``, no field ready yet. ``first``:
    the partition must be new (else :class:`PartitionExistsError`) and becomes *loading*;
    later calls add rows to a partition that is loading. ``keys``: string keys of the rows
    at positions ``key_rows`` (checked before any row is made)."""
    part = ctl._partitions.get(partition)
    if first:
        if part is not None and (part.rows_live or part.tasks or part.declared is not None):
            raise PartitionExistsError(
                f"partition {partition!r} already exists in this store ({part.rows_live} rows, "
                f"tasks {sorted(part.tasks)}); load into a new (or reset) store, or clear "
                "and reset the partition's tasks first"
            )
    elif part is None or not part.loading:
        raise BadRequestError(f"partition {partition!r} is not being loaded; start with first")
    n = int(groups.size)
    if versions.size != n or lengths.size != n:
        raise BadRequestError("import_rows: groups, versions and lengths need one value per row")
    key_pos = np.empty(0, dtype=np.int64) if key_rows is None else np.asarray(key_rows)
    if key_pos.shape != (len(keys),) or (
        key_pos.size and not 0 <= key_pos.min() <= key_pos.max() < n
    ):
        raise BadRequestError(
            f"import_rows: {len(keys)} keys need as many positions among the {n} rows, got "
            f"key_rows of shape {key_pos.shape}"
        )
    if keys:
        ctl.check_new_keys(partition, list(keys))
    meta = ctl.allocate(n, partition, groups=groups, versions=versions, lengths=lengths)
    ctl.partition(partition).loading = True
    # Committed now, so that the reclaim of abandoned puts never takes rows a long load holds.
    ctl._h["committed"][ctl._slots(meta.indexes)] = True
    if keys:
        ctl.restore_keys(partition, list(keys), meta.indexes[key_pos])
    return meta


def import_tasks(
    ctl: Controller,
    partition: str,
    tasks: Sequence[TaskImport],
    declared: list[str] | None,
    finished: bool,
) -> Changes:
    """Create the tasks of a loading partition (their consumed rows done, their queues in the
    given order), declare its tasks, mark it finished as saved, and open it to consumers."""
    part = ctl._partitions.get(partition)
    if part is None or not part.loading:
        raise BadRequestError(f"partition {partition!r} is not being loaded; import_rows first")
    if part.tasks:
        raise BadRequestError(f"partition {partition!r} got tasks while it loaded")
    live = ctl._live_slots(part)
    for t in tasks:
        for rows in (t.consumed, t.queue, *t.leases):
            ctl._slots(rows)  # (rows that are not the partition's live rows: an error)
        get_sampler(t.sampler)  # (an unknown sampler: an error before anything changes)
    changes = Changes()
    for t in tasks:
        for f in t.fields:
            ctl._ready_of(f)
        task = TaskState(
            (part.id, t.name),
            tuple(t.fields),
            get_sampler(t.sampler)(ctl, **t.options),
            t.sampler,
            dict(t.options),
            ctl._alloc.capacity,
        )
        part.tasks[t.name] = task
        done = ctl._slots(t.consumed)
        task.state[done] = DONE
        task.done = int(done.size)
        # The saved queue first, in its order; then the rows leased at save time, given
        # back as an expired lease gives them back; then ready rows none names, by index.
        ctl._enqueue_ready(task, ctl._slots(t.queue))
        for rows in t.leases:
            back = ctl._slots(rows)
            back = back[task.state[back] == WAITING]
            task.state[back] = QUEUED
            task.sampler.add(ctl._h["index"][back], returned=True)
        ctl._enqueue_ready(task, live)
        changes.woken.add(task.key)
    part.loading = False
    if declared is not None:
        ctl.declare_tasks(partition, declared)
    part.finished = finished
    return changes


def check_not_loading(ctl: Controller, partition: str) -> None:
    """Raise when ``partition`` is being loaded (a put or get_meta must wait for the load)."""
    part: PartitionState | None = ctl._partitions.get(partition)
    if part is not None and part.loading:
        raise BadRequestError(
            f"partition {partition!r} is being loaded from a save; consume or put into it "
            "once the load has finished"
        )


def end_loading(ctl: Controller, partition: str | None) -> None:
    """A cleared partition (all if None) is no longer loading: a load that failed half way
    leaves it so until then."""
    for part in ctl._partitions.values():
        if partition is None or part.name == partition:
            part.loading = False


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
