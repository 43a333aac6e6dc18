"""The key-value calls of the client: rows named by string keys
(:mod:`transferqueue.controller.keys`).

``KeyValue`` is a part of :class:`~transferqueue.client.async_client.AsyncClient`, which (and the
blocking ``Client``) offers its calls; every call works unchanged over every deployment.

| call                           | what it does                                                 |
|--------------------------------|--------------------------------------------------------------|
| ``kv_put(key, row, tag=)``     | one key: ``row`` maps fields to one row's values             |
| ``kv_batch_put(keys, columns,``| one row per key; new keys get rows, existing ones are        |
| ``tags=)``                     | updated; ``tags`` only (no columns): keys without a field    |
| ``kv_get(key, fields)``        | one key: ``{field: that row's value}``                       |
| ``kv_batch_get(keys, fields)`` | columns of the keys' rows, in the keys' order (bit-exact)    |
| ``kv_meta(keys)``              | the keys' rows as a ``BatchMeta`` (no lease): ``get_data``,  |
|                                | ``set_custom_meta`` (per-key tags), ``status`` take it       |
| ``kv_list(partition, fields)`` | a ``KeyListing``: keys in row order, which fields each has   |
| ``kv_delete(keys)``            | delete keys and free their rows (all or nothing)             |
| ``kv_clear(partition)``        | delete every key of the partition                            |

**A put updates.** Putting a key that has a row writes the given fields into that row: those
fields are overwritten, the row's other fields stay. ``version``/``length`` update the
headers; ``group`` is set when a key's row is created. A key-value put acknowledges and
releases no lease: a task that holds the row leased keeps its lease (and reads whatever was
written last). Rows are ordinary rows: a consumer task gets each exactly once through
``get_meta``/``ack``; fields written after a task consumed a row do not hand it out again.

A put is one allocation for the new keys, then writes, then one commit: if it fails, the new
keys' rows are discarded (those keys stay unknown); fields already overwritten on existing
keys' rows may hold the new values, unseen by consumers that wait for fields they lacked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from transferqueue.client.links import ControllerLink, Read
from transferqueue.client.lost import lost_with_unit
from transferqueue.client.put import (
    Writer,
    encode_tags,
    header,
    payload_nbytes,
    take_rows,
    timeout_of,
)
from transferqueue.client.specs import Specs
from transferqueue.errors import BadRequestError, RowsLostError, SchemaError
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.schema import NUMERIC_KINDS, Column, FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.replies import KeyListing, KeyRows

__all__ = ["KeyValue"]


def _keys(keys: Sequence[str], where: str = "keys") -> list[str]:
    """A list of keys (checked on the message: see ``checks.KeyList``)."""
    if isinstance(keys, str):
        raise BadRequestError(f"{where}: expected a sequence of str keys, got the str {keys!r:.60}")
    return list(keys)


def _key(key: str) -> list[str]:
    if not isinstance(key, str):
        raise BadRequestError(f"key: expected a str, got {type(key).__name__} {key!r:.60}")
    return [key]


def _one_row(name: str, value: Any, known: FieldSpec | None) -> Any:
    """One row's value as a column of one row: a tensor is a row of a dense field (of a
    ragged one when the field is ragged), a Ragged must hold one row, anything else is an
    object value."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value) if value.dtype.kind in NUMERIC_KINDS else value.tolist()
    if isinstance(value, torch.Tensor):
        return (
            [value]
            if known is not None and known.kind in ("ragged", "shaped")
            else value.unsqueeze(0)
        )
    if isinstance(value, Ragged):
        if len(value) != 1:
            raise SchemaError(f"field {name!r}: kv_put takes one row, got a Ragged of {len(value)}")
        return value
    return [value]


def _row_of(col: Column) -> Any:
    return col[0]


class KeyValue:
    """``kv_put``, ``kv_batch_put``, ``kv_get``, ``kv_batch_get``, ``kv_meta``, ``kv_list``,
    ``kv_delete``, ``kv_clear``."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        specs: Specs,
        writer: Writer,
        read: Read,
    ) -> None:
        self._io = io
        self._ctl = controller
        self._specs = specs
        self._writer = writer
        self._read = read

    # -- writes ------------------------------------------------------------------------------
    async def kv_batch_put(
        self,
        keys: Sequence[str],
        data: Mapping[str, Any] | None = None,
        *,
        partition: str = "default",
        group: np.ndarray | Sequence[int] | int | None = None,
        version: np.ndarray | Sequence[int] | int | None = None,
        length: np.ndarray | Sequence[int] | int | None = None,
        specs: Mapping[str, FieldSpec] | None = None,
        timeout_s: float | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> BatchMeta:
        """Write one row per key: ``data`` holds columns as for ``put`` (row k is key k's).

        A new key gets a new row of ``partition`` (``group``: one per key, or one for all);
        a key that has a row gets the given fields overwritten and keeps its others (see
        :mod:`transferqueue.client.kv`). Keys: 1..``MAX_KEYS`` distinct non-empty str of at
        most ``MAX_KEY_CHARS`` characters (:mod:`transferqueue.limits`). ``timeout_s`` bounds
        the wait for capacity of new rows. Returns the keys' rows (no lease).

        ``tags``: one dict of msgpack values per key, set as the row's custom metadata
        (replacing what it had; ``get_custom_meta``, ``kv_list(tags=True)`` read it). Without
        ``data`` (None or empty) the put writes no field: new keys get rows that hold only
        their tags (and headers) and get their fields from a later put; no task is handed
        such a row before the fields it asks for are written.
        """
        msg_keys = _keys(keys)
        raw = None if tags is None else encode_tags(tags, len(msg_keys))
        return await self._io.run_async(
            self._kv_put(
                msg_keys, data or {}, partition, group, version, length, specs, timeout_s, raw
            )
        )

    async def kv_put(
        self,
        key: str,
        row: Mapping[str, Any] | None = None,
        *,
        partition: str = "default",
        group: int | None = None,
        version: int | None = None,
        length: int | None = None,
        specs: Mapping[str, FieldSpec] | None = None,
        timeout_s: float | None = None,
        tag: Mapping[str, Any] | None = None,
    ) -> BatchMeta:
        """Write one key's row: ``row`` maps fields to one row's values. A tensor is one row
        of a dense field (a 1-D tensor is a row of a ragged field when the field is ragged:
        registered, or given in ``specs``), a one-row ``Ragged`` a ragged row, anything else
        an object value. ``tag``: the row's custom metadata; with a tag and no ``row`` the
        key exists (made if new) with no field yet. Otherwise as :meth:`kv_batch_put`."""
        keys = _key(key)
        raw = None if tag is None else encode_tags([tag], 1)
        if row is None or (isinstance(row, Mapping) and not row and raw is not None):
            return await self._io.run_async(
                self._kv_put(keys, {}, partition, group, version, length, specs, timeout_s, raw)
            )
        if not isinstance(row, Mapping) or not row:
            raise SchemaError("kv_put needs a non-empty mapping {field name: one row's value}")
        known = self._specs.known(partition)
        if any(n not in known and not (specs and n in specs) for n in row):
            known = await self._io.run_async(self._specs.refresh(partition))
        known.update(specs or {})
        cols = {n: _one_row(n, v, known.get(n)) for n, v in row.items()}
        return await self._io.run_async(
            self._kv_put(keys, cols, partition, group, version, length, specs, timeout_s, raw)
        )

    async def _kv_put(
        self,
        keys: list[str],
        data: Mapping[str, Any],
        partition: str,
        group: Any,
        version: Any,
        length: Any,
        specs: Mapping[str, FieldSpec] | None,
        timeout_s: float | None,
        tags: list[bytes] | None = None,
    ) -> BatchMeta:
        if data:
            cols, col_specs, n = await self._specs.normalize(data, partition, specs)
        else:  # (keys that hold only tags so far: no field, no payload)
            cols, col_specs, n = {}, {}, len(keys)
        if n != len(keys):
            raise SchemaError(
                f"kv put: {len(keys)} keys but the columns have {n} rows; give one row per key"
            )
        msg = m.KvRows(
            partition=partition,
            keys=keys,
            create=True,
            groups=header(group, n, "group"),
            nbytes=payload_nbytes(cols),
            producer=self._writer.producer,
            timeout_s=timeout_of(timeout_s),
        )
        versions = header(version, n, "version")
        lengths = header(length, n, "length")
        if col_specs:
            await self._specs.register(col_specs, partition)
        got: KeyRows = await self._ctl.call(msg)
        meta = got.meta
        old = np.ones(n, dtype=bool)
        old[got.created] = False
        new = meta.select(got.created)
        new.grants = meta.grants
        pos_old = np.flatnonzero(old)
        writing = True
        try:
            writes = []
            for rows, pos, create in (
                (new, got.created, True),
                (meta.select(pos_old), pos_old, False),
            ):
                # (new rows are made on their units even without a field: a later put of
                # fields to their keys writes rows the units hold)
                if len(rows) and (create or cols):
                    part = {name: take_rows(col, pos) for name, col in cols.items()}
                    writes.append(self._writer.write_units(rows, part, col_specs, create=create))
            missed = await asyncio.gather(*writes)  # (units a copy missed: see replicas)
            if tags is not None:  # (before the commit: a put undone takes its tags along)
                await self._ctl.call(m.SetCustomMeta(indexes=meta.indexes, metas=tags))
            writing = False  # (a commit gone with the controller may have landed)
            await self._ctl.call(
                m.Commit(
                    indexes=meta.indexes,
                    fields=list(cols),
                    versions=versions,
                    lengths=lengths,
                    dropped=sorted({u for units in missed for u in units}),
                    copies=meta.replica_units,
                    specs=dict(col_specs),
                )
            )
        except BaseException as e:
            if isinstance(e, SchemaError):  # (this client's specs may be stale: see put)
                self._specs.forget(partition)
            units = [int(u) for u in np.unique(meta.units)]
            lost = await lost_with_unit(self._ctl, meta.indexes, e, units)
            if len(new):  # nothing of a new key may stay half-written: free, undo its row
                await self._writer.undo_new_rows(new, e, writing)
            if lost is not None:
                raise RowsLostError(
                    f"rows {lost[:5].tolist()} of the put's keys were lost with a storage "
                    "unit that died; put those keys again",
                    lost,
                ) from e
            raise
        meta.fields = tuple(cols)
        meta.grants = None
        if versions is not None:
            meta.versions = np.broadcast_to(versions, (n,)).copy()
        if lengths is not None:
            meta.lengths = np.broadcast_to(lengths, (n,)).copy()
        return meta

    # -- reads -------------------------------------------------------------------------------
    async def kv_meta(
        self,
        keys: Sequence[str],
        *,
        partition: str = "default",
        fields: Sequence[str] | None = None,
    ) -> BatchMeta:
        """The rows of ``keys`` as a ``BatchMeta`` without a lease, in the keys' order: for
        ``get_data`` (``format="arrow"`` too), ``set_custom_meta`` (per-key tags) and the
        like. ``meta.fields``: ``fields`` (checked: every row has them written), or those
        every row has. An unknown key is an :class:`~transferqueue.errors.UnknownKeyError`
        naming it."""
        msg = m.KvRows(
            partition=partition,
            keys=_keys(keys),
            fields=None if fields is None else list(fields),
        )
        got: KeyRows = await self._io.run_async(self._ctl.call(msg))
        got.meta.fields = tuple(got.fields)
        return got.meta

    async def kv_batch_get(
        self,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        *,
        partition: str = "default",
    ) -> dict[str, Column]:
        """Columns of the keys' rows, in the keys' order, bit-exact as put: dense fields as
        one tensor, ragged as one :class:`Ragged`, object fields as a list. ``fields``: those
        to read (every key's row must have them), None: every field all the rows have."""
        meta = await self.kv_meta(keys, partition=partition, fields=fields)
        if not meta.fields:  # (rows that hold only tags so far)
            return {}
        return await self._io.run_async(self._read(meta, None))

    async def kv_get(
        self, key: str, fields: Sequence[str] | None = None, *, partition: str = "default"
    ) -> dict[str, Any]:
        """One key's row: ``{field: value}``, a dense field's value a tensor of the field's
        row shape, a ragged one a 1-D tensor, an object one the value (see
        :meth:`kv_batch_get`)."""
        cols = await self.kv_batch_get(_key(key), fields, partition=partition)
        return {name: _row_of(col) for name, col in cols.items()}

    async def kv_list(
        self,
        partition: str = "default",
        *,
        fields: Sequence[str] | str | None = None,
        tags: bool = False,
    ) -> KeyListing:
        """The keys of ``partition`` in row order (``listing.keys``, ``listing.indexes``),
        keys that hold only tags included. ``fields``: names of fields, or ``"all"`` (every
        field some key's row has), to learn which keys' rows have them
        (``listing.ready[field]``, ``listing.fields_of(key)``). ``tags=True``: each key's
        tags too (``listing.tags``, ``{}`` where none)."""
        if isinstance(fields, str) and fields != "all":
            raise BadRequestError(
                f'kv_list: fields must be a list of names or "all", got {fields!r}'
            )
        names = None if fields is None or isinstance(fields, str) else list(fields)
        msg = m.KvList(partition=partition, fields=names, all_fields=fields == "all")
        return await self._io.run_async(self._list(msg, tags))

    async def _list(self, msg: m.KvList, tags: bool) -> KeyListing:
        listing: KeyListing = await self._ctl.call(msg)
        if tags:
            raw = await self._ctl.call(m.GetCustomMeta(indexes=listing.indexes)) if listing else []
            listing.tags = [msgspec.msgpack.decode(r) for r in raw]
        return listing

    # -- delete ------------------------------------------------------------------------------
    async def kv_delete(self, keys: Sequence[str], *, partition: str = "default") -> None:
        """Delete ``keys`` and free their rows on the units (memory freed before this
        returns); they leave every task's queue as if never put. All or nothing: an unknown
        key is an :class:`~transferqueue.errors.UnknownKeyError`, a row a task holds leased a
        :class:`~transferqueue.errors.KeyLeasedError` (delete once the task acknowledges or
        releases it, or its lease runs out)."""
        msg = m.KvDelete(partition=partition, keys=_keys(keys))
        await self._io.run_async(self._ctl.call(msg))

    async def kv_clear(self, partition: str = "default") -> None:
        """Delete every key of ``partition`` as :meth:`kv_delete` does (rows put without a
        key stay; ``clear`` drops every row)."""
        await self._io.run_async(self._ctl.call(m.KvDelete(partition=partition)))
