"""``StorageUnit``: one shard of payload, stored as real columns.

A unit knows rows only by global index and fields only by name; it never sees leases, tasks
or readiness (that is the controller's job). Layout::

    SlotMap         global index -> slot
    ExtentAllocator free slots, contiguous ranges preferred
    columns         {field: [DenseColumn | RaggedColumn | ObjectColumn]}, all indexed by slot

A field has one column per spec it holds rows of: specs are fixed per partition, and a unit
holds rows of every partition, so ``x`` may be dense ``[2]`` in one partition and ``[3]`` in
another (a slot is written in at most one of them). A column left without rows is dropped
when another spec of its field arrives, so a cleared partition's old spec keeps no memory.

Writes are all-or-nothing: every column is checked against its spec, every row is looked up
and the capacity is checked before the first byte is copied, so a bad write leaves what is
stored intact. Growth beyond what a write needs is bounded in bytes (``GROW_SLACK_BYTES``),
so a field of huge rows never makes a small write allocate dozens of them; a read names each
row once, so its reply is never larger than what the unit holds.

This is a plain class with no locking and no I/O; deployments (embedded, ZeroMQ server, Ray
actor) wrap it and serialize access.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import CapacityError, SchemaError, UnknownFieldError, UnknownRowError
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec, column_rows
from transferqueue.shaped import Shaped
from transferqueue.slots import ExtentAllocator, SlotMap
from transferqueue.storage.columns import (
    AnyColumn,
    DenseColumn,
    RaggedColumn,
    make_column,
    write_column,
)

__all__ = ["GROW_SLACK_BYTES", "StorageUnit"]

GROW_SLACK_BYTES = 64 << 20
"""Dense bytes a unit may allocate beyond what a write needs (room for the next writes)."""


def _check_data(name: str, spec: FieldSpec, data: object) -> None:
    """The column's Python type, dtype and shape agree with its spec (clients normalize;
    this guards the unit against anything else arriving over the wire)."""
    if spec.kind == "dense":
        ok = (
            isinstance(data, torch.Tensor | ChunkedTensor)
            and data.dim() >= 1
            and data.dtype == spec.torch_dtype
            and tuple(data.shape[1:]) == spec.shape
        )
    elif spec.kind == "shaped":
        ok = isinstance(data, Shaped) and data.dtype == spec.torch_dtype and data.ndim == spec.ndim
    elif spec.kind == "ragged":
        ok = (
            isinstance(data, Ragged)
            and not isinstance(data, Shaped)
            and data.dtype == spec.torch_dtype
            and data.inner_shape == spec.shape
        )
    else:
        ok = isinstance(data, list)
    if not ok:
        got = type(data).__name__
        if isinstance(data, torch.Tensor | Ragged):
            got += f" {data.dtype} {list(data.shape) if isinstance(data, torch.Tensor) else ''}"
        raise SchemaError(f"field {name!r}: data does not match {spec.describe()} (got {got})")


class StorageUnit:
    """Payload of a shard of rows: write, read (gathered per field), free."""

    def __init__(self, unit_id: int = 0, *, capacity_bytes: int | None = None) -> None:
        self.unit_id = unit_id
        self.capacity_bytes = capacity_bytes
        self._map = SlotMap()
        self._alloc = ExtentAllocator(0)
        self._columns: dict[str, list[AnyColumn]] = {}  # (one per spec: see the module)
        self._writes = 0
        self._reads = 0
        # Slots whose bytes a server is still sending (zero-copy views): freeing them is
        # deferred until the send is done, so their memory is not reused under the send.
        self._pins: dict[int, np.ndarray] = {}
        self._pinned = np.zeros(0, dtype=np.int32)
        self._deferred: list[np.ndarray] = []
        self._next_pin = 1

    # -- writes ------------------------------------------------------------------------------
    def write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool = False,
        adopt: bool = False,
    ) -> None:
        """Store ``columns`` for rows ``indexes`` (row k of every column belongs to indexes[k]).

        ``create=True`` makes absent rows (a put of new rows); otherwise every row must exist
        already (fields added to rows another producer created). ``adopt=True`` lets ragged
        columns keep the given buffers instead of copying them (the wire path: frames it owns).
        """
        indexes = np.asarray(indexes, dtype=np.int64)
        n = indexes.size
        for name, data in columns.items():
            spec = specs.get(name)
            if spec is None:
                raise SchemaError(f"field {name!r}: no spec given with the write")
            _check_data(name, spec, data)
            if column_rows(data) != n:
                raise SchemaError(f"field {name!r} has {column_rows(data)} rows for {n} indexes")
        slots = self._map.lookup(indexes)
        absent = slots < 0
        if absent.any() and not create:
            rows = indexes[absent][:5].tolist()
            raise UnknownRowError(
                f"rows {rows} are not stored in unit {self.unit_id} (never written, freed or "
                "cleared); fields can only be added to live rows"
            )
        if np.unique(indexes).size != n:
            raise SchemaError("a write names the same row twice")
        new_idx = indexes[absent]
        grow_to = self._capacity_needed(new_idx.size, columns, specs)
        # -- nothing has changed so far; from here on the write cannot fail on bad input --
        if grow_to:
            self._grow(grow_to)
        if new_idx.size:
            new_slots = self._alloc.allocate(int(new_idx.size))
            assert new_slots is not None
            self._map.insert(new_idx, new_slots)
            slots[absent] = new_slots
        for name, data in columns.items():
            write_column(self._column_for(name, specs[name], slots), slots, data, adopt=adopt)
        self._writes += 1

    def _column_for(self, name: str, spec: FieldSpec, slots: np.ndarray) -> AnyColumn:
        """The column of ``name`` holding ``spec``, made if new; ``slots`` leave the field's
        other columns, and those left without rows are dropped."""
        cols = self._columns.setdefault(name, [])
        col = next((c for c in cols if c.spec == spec), None)
        if col is None:
            col = make_column(name, spec, self._alloc.capacity)
            cols.append(col)
        if len(cols) > 1:
            for other in cols:
                if other is not col:
                    other.free(slots[other.written[slots]])
            cols[:] = [c for c in cols if c is col or c.written.any()]
        return col

    def _capacity_needed(
        self, new_rows: int, columns: Mapping[str, Column], specs: Mapping[str, FieldSpec]
    ) -> int:
        """Slot capacity to grow to (0: none), after checking the byte budget."""
        free = self._alloc.free_count
        target = 0
        if new_rows > free:
            cap = self._alloc.capacity
            slack = max(cap // 2, 64)
            row_bytes = self._dense_bytes(1, specs)
            if row_bytes:  # room for later writes, bounded in bytes
                slack = min(slack, max(1, GROW_SLACK_BYTES // row_bytes))
            target = cap + max(new_rows - free, slack)
        if self.capacity_bytes is not None:
            cap_after = max(target, self._alloc.capacity)
            added = self._dense_bytes(cap_after, specs) - self._dense_bytes(
                self._alloc.capacity, {}
            )
            ragged = sum(d.nbytes for d in columns.values() if isinstance(d, Ragged))
            if self.nbytes + max(added, 0) + ragged > self.capacity_bytes:
                raise CapacityError(
                    f"unit {self.unit_id} holds {self.nbytes} bytes; this write needs "
                    f"{max(added, 0) + ragged} more, capacity_bytes is {self.capacity_bytes}. "
                    "Raise capacity_bytes or let consumers acknowledge rows so they are freed"
                )
        return target

    def _dense_bytes(self, capacity: int, specs: Mapping[str, FieldSpec]) -> int:
        """Bytes of the dense columns at ``capacity`` slots, with those ``specs`` would add."""
        held = [c.spec for cols in self._columns.values() for c in cols]
        new = [s for n, s in specs.items() if all(c.spec != s for c in self._columns.get(n, ()))]
        return capacity * sum(s.row_nbytes for s in held + new if s.kind == "dense")

    def _all_columns(self) -> list[AnyColumn]:
        return [c for cols in self._columns.values() for c in cols]

    def _grow(self, capacity: int) -> None:
        self._alloc.grow(capacity)
        for col in self._all_columns():
            col.grow(capacity)

    # -- reads -------------------------------------------------------------------------------
    def read(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
        *,
        share: bool = False,
        pin: list[int] | None = None,
    ) -> dict[str, Column]:
        """Gather ``fields`` of rows ``indexes`` in that order: one buffer per field.

        ``out`` may give preallocated dense destinations (the embedded client passes views of
        the final batch so the gather is the only copy). ``share=True`` lets ragged columns
        return views of immutable stored segments (for a server that only sends the bytes).
        With ``pin`` (a list) also dense rows that are one run of a block come back as views;
        the slots stay pinned (their memory is not reused) until :meth:`unpin` of the id
        appended to ``pin``.
        """
        indexes = np.asarray(indexes, dtype=np.int64)
        slots = self._slots(indexes)
        ascending = indexes.size < 2 or bool((np.diff(indexes) > 0).all())
        if not ascending and np.unique(indexes).size != indexes.size:
            raise SchemaError("a read names the same row twice")
        cols = [self._column_of(name, slots, indexes) for name in fields]
        result: dict[str, Column] = {}
        pinned = False
        for name, col in zip(fields, cols, strict=True):
            if isinstance(col, list):
                result[name] = _read_widened(col, slots)
            elif isinstance(col, DenseColumn):
                view = col.view(slots) if pin is not None else None
                if view is not None:
                    result[name] = view
                    pinned = True
                else:
                    dst = None if out is None else out.get(name)
                    if dst is not None and (
                        dst.dtype != col.spec.torch_dtype or tuple(dst.shape[1:]) != col.spec.shape
                    ):
                        dst = None  # (the reader's spec is stale: it learns so from the result)
                    result[name] = col.read(slots, dst)
            elif isinstance(col, RaggedColumn):
                result[name] = col.read(slots, share=share)
            else:
                result[name] = col.read(slots)
        if pinned and pin is not None:
            pin.append(self._pin(slots))
        self._reads += 1
        return result

    def _column_of(
        self, name: str, slots: np.ndarray, indexes: np.ndarray
    ) -> AnyColumn | list[AnyColumn]:
        """The column of ``name`` that holds every row of ``slots``; or, for rows of a field
        widened from dense to shaped (some rows written before, some after), the columns that
        hold them, dense and shaped (:func:`_read_widened`)."""
        cols = self._columns.get(name)
        if not cols:
            raise UnknownFieldError(
                f"field {name!r} is not stored in unit {self.unit_id}; "
                f"stored fields: {sorted(self._columns)}"
            )
        if len(cols) > 1:
            counts = [int(c.written[slots].sum()) for c in cols]
            best = int(np.argmax(counts))
            if 0 < counts[best] < slots.size and sum(counts) == slots.size:
                held = [c for c, k in zip(cols, counts, strict=True) if k]
                if _widened(held):
                    return held
                raise SchemaError(
                    f"field {name!r}: the rows read hold it with different specs "
                    f"({', '.join(c.spec.describe() for c in cols)}): rows of different "
                    "partitions; read each partition's rows apart"
                )
            cols = [cols[best]]
        cols[0].check_written(slots, indexes)
        return cols[0]

    def _pin(self, slots: np.ndarray) -> int:
        if self._pinned.size < self._alloc.capacity:
            grown = np.zeros(self._alloc.capacity, dtype=np.int32)
            grown[: self._pinned.size] = self._pinned
            self._pinned = grown
        self._pinned[slots] += 1
        pid = self._next_pin
        self._next_pin += 1
        self._pins[pid] = slots
        return pid

    def _busy(self, slots: np.ndarray) -> np.ndarray:
        """Which slots a pinned read is still sending (slots past the pin table, added since
        the table last grew, are not)."""
        busy = np.zeros(slots.size, dtype=bool)
        if self._pins:
            inside = slots < self._pinned.size
            busy[inside] = self._pinned[slots[inside]] > 0
        return busy

    def unpin(self, pin_id: int) -> None:
        """The send of a pinned read is done: its slots may be reused once freed."""
        slots = self._pins.pop(pin_id, None)
        if slots is None:
            return
        self._pinned[slots] -= 1
        if self._deferred:
            waiting = np.concatenate(self._deferred)
            ready = self._pinned[waiting] == 0
            if ready.any():
                self._alloc.free(waiting[ready])
            self._deferred = [waiting[~ready]] if not ready.all() else []

    def _slots(self, indexes: np.ndarray) -> np.ndarray:
        slots = self._map.lookup(indexes)
        if (slots < 0).any():
            rows = indexes[slots < 0][:5].tolist()
            raise UnknownRowError(
                f"rows {rows} are not stored in unit {self.unit_id} (freed after every "
                "declared task acknowledged them, cleared, or never written)"
            )
        return slots

    # -- lifecycle ---------------------------------------------------------------------------
    def free(self, indexes: np.ndarray) -> int:
        """Drop rows (absent ones are ignored); their slots and memory are reused."""
        indexes = np.asarray(indexes, dtype=np.int64)
        slots = self._map.lookup(indexes)
        keep = slots >= 0
        slots, indexes = slots[keep], indexes[keep]
        if slots.size:
            for cols in self._columns.values():
                for col in cols:
                    col.free(slots)
                if len(cols) > 1:  # (a spec no row holds any more keeps no memory)
                    cols[:] = [c for c in cols if c.written.any()] or cols[:1]
            self._map.remove(indexes)
            busy = self._busy(slots)
            self._alloc.free(slots[~busy])
            if busy.any():
                self._deferred.append(slots[busy])
        return int(slots.size)

    def indexes(self) -> np.ndarray:
        """The rows this unit holds, ascending (a restarted controller's inventory)."""
        return self._map.keys()

    def clear(self) -> None:
        """Drop every row; columns keep their memory for reuse."""
        for col in self._all_columns():
            col.free(np.flatnonzero(col.written))
        self._map.clear()
        self._alloc.reset()
        if self._pins:  # slots still being sent stay out of the free ranges until sent
            busy = np.flatnonzero(self._pinned > 0)
            self._alloc.reserve(busy)
            self._deferred = [busy]

    def reset(self) -> None:
        """Forget every row and every field (columns and their memory are dropped; views
        still being sent keep their old buffers alive until sent)."""
        self._map = SlotMap()
        self._alloc = ExtentAllocator(0)
        self._columns = {}
        self._pins, self._deferred = {}, []
        self._pinned = np.zeros(0, dtype=np.int32)

    @property
    def rows(self) -> int:
        return len(self._map)

    @property
    def nbytes(self) -> int:
        """Bytes held by columns (dense: allocated blocks; ragged: live segments)."""
        return sum(c.nbytes for c in self._all_columns())

    def stats(self) -> dict[str, Any]:
        return {
            "unit": self.unit_id,
            "rows": self.rows,
            "slot_capacity": self._alloc.capacity,
            "bytes": self.nbytes,
            "capacity_bytes": self.capacity_bytes,
            "fields": {
                n: " | ".join(c.spec.describe() for c in cols) for n, cols in self._columns.items()
            },
            "writes": self._writes,
            "reads": self._reads,
        }


def _widened(cols: list[AnyColumn]) -> bool:
    """Whether ``cols`` are one shaped column and dense ones its spec widened (the rows of one
    partition's field, written before and after it became shaped)."""
    shaped = [c.spec for c in cols if c.spec.kind == "shaped"]
    return len(shaped) == 1 and all(
        c.spec.widened_by(shaped[0]) is not None for c in cols if c.spec.kind != "shaped"
    )


def _read_widened(cols: list[AnyColumn], slots: np.ndarray) -> Shaped:
    """Rows of ``slots`` gathered from a shaped column and the dense columns it widened, as
    one Shaped in the order of ``slots`` (each column read once; the rows then copied once
    into place: a read that spans the widening, not the common path)."""
    n = slots.size
    parts: list[tuple[np.ndarray, Shaped]] = []
    for col in cols:
        pos = np.flatnonzero(col.written[slots])
        got = col.read(slots[pos])
        if not isinstance(got, Shaped):
            assert isinstance(got, torch.Tensor)  # (_widened: dense columns and one shaped)
            got = Shaped.from_dense(got)
        parts.append((pos, got))
    ndim = next(p.ndim for _, p in parts)
    lengths = np.zeros(n, dtype=np.int64)
    shapes = torch.empty((n, ndim), dtype=torch.int64)
    for pos, part in parts:
        lengths[pos] = part.lengths.numpy()
        shapes[torch.from_numpy(pos)] = part.shapes
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = torch.empty(int(offsets[-1]), dtype=parts[0][1].dtype)
    for pos, part in parts:
        src = part.offsets.numpy().tolist()
        dst = offsets.tolist()
        for k, p in enumerate(pos.tolist()):
            values[dst[p] : dst[p + 1]] = part.values[src[k] : src[k + 1]]
    return Shaped(values, torch.from_numpy(offsets), shapes)
