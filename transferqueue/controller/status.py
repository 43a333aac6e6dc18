"""What a partition's rows hold and what each task made of them; per-row custom metadata.

A part of the controller core (:class:`~transferqueue.controller.core.Controller`):

- **status** (:meth:`RowStatus.status`): the live rows of a partition, for each asked field
  whether it is written (production status), and for a task each row's state
  (consumption status: ``waiting`` for fields, ``queued``, ``leased``, ``done``), as a
  :class:`PartitionStatus` of numpy arrays;
- **custom metadata** (:meth:`RowStatus.set_custom_meta`): a small msgpack map per row,
  without payload, kept by the controller (msgpack-encoded, at most ``MAX_META_BYTES`` a
  row, see :func:`~transferqueue.wire.checks.encode_meta`) until the row is freed, lost,
  discarded or cleared::

      custom   {row index: msgpack map}   only the rows that have one

Replaying a partition to a task (``reset_consumption``) is :mod:`transferqueue.controller.queues`'.
The client calls (``AsyncClient.status`` ...) send the message kinds ``status``,
``set_custom_meta`` and ``get_custom_meta`` (:mod:`transferqueue.wire.messages`);
:class:`ControllerService` answers them from here.
"""

from __future__ import annotations

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.rows import RowTable
from transferqueue.errors import BadRequestError, UnknownFieldError
from transferqueue.limits import MAX_META_REQUEST_BYTES
from transferqueue.wire.replies import WAITING, PartitionStatus

__all__ = ["RowStatus"]


class RowStatus:
    """Status queries and custom metadata (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, partitions: Partitions) -> None:
        self._rows = rows
        self._partitions = partitions
        # Row index -> msgpack map, for the rows that have one. Not a column like the header:
        # free-form and usually absent, so a per-slot column would cost every row for few.
        self._custom: dict[int, bytes] = {}
        self.custom_bytes = 0
        partitions.on_free.append(self._drop)

    @property
    def custom_rows(self) -> int:
        """Rows with custom metadata."""
        return len(self._custom)

    # -- status ------------------------------------------------------------------------------
    def status(
        self,
        partition: str,
        fields: list[str] | None = None,
        task: str | None = None,
        meta: bool = False,
    ) -> PartitionStatus:
        """The live rows of ``partition``, which of ``fields`` each has, and ``task``'s
        state of each (``meta``: the rows as a BatchMeta too, leasing nothing). Unknown names
        are errors listing the known ones."""
        part = self._partitions.known(partition)
        specs = self._rows.specs_of(partition)
        for name in fields or ():
            if name not in specs:
                raise UnknownFieldError(
                    f"field {name!r} was never written to partition {partition!r} (its fields: "
                    f"{sorted(specs)[:50]}); check the name"
                )
        t = None if task is None else self._partitions.known_task(part, task)
        slots = self._rows.live_slots(part.id)
        ready = {n: self._rows.ready[n][slots].copy() for n in dict.fromkeys(fields or ())}
        states = None
        if task is not None:
            states = np.full(slots.size, WAITING, np.uint8) if t is None else t.state[slots]
        index = self._rows.header["index"][slots].copy()
        rows = self._rows.meta(slots, part.name, fields=tuple(fields or ())) if meta else None
        return PartitionStatus(part.name, index, ready, task, states, rows)

    # -- custom metadata ---------------------------------------------------------------------
    @journaled
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
        self._rows.slots(indexes)  # (rows that are not live: UnknownRowError / RowsLostError)
        for i, raw in zip(indexes.tolist(), metas, strict=True):
            self.custom_bytes -= len(self._custom.pop(i, b""))
            if raw != b"\x80":  # (msgpack of {}: nothing to keep)
                self._custom[i] = raw
                self.custom_bytes += len(raw)

    def get_custom_meta(self, indexes: np.ndarray) -> list[bytes]:
        """The custom metadata of live rows (msgpack maps; ``{}`` for rows without)."""
        indexes = np.asarray(indexes, dtype=np.int64)
        self._rows.slots(indexes)
        out = [self._custom.get(i, b"\x80") for i in indexes.tolist()]
        total = sum(len(raw) for raw in out)
        if total > MAX_META_REQUEST_BYTES:
            raise BadRequestError(
                f"get_custom_meta: {indexes.size} rows hold {total} bytes of metadata, more "
                f"than MAX_META_REQUEST_BYTES={MAX_META_REQUEST_BYTES}; ask for fewer rows"
            )
        return out

    def custom_of(self, indexes: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """(positions among ``indexes``, their metadata) of the rows that have some."""
        pos = [k for k, i in enumerate(indexes.tolist()) if i in self._custom]
        return np.asarray(pos, dtype=np.int64), [self._custom[int(indexes[k])] for k in pos]

    def _drop(self, partition_id: int, indexes: np.ndarray) -> None:
        """Rows left (freed, lost, discarded, cleared): their metadata goes with them."""
        if self._custom:
            for i in indexes.tolist():
                self.custom_bytes -= len(self._custom.pop(i, b""))
