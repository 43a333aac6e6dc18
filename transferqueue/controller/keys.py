"""String keys for rows: the key-value interface's map, kept by the controller.

A part of the controller core (:class:`~transferqueue.controller.core.Controller`). A key
names one row of one partition; the rows are ordinary rows (the queue interface sees
them: tasks lease and acknowledge them exactly once through ``get_meta``/``ack``)::

    per partition   KeyMap   index_of {key: row index} | key_of {row index: key}

Two hash maps, not columns: keys are free-form strings, and only rows put through the
key-value calls have one, so a per-slot column would cost every row for few.

- **rows of keys** (:meth:`KeyedRows.key_rows`): the rows of keys in request order; an
  unknown key is an :class:`~transferqueue.errors.UnknownKeyError` naming it. With
  ``create``, keys without a row get new rows in one allocation (a ``kv_put``): the key is
  bound when its row is allocated, so two writers of one new key share one row;
- **delete** (:meth:`KeyedRows.delete_keys`): the rows of keys are freed on the units and
  leave every task's queue, as if they had never been put (``rows_put`` goes down, so a
  finished partition's streams still end). A row some task holds *leased* is never deleted:
  the whole call is refused with :class:`~transferqueue.errors.KeyLeasedError` (the task
  acknowledges or releases it, or its lease runs out, then delete again), so a consumer never
  finds the row of its lease gone;
- **list** (:meth:`KeyedRows.list_keys`): the keys of a partition in row order, with which
  fields each row has;
- **export / restore** (:meth:`KeyedRows.export_keys`, :meth:`KeyedRows.restore_keys`): the
  map as plain data (keys and int64 index arrays), and bound back onto live rows.

A key goes away with its row, whatever frees it: a delete, ``clear``, every declared task
acknowledging it, a unit dying with it, a put that failed before committing it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transferqueue.controller.journal import Recorder, journaled
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import Changes, header_column
from transferqueue.controller.writes import Writes
from transferqueue.errors import (
    BadRequestError,
    KeyLeasedError,
    UnknownFieldError,
    UnknownKeyError,
)
from transferqueue.wire.replies import DONE, LEASED, QUEUED, KeyListing, KeyRows

__all__ = ["KeyMap", "KeyedRows"]


class KeyMap:
    """The keys of one partition and their rows' indexes, both ways."""

    def __init__(self) -> None:
        self.index_of: dict[str, int] = {}
        self.key_of: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.index_of)

    def bind(self, keys: list[str], indexes: np.ndarray) -> None:
        for k, i in zip(keys, indexes.tolist(), strict=True):
            self.index_of[k] = i
            self.key_of[i] = k

    def drop(self, indexes: np.ndarray) -> None:
        for i in indexes.tolist():
            k = self.key_of.pop(i, None)
            if k is not None:
                del self.index_of[k]


class KeyedRows:
    """The key maps of the partitions and the calls on keys (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, partitions: Partitions, writes: Writes) -> None:
        self._rows = rows
        self._partitions = partitions
        self._writes = writes
        self._keys: dict[int, KeyMap] = {}  # by partition id
        partitions.on_free.append(self._drop)

    def count(self, partition_id: int) -> int:
        """The keys of a partition."""
        return len(self._keys.get(partition_id) or ())

    # -- lookups -----------------------------------------------------------------------------
    def _lookup(self, partition: str, keys: list[str]) -> np.ndarray:
        """Each key's row index, -1 where the key has none."""
        part = self._partitions.get(partition)
        km = None if part is None else self._keys.get(part.id)
        if not km:
            return np.full(len(keys), -1, dtype=np.int64)
        get = km.index_of.get
        return np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))

    def _unknown(self, partition: str, keys: list[str], found: np.ndarray) -> UnknownKeyError:
        missing = [keys[i] for i in np.flatnonzero(found < 0)[:10].tolist()]
        return UnknownKeyError(
            f"keys {missing} ({int((found < 0).sum())} of {len(keys)}) are not in partition "
            f"{partition!r}: never put, deleted, cleared, or freed with their row (every "
            "declared task acknowledged it, or its storage unit died). Put them first "
            "(kv_put); kv_list shows the keys there are"
        )

    def new_keys(self, partition: str, keys: list[str]) -> int:
        """How many of ``keys`` have no row yet; raises what no wait for capacity cures."""
        n = int((self._lookup(partition, keys) < 0).sum())
        if n:  # (updates of known keys go into a finished partition too)
            self._writes.check_allocate(n, partition)
        return n

    # -- rows of keys ------------------------------------------------------------------------
    @journaled
    def key_rows(
        self,
        partition: str,
        keys: list[str],
        *,
        create: bool = False,
        fields: list[str] | None = None,
        groups: np.ndarray | int | None = None,
        nbytes: int | None = None,
        producer: str | None = None,
    ) -> KeyRows:
        """The rows of ``keys`` (see the module). With ``create``, keys without a row get
        new rows in one allocation (``groups``: one per key, or one for all; ``nbytes``: the
        payload of all keys, shared out); otherwise an unknown key is an error, and so is a
        field of ``fields`` that a row has not written (no ``fields``: the reply names
        those every row has)."""
        found = self._lookup(partition, keys)
        missing = np.flatnonzero(found < 0)
        if missing.size and not create:
            raise self._unknown(partition, keys, found)
        if not create:
            slots = self._rows.slots(found)
            return KeyRows(
                self._rows.meta(slots, partition),
                missing,
                self._fields(partition, keys, slots, fields),
            )
        created = np.empty(0, dtype=np.int64)
        if missing.size:
            g = None if groups is None else header_column("group", groups, len(keys), default=-1)
            new = self._writes.allocate(
                int(missing.size),
                partition,
                groups=None if g is None else g[missing],
                nbytes=None if nbytes is None else nbytes * int(missing.size) // len(keys),
                producer=producer,
            )
            part = self._partitions.partition(partition)
            self._keys.setdefault(part.id, KeyMap()).bind(
                [keys[i] for i in missing.tolist()], new.indexes
            )
            found[missing] = new.indexes
            created = missing
        return KeyRows(self._rows.meta(self._rows.slots(found), partition), created)

    def _fields(
        self, partition: str, keys: list[str], slots: np.ndarray, fields: list[str] | None
    ) -> list[str]:
        """``fields``, checked: every row has them written; None: those every row has."""
        specs = self._rows.specs_of(partition)
        if fields is None:
            return [n for n, ready in self._rows.ready.items() if n in specs and ready[slots].all()]
        for name in fields:
            ready = self._rows.ready.get(name) if name in specs else None
            if ready is None:
                raise UnknownFieldError(
                    f"field {name!r} has never been written to partition {partition!r} "
                    f"(its fields: {sorted(specs)[:50]}); check the name"
                )
            lacking = np.flatnonzero(~ready[slots])
            if lacking.size:
                some = [keys[i] for i in lacking[:10].tolist()]
                raise UnknownFieldError(
                    f"keys {some} ({lacking.size} of {len(keys)}) of partition {partition!r} "
                    f"have no field {name!r} written; put it first, or ask for fields they "
                    "have (kv_list(fields=...) shows which)"
                )
        return fields

    # -- delete ------------------------------------------------------------------------------
    @journaled
    def delete_keys(self, partition: str, keys: list[str] | None = None) -> Changes:
        """Delete the rows of ``keys`` (None: every key of ``partition``; see the module):
        all or nothing; an unknown key is an :class:`UnknownKeyError`, a row a task holds
        leased a :class:`KeyLeasedError`."""
        if keys is None:
            listed = self.list_keys(partition)
            keys, found = listed.keys, listed.indexes
            if not keys:
                return Changes()
        else:
            found = self._lookup(partition, keys)
            if (found < 0).any():
                raise self._unknown(partition, keys, found)
        part = self._partitions.known(partition)
        slots = self._rows.slots(found)
        for task in part.tasks.values():
            leased = task.state[slots] == LEASED
            if leased.any():
                pos = np.flatnonzero(leased)
                some = [keys[i] for i in pos[:10].tolist()]
                raise KeyLeasedError(
                    f"keys {some} ({pos.size} of {len(keys)}) of partition {partition!r} are "
                    f"leased to task {task.key[1]!r} (lease {int(task.lease[slots[pos[0]]])}); "
                    "nothing was deleted. Delete them once the task acknowledges or releases "
                    "them, or its lease runs out"
                )
        requeue = []
        for task in part.tasks.values():
            state = task.state[slots]
            task.done -= int((state == DONE).sum())  # (as if never put: see rows_put below)
            task.dropped = min(task.dropped, task.done)
            if (state == QUEUED).any():
                requeue.append(task)
        changes = Changes()
        self._partitions.free(part, slots, changes)  # (drops the keys too: _drop)
        n = int(slots.size)
        part.rows_put -= n
        part.rows_freed -= n
        self._partitions.requeue(part, requeue)  # (without the deleted rows)
        changes.woken |= {t.key for t in part.tasks.values()}  # (a drained stream may end)
        return changes

    def _drop(self, partition_id: int, indexes: np.ndarray) -> None:
        """Rows left (freed, lost, discarded, cleared, deleted): their keys go with them."""
        km = self._keys.get(partition_id)
        if km:
            km.drop(indexes)

    # -- list --------------------------------------------------------------------------------
    def list_keys(
        self, partition: str, fields: list[str] | None = None, all_fields: bool = False
    ) -> KeyListing:
        """The keys of ``partition`` in row order; per field of ``fields`` (every registered
        field with ``all_fields``, those no key's row has left out) which rows have it."""
        part = self._partitions.get(partition)
        km = None if part is None else self._keys.get(part.id)
        names = list(dict.fromkeys(fields or ()))
        specs = self._rows.specs_of(partition)
        for name in names:
            if name not in specs:
                raise BadRequestError(
                    f"kv_list: field {name!r} was never written to partition {partition!r} "
                    "(its fields: "
                    f"{sorted(specs)[:50]}); check the name"
                )
        if not km:
            empty = np.empty(0, dtype=np.int64)
            return KeyListing(partition, [], empty, {n: empty.astype(bool) for n in names})
        indexes = np.fromiter(km.key_of, dtype=np.int64, count=len(km))
        indexes.sort()
        keys = [km.key_of[i] for i in indexes.tolist()]
        slots = self._rows.slots(indexes)
        ready_of = self._rows.ready
        if all_fields:
            names += [n for n in specs if n not in names and ready_of[n][slots].any()]
        ready = {n: ready_of[n][slots].copy() for n in names}
        return KeyListing(partition, keys, indexes, ready)

    # -- export / restore (checkpoints of partitions) ----------------------------------------
    def export_keys(self, partition: str | None = None) -> dict[str, dict[str, Any]]:
        """The key map as plain data: ``{partition: {"keys": [str], "indexes": int64
        array}}``, in row order, for every partition with keys (or just ``partition``)."""
        out: dict[str, dict[str, Any]] = {}
        for part in self._partitions:
            km = self._keys.get(part.id)
            name = part.name
            if km and (partition is None or name == partition):
                indexes = np.fromiter(km.key_of, dtype=np.int64, count=len(km))
                indexes.sort()
                out[name] = {"keys": [km.key_of[i] for i in indexes.tolist()], "indexes": indexes}
        return out

    @journaled
    def restore_keys(self, partition: str, keys: list[str], indexes: np.ndarray) -> None:
        """Bind ``keys`` to live rows ``indexes`` of ``partition`` (what :meth:`export_keys`
        gave, with indexes mapped to the rows as restored). Everything is checked first: the
        rows live in the partition, neither the keys nor the rows have a key yet."""
        indexes = np.asarray(indexes, dtype=np.int64)
        if indexes.shape != (len(keys),):
            raise BadRequestError(
                f"restore_keys: {len(keys)} keys need as many indexes, got shape {indexes.shape}"
            )
        self.check_new_keys(partition, keys)
        part = self._partitions.get(partition)
        slots = self._rows.slots(indexes)
        if part is None or (self._rows.header["partition"][slots] != part.id).any():
            raise BadRequestError(f"restore_keys: rows not all in partition {partition!r}")
        km = self._keys.setdefault(part.id, KeyMap())
        if any(i in km.key_of for i in indexes.tolist()):
            raise BadRequestError(
                f"restore_keys: rows already have a key in partition {partition!r}; restore "
                "into a cleared partition"
            )
        km.bind(keys, indexes)

    def check_new_keys(self, partition: str, keys: list[str]) -> None:
        """Raise unless ``keys`` are distinct and none is bound in ``partition`` yet."""
        if len(set(keys)) != len(keys):
            raise BadRequestError(f"restore_keys: {len(keys)} keys, not all distinct")
        part = self._partitions.get(partition)
        km = None if part is None else self._keys.get(part.id)
        taken = [] if km is None else [k for k in keys if k in km.index_of][:10]
        if taken:
            raise BadRequestError(
                f"restore_keys: keys {taken} already have a row in partition {partition!r}; "
                "restore into a cleared partition"
            )
