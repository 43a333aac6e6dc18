"""``RowTable``: the controller's rows, one slot each, as columns (never an object per row).

::

    header   index int64 | partition int16 | unit int32 | replica int32 | group int64 |
             version int64 | length int64 | done int16 (declared tasks done) | live bool |
             nbytes int64 | committed bool | copying int64      (see state.HEADER)
    ready    {field: bool[capacity]}        which fields of each row are written
    specs    {partition: {field: FieldSpec}} every registered field, per partition name
    map      row index -> slot (SlotMap); free slots in extents (ExtentAllocator)

Rows are added and removed here; what they mean to the partitions and tasks is
:mod:`transferqueue.controller.partitions`'. The table also remembers the indexes of rows that
left by loss (:class:`GoneRows`: lost with a unit, reclaimed, retired), so that a late commit
or read learns that its rows were lost, not that they never existed. It is the header view
samplers read (:class:`~transferqueue.controller.samplers.HeaderView`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.state import HEADER, TaskState
from transferqueue.errors import CapacityError, RowsLostError, SchemaError, UnknownRowError
from transferqueue.limits import MAX_FIELDS
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.slots import ExtentAllocator, SlotMap

__all__ = ["LOST_MEMORY", "GoneRows", "RowTable"]

LOST_MEMORY = 1 << 22
"""Lost or reclaimed row indexes remembered for error messages (the oldest are forgotten)."""


class GoneRows:
    """The indexes of rows that left by loss, the most recent ``LOST_MEMORY`` of them."""

    def __init__(self) -> None:
        self._pages: deque[np.ndarray] = deque()  # oldest first
        self._rows = 0
        self._sorted: np.ndarray | None = None  # all of them, sorted (built on demand)

    def __bool__(self) -> bool:
        return bool(self._pages)

    def remember(self, indexes: np.ndarray) -> None:
        self._pages.append(indexes.copy())
        self._rows += int(indexes.size)
        while self._rows > LOST_MEMORY and len(self._pages) > 1:
            self._rows -= int(self._pages.popleft().size)
        self._sorted = None

    def among(self, indexes: np.ndarray) -> np.ndarray:
        """Those of ``indexes`` remembered as gone."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if not self._pages or indexes.size == 0:
            return np.empty(0, dtype=np.int64)
        if self._sorted is None:
            self._sorted = np.sort(np.concatenate(self._pages))
        gone = self._sorted
        pos = np.clip(np.searchsorted(gone, indexes), 0, gone.size - 1)
        return indexes[gone[pos] == indexes]


def _holds_rows(partition: str) -> bool:
    """(Without partitions to ask: every partition may hold rows, so specs never change.)"""
    return True


class RowTable:
    """The rows' header columns, ready bits and slots (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, *, replicas: int = 1, allocation_s: float = 120.0) -> None:
        self.map = SlotMap()
        self._alloc = ExtentAllocator(0)
        self.header: dict[str, np.ndarray] = {
            k: np.full(0, fill, dtype=dt) for k, (dt, fill) in HEADER.items()
        }
        self.ready: dict[str, np.ndarray] = {}
        # Specs are per partition (its rows share them; another partition may hold the same
        # name with another spec). ``has_rows`` tells whether a partition holds rows (set by
        # the controller): one that holds none takes a new spec in place of its old ones.
        self.specs: dict[str, dict[str, FieldSpec]] = {}
        self.has_rows: Callable[[str], bool] = _holds_rows
        self.next_index = 0  # the index of the next row added
        self.live = 0  # rows in the table
        self.gone = GoneRows()
        self.replicas = replicas  # (2: rows have a second copy, header "replica")
        self.allocation_s = allocation_s  # (named in the error of a row reclaimed)

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def free_count(self) -> int:
        return self._alloc.free_count

    # -- fields ------------------------------------------------------------------------------
    @journaled
    def register_fields(
        self, specs: Mapping[str, FieldSpec], partition: str = "default"
    ) -> dict[str, FieldSpec]:
        """Register fields of ``partition``; a spec that disagrees with one registered there
        is an error, unless the partition holds no rows (cleared, or every row freed): then
        it forgets its old specs and takes the new ones. A shaped spec of a field held dense
        with the same dtype and number of axes widens it (:meth:`FieldSpec.widened_by`): the
        field is shaped from then on, its stored rows read back as shaped rows."""
        if len(set(self.ready) | set(specs)) > MAX_FIELDS:
            raise CapacityError(f"this controller keeps at most {MAX_FIELDS} fields")
        known = self.specs.get(partition, {})
        widened = {
            n: s for n, s in specs.items() if n in known and known[n].widened_by(s) is not None
        }
        if widened and self.has_rows(partition):
            known = self.specs[partition] = {**known, **widened}
        clash = [n for n, s in specs.items() if n in known and known[n] != s]
        if clash and self.has_rows(partition):
            name = clash[0]
            have, got = known[name], specs[name]
            shaped = (
                FieldSpec.shaped(got.dtype, len(got.shape))
                if got.dtype is not None and got.shape
                else None
            )
            hint = (
                "; or, for rows whose shape varies, write them as a transferqueue.Shaped "
                "column (or declare FieldSpec.shaped): the field then holds rows of any shape"
                if got.kind == "dense" and shaped is not None and have.widened_by(shaped)
                else ""
            )
            raise SchemaError(
                f"field {name!r} of partition {partition!r}: expected "
                f"{have.describe()}, received {got.describe()}; convert the "
                "column, write it under a new field name or to another partition, or clear "
                f"the partition first{hint}"
            )
        if clash:
            known = {}  # (an empty partition forgets its specs)
        for name in specs:
            self.ready_of(name)
        mine = self.specs[partition] = {**dict(specs), **known}
        return {n: mine[n] for n in specs}

    def confirm_fields(self, specs: Mapping[str, FieldSpec], partition: str) -> None:
        """Fields of ``partition``'s rows were written with ``specs`` (a commit): each must be
        the partition's spec, so a writer whose cache of specs predates a clear and another
        spec is refused before its rows are seen; fields the partition forgot meanwhile (a
        clear during the put) are registered again."""
        known = self.specs_of(partition)
        for name, spec in specs.items():
            have = known.get(name)
            # (dense rows of a field widened to shaped meanwhile are rows of it: accepted)
            if have is not None and have != spec and spec.widened_by(have) != have:
                raise SchemaError(
                    f"field {name!r} of partition {partition!r}: expected {have.describe()}, "
                    f"received {spec.describe()}; the partition took this spec after the "
                    "writer learnt another (cleared, then written): convert the column, or "
                    "write it under a new field name or to another partition"
                )
        missing = {n: s for n, s in specs.items() if n not in known}
        if missing:
            self.register_fields(missing, partition)

    def specs_of(self, partition: str) -> dict[str, FieldSpec]:
        """The registered specs of ``partition`` (empty for one with none)."""
        return self.specs.get(partition, {})

    def field_names(self) -> set[str]:
        """Every field registered in any partition."""
        return {n for specs in self.specs.values() for n in specs}

    def forget_specs(self, partition: str) -> None:
        """``partition`` was cleared: its fields may come back with other specs."""
        self.specs.pop(partition, None)

    def ready_of(self, name: str) -> np.ndarray:
        """The ready bits of field ``name`` (made, all False, for a name not seen yet)."""
        arr = self.ready.get(name)
        if arr is None:
            if len(self.ready) >= MAX_FIELDS:  # (a bitmap per field name: bounded)
                raise CapacityError(f"this controller keeps at most {MAX_FIELDS} fields")
            arr = self.ready[name] = np.zeros(self._alloc.capacity, dtype=bool)
        return arr

    # -- the header view of samplers ---------------------------------------------------------
    def groups(self, indexes: np.ndarray) -> np.ndarray:
        return self.header["group"][self.slots(indexes)]

    def versions(self, indexes: np.ndarray) -> np.ndarray:
        return self.header["version"][self.slots(indexes)]

    def lengths(self, indexes: np.ndarray) -> np.ndarray:
        return self.header["length"][self.slots(indexes)]

    # -- slots -------------------------------------------------------------------------------
    def slots(self, indexes: np.ndarray) -> np.ndarray:
        """The slots of live rows; rows not in the table are an error saying why."""
        slots = self.map.lookup(indexes)
        if slots.size and slots.min() < 0:  # (one reduction: on every get_meta and ack)
            raise self.missing(indexes[slots < 0])  # (lost with a unit, or never there)
        return slots

    def lookup(self, indexes: np.ndarray) -> np.ndarray:
        """The slots of rows, -1 for those not in the table."""
        return self.map.lookup(np.asarray(indexes, dtype=np.int64))

    def live_slots(self, partition_id: int) -> np.ndarray:
        """The slots of a partition's rows, in index order."""
        h = self.header
        slots = np.flatnonzero(h["live"] & (h["partition"] == partition_id))
        return slots[np.argsort(h["index"][slots], kind="stable")]

    def meta(self, slots: np.ndarray, partition: str, **kwargs: Any) -> BatchMeta:
        """The rows in ``slots`` as a BatchMeta (``kwargs``: its other fields)."""
        h = self.header
        return BatchMeta.unchecked(  # (the header's columns have the dtypes it wants)
            h["index"][slots],
            h["unit"][slots],
            h["group"][slots],
            h["version"][slots],
            h["length"][slots],
            partition=partition,
            replica_units=self.copies(slots),
            **kwargs,
        )

    def copies(self, slots: np.ndarray) -> np.ndarray | None:
        """The units of the rows' second copies (for a BatchMeta); None with replicas=1."""
        return None if self.replicas == 1 else self.header["replica"][slots]

    # -- rows in, rows out -------------------------------------------------------------------
    def grow(self, capacity: int, tasks: Sequence[TaskState]) -> None:
        """Every per-slot array, the ``tasks``' included, grown to ``capacity``: all built
        first, then swapped in, so a MemoryError half way leaves every array as it was."""
        extra = capacity - self._alloc.capacity
        header = {
            k: np.concatenate([self.header[k], np.full(extra, fill, dtype=dt)])
            for k, (dt, fill) in HEADER.items()
        }
        ready = {n: np.concatenate([a, np.zeros(extra, dtype=bool)]) for n, a in self.ready.items()}
        grown = [t.grown(capacity) for t in tasks]
        self.header, self.ready = header, ready
        for task, arrays in zip(tasks, grown, strict=True):
            task.state, task.lease = arrays
        self._alloc.grow(capacity)

    def add(
        self,
        partition_id: int,
        units: np.ndarray,
        groups: np.ndarray | None,
        versions: np.ndarray,
        lengths: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """New live rows (one per unit of ``units``; ``groups`` None: each its own), with
        the next indexes. The caller grew the table to hold them. Returns (indexes, slots)."""
        n = int(units.size)
        slots = self._alloc.allocate(n)
        assert slots is not None  # (grown first)
        indexes = np.arange(self.next_index, self.next_index + n, dtype=np.int64)
        self.next_index += n
        self.map.insert(indexes, slots)
        h = self.header
        h["index"][slots] = indexes
        h["partition"][slots] = partition_id
        h["unit"][slots] = units
        h["group"][slots] = indexes if groups is None else groups
        h["version"][slots] = versions
        h["length"][slots] = lengths
        h["done"][slots] = 0
        h["live"][slots] = True
        self.live += n
        return indexes, slots

    def remove(self, slots: np.ndarray) -> np.ndarray:
        """Rows leave the table (their slots are free again); returns their indexes."""
        h = self.header
        indexes = h["index"][slots].copy()
        for arr in self.ready.values():
            arr[slots] = False
        for k, (_, fill) in HEADER.items():
            h[k][slots] = fill
        self.map.remove(indexes)
        self._alloc.free(slots)
        self.live -= int(slots.size)
        return indexes

    @journaled
    def advance_index(self, first: int) -> None:
        """New rows get indexes ``first`` or later (a unit holds rows up to ``first - 1``)."""
        self.next_index = max(self.next_index, int(first))

    # -- rows that left by loss --------------------------------------------------------------
    def lost(self, indexes: np.ndarray) -> np.ndarray:
        """Those of ``indexes`` that were lost (or reclaimed, retired), as far as remembered."""
        return self.gone.among(indexes)

    def without_lost(self, indexes: np.ndarray) -> np.ndarray:
        """``indexes`` less the lost ones (an ack of a batch that lost rows acks the rest)."""
        if not self.gone:
            return indexes
        lost = self.gone.among(indexes)
        return indexes if lost.size == 0 else indexes[~np.isin(indexes, lost)]

    def missing(self, indexes: np.ndarray) -> Exception:
        """The error for rows the table does not hold: lost, or never there."""
        lost = self.gone.among(indexes)
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
