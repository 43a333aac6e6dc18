"""What a partition's rows hold and what each task made of them; replays; per-row metadata.

A mixin of :class:`~transferqueue.controller.core.Controller` (kept apart, as
:mod:`transferqueue.controller.health` is, so that the controller module holds the row bookkeeping):

- **status** (:meth:`RowStatus.status`): the live rows of a partition, for each asked field
  whether it is written (production status), and for a task each row's state
  (consumption status: ``waiting`` for fields, ``queued``, ``leased``, ``done``), as a
  :class:`PartitionStatus` of numpy arrays;
- **reset_consumption** (:meth:`RowStatus.reset_consumption`): every live row of the
  partition the task has leased or consumed goes back to the task's queue. The task's open
  leases on the partition close first (``reset``), so a late ack or put of one gets
  :class:`~transferqueue.errors.UnknownLeaseError` and consumes nothing: each live row is
  delivered to the task once more, once. Rows already *freed* (every declared task
  acknowledged them) are gone and are not replayed; a partition keeps its rows for a replay
  while it has no declared tasks (rows stay until ``clear``) or while a declared task has
  not consumed them;
- **custom metadata** (:meth:`RowStatus.set_custom_meta`): a small msgpack map per row,
  without payload, kept by the controller (msgpack-encoded, at most ``MAX_META_BYTES`` a
  row, see :func:`~transferqueue.wire.checks.encode_meta`) until the row is freed, lost,
  discarded or cleared.

The client calls (``AsyncClient.status`` ...) send the message kinds ``status``,
``reset_consumption``, ``set_custom_meta`` and ``get_custom_meta``
(:mod:`transferqueue.wire.messages`); :class:`ControllerService` answers them from here.
"""

from __future__ import annotations

import numpy as np

from transferqueue.controller.leases import LeaseTable
from transferqueue.controller.state import Changes, PartitionState, TaskState
from transferqueue.errors import (
    BadRequestError,
    UnknownFieldError,
    UnknownTaskError,
)
from transferqueue.limits import MAX_META_REQUEST_BYTES
from transferqueue.schema import FieldSpec
from transferqueue.wire.replies import DONE, LEASED, QUEUED, WAITING, PartitionStatus

__all__ = ["RowStatus"]


class RowStatus:
    """Status queries, consumption resets and custom metadata; mixed into the Controller."""

    # (the Controller's state this mixin works on)
    leases: LeaseTable
    _h: dict[str, np.ndarray]
    _ready: dict[str, np.ndarray]
    _specs: dict[str, FieldSpec]
    _partitions: dict[str, PartitionState]

    def _init_status(self) -> None:
        # Row index -> msgpack map, for the rows that have one. Not a column like the header:
        # free-form and usually absent, so a per-slot column would cost every row for few.
        self._custom: dict[int, bytes] = {}
        self._custom_bytes = 0

    def _live_slots(self, part: PartitionState) -> np.ndarray:
        raise NotImplementedError  # (the Controller's)

    def _slots(self, indexes: np.ndarray) -> np.ndarray:
        raise NotImplementedError  # (the Controller's)

    def _enqueue_ready(self, task: TaskState, slots: np.ndarray) -> bool:
        raise NotImplementedError  # (the Controller's)

    # -- lookups that name what is known -----------------------------------------------------
    def _known_partition(self, name: str) -> PartitionState:
        part = self._partitions.get(name)
        if part is None:
            raise BadRequestError(
                f"partition {name!r} is unknown (known: {sorted(self._partitions)[:20]}); "
                "put rows into it or declare its tasks first"
            )
        return part

    def _known_task(self, part: PartitionState, name: str) -> TaskState | None:
        """The task's state; None for a declared task that has not asked for rows yet."""
        task = part.tasks.get(name)
        if task is None and (part.declared is None or name not in part.declared):
            known = sorted(set(part.tasks) | set(part.declared or ()))
            raise UnknownTaskError(
                f"task {name!r} has neither asked for rows of partition {part.name!r} nor "
                f"been declared for it (known tasks: {known}); check the name"
            )
        return task

    # -- status ------------------------------------------------------------------------------
    def status(
        self, partition: str, fields: list[str] | None = None, task: str | None = None
    ) -> PartitionStatus:
        """The live rows of ``partition``, which of ``fields`` each has, and ``task``'s
        state of each. Unknown names are errors listing the known ones."""
        part = self._known_partition(partition)
        for name in fields or ():
            if name not in self._specs:
                raise UnknownFieldError(
                    f"field {name!r} was never written (known fields: "
                    f"{sorted(self._specs)[:50]}); check the name"
                )
        t = None if task is None else self._known_task(part, task)
        slots = self._live_slots(part)
        ready = {n: self._ready[n][slots].copy() for n in dict.fromkeys(fields or ())}
        states = None
        if task is not None:
            states = np.full(slots.size, WAITING, np.uint8) if t is None else t.state[slots]
        return PartitionStatus(part.name, self._h["index"][slots].copy(), ready, task, states)

    # -- replay ------------------------------------------------------------------------------
    def reset_consumption(self, partition: str, task: str) -> tuple[int, Changes]:
        """Give every live row of ``partition`` that ``task`` leased or consumed back to the
        task's queue (see the module). Returns the number of rows given back."""
        part = self._known_partition(partition)
        t = self._known_task(part, task)
        if t is None:
            return 0, Changes()  # (a declared task that has not started: all is waiting)
        for lease in self.leases.of_partition(part.id):
            if lease.task == t.key:
                self.leases.close(lease, "reset")
        live = self._live_slots(part)
        state = t.state[live]
        back = live[(state == LEASED) | (state == DONE)]
        done = live[state == DONE]
        if part.declared is not None and task in part.declared:
            self._h["done"][done] -= 1  # (so a row is freed only once all tasks are done again)
        t.done -= int(done.size)
        t.dropped = min(t.dropped, t.done)  # (which rows were dropped is not kept per row)
        t.leased = 0  # (the task's leases are all on this partition: a task is per partition)
        t.lease[back] = -1
        # The queue is rebuilt in index order from every ready row, as after a unit loss:
        # rows given back join the queued ones (a group sampler sees whole groups again).
        requeue = live[(state == QUEUED) | (state == LEASED) | (state == DONE)]
        t.state[requeue] = WAITING
        t.sampler.clear()
        self._enqueue_ready(t, requeue)
        return int(back.size), Changes(woken={t.key})

    # -- custom metadata ---------------------------------------------------------------------
    def set_custom_meta(self, indexes: np.ndarray, metas: list[bytes]) -> None:
        """Attach custom metadata (msgpack maps, checked by
        :func:`~transferqueue.wire.checks.encode_meta`) to live rows; an
        empty map removes a row's. Everything is checked before anything is stored."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if len(metas) != indexes.size:
            raise BadRequestError(
                f"set_custom_meta: {indexes.size} indexes but {len(metas)} metas; give one "
                "dict per row"
            )
        self._slots(indexes)  # (rows that are not live: UnknownRowError / RowsLostError)
        for i, raw in zip(indexes.tolist(), metas, strict=True):
            self._custom_bytes -= len(self._custom.pop(i, b""))
            if raw != b"\x80":  # (msgpack of {}: nothing to keep)
                self._custom[i] = raw
                self._custom_bytes += len(raw)

    def get_custom_meta(self, indexes: np.ndarray) -> list[bytes]:
        """The custom metadata of live rows (msgpack maps; ``{}`` for rows without)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        self._slots(indexes)
        out = [self._custom.get(i, b"\x80") for i in indexes.tolist()]
        total = sum(len(raw) for raw in out)
        if total > MAX_META_REQUEST_BYTES:
            raise BadRequestError(
                f"get_custom_meta: {indexes.size} rows hold {total} bytes of metadata, more "
                f"than MAX_META_REQUEST_BYTES={MAX_META_REQUEST_BYTES}; ask for fewer rows"
            )
        return out

    def _drop_custom_meta(self, indexes: np.ndarray) -> None:
        """Rows left (freed, lost, discarded, cleared): their metadata goes with them."""
        if self._custom:
            for i in indexes.tolist():
                self._custom_bytes -= len(self._custom.pop(i, b""))
