"""The client's writes: ``put`` of new rows, and of new fields of leased rows.

``Writer`` is the part of :class:`~transferqueue.client.async_client.AsyncClient` that writes
(the key-value calls and loads write through it too). A ``put`` of new rows::

    client -> controller  register_fields (first time a field is seen) , allocate(n)
    client -> units       write(rows of that unit)              (in parallel)
    client -> controller  commit(fields ready)                  (consumers can now see them)

A try that meets a storage unit that died or restarted is undone and put again (bounded).
A ``put`` that adds fields to leased rows renews the lease first (so an expired or unknown
lease fails before anything is written) and acknowledges it in the commit; one that comes
within ``FRESH_LEASE_S`` of the lease's ``get_meta`` and acknowledges it, the lease not settled
otherwise since, skips the renewal: the lease cannot have ended in that time
(:mod:`transferqueue.client.holder` says why). A stage's put of the batch it just processed
is two round trips to the controller instead of three.

Columns on a GPU are written a chunk of rows at a time through the handle's pinned pool, the
device-to-host copy of the next chunk overlapping the write of this one
(:mod:`transferqueue.client.device_io`); the copies start after the work queued on the
current stream of the thread that runs the put (the caller's, or the default stream: a
producer writing its tensors on a stream of its own synchronizes it first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from transferqueue.aio import within
from transferqueue.client.device_io import DeviceSide, ready_events, write_device
from transferqueue.client.holder import Holder
from transferqueue.client.links import ControllerLink, UnitLink, link_of
from transferqueue.client.lost import lost_with_unit
from transferqueue.client.replicas import gather_copies, meta_units, write_groups
from transferqueue.client.specs import Specs
from transferqueue.device.staging import is_device
from transferqueue.errors import (
    BadRequestError,
    PeerGoneError,
    RowsLostError,
    SchemaError,
    TQError,
    UnknownRowError,
)
from transferqueue.loop import LoopThread
from transferqueue.memcpy import gather_rows
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.checks import encode_meta

__all__ = [
    "WRITE_AHEAD_BYTES",
    "Writer",
    "by_unit",
    "header",
    "lease_s_of",
    "payload_nbytes",
    "take_rows",
    "timeout_of",
]

log = logging.getLogger(__name__)

_UNDO_WAIT_S = 30.0
"""How long a failed put waits for the reply to its allocation, to discard the rows."""
_REPUT_S = 30.0
"""How long a put of new rows goes on putting them again while the units it was given die
or restart (each try: allocate, write, commit; nothing of a failed try stays); at least the
handle's ``ride_through_s``."""
_REPUT_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)
WRITE_AHEAD_BYTES = 1 << 20
"""A put from this size on, likely to land whole on the unit the last put went to, is handed
to that unit's link while its rows are allocated (see ``Writer._allocate``); a smaller one
gains less by it than the hand-off costs."""


class _PutAgain(Exception):
    """A try at a put of new rows committed nothing (a unit died or restarted while it
    wrote, or the controller says its rows were lost): undone, it may be put again;
    ``error`` is what the caller sees when no try succeeds."""

    def __init__(self, error: PeerGoneError | RowsLostError) -> None:
        super().__init__(str(error))
        self.error = error


def take_rows(col: Column, pos: np.ndarray) -> Column:
    """Rows ``pos`` of a column: a view when they are one ascending run, else a copy."""
    n = pos.size
    contiguous = n > 0 and int(pos[-1]) - int(pos[0]) + 1 == n and bool((np.diff(pos) == 1).all())
    if isinstance(col, torch.Tensor):
        if contiguous:
            return col[int(pos[0]) : int(pos[-1]) + 1]
        if col.device.type != "cpu":  # a gather on the device, before it is copied off
            return col.index_select(0, torch.as_tensor(pos, device=col.device))
        src = col if col.is_contiguous() else col.contiguous()
        out = torch.empty((n, *col.shape[1:]), dtype=col.dtype)
        gather_rows(out, src, pos)
        return out
    if isinstance(col, Ragged):
        if contiguous:
            return col.slice(int(pos[0]), int(pos[-1]) + 1)
        return col.take(pos)
    return [col[i] for i in pos.tolist()]


def payload_nbytes(cols: Mapping[str, Column]) -> int:
    """Bytes of the tensor data of a put (object columns count as nothing)."""
    total = 0
    for col in cols.values():
        if isinstance(col, torch.Tensor):
            total += col.numel() * col.element_size()
        elif isinstance(col, Ragged):
            total += col.nbytes
    return total


def by_unit(units: np.ndarray) -> dict[int, np.ndarray]:
    """Positions of the rows of each unit, ascending."""
    if units.size and bool((units == units[0]).all()):
        return {int(units[0]): np.arange(units.size, dtype=np.int64)}
    return {int(u): np.flatnonzero(units == u) for u in np.unique(units).tolist()}


class Writer:
    """``put``, and the write steps the key-value calls and loads share
    (:meth:`write_units`, :meth:`undo_new_rows`)."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        units: Mapping[int, UnitLink],
        specs: Specs,
        device: DeviceSide,
        holder: Holder | None = None,
    ) -> None:
        self._io = io
        self._holder = holder  # (the handle's: which leases are fresh)
        self._ctl = controller
        self._units = units
        self._specs = specs
        # Device columns: the pinned chunks device puts are written through, the exporter
        # of shared columns (the handle's, shared by its clients).
        self._device = device
        # Names this client's puts to the controller, which keeps a producer's small puts on
        # one unit for a while (Placement.place).
        self.producer = secrets.token_hex(8)
        self._last_unit: int | None = None  # the unit the last put's rows all went to
        self._whole_bytes = 0  # the largest put the controller placed on one unit
        self.puts_again = 0
        """Tries of puts of new rows undone because a unit died or restarted mid-write, and
        put again (see :meth:`put`)."""

    async def put(
        self,
        data: Mapping[str, Any],
        *,
        meta: BatchMeta | None = None,
        partition: str = "default",
        group: np.ndarray | Sequence[int] | int | None = None,
        version: np.ndarray | Sequence[int] | int | None = None,
        length: np.ndarray | Sequence[int] | int | None = None,
        specs: Mapping[str, FieldSpec] | None = None,
        ack: bool = True,
        lease_s: float = 60.0,
        timeout_s: float | None = None,
        share: Sequence[str] = (),
        tags: Sequence[Mapping[str, Any]] | None = None,
    ) -> BatchMeta:
        """Write columns: new rows, or (with ``meta``) new fields of existing rows.

        ``data`` maps field names to columns: a tensor ``[rows, ...]`` (dense), a
        :class:`Ragged` or a list of 1-D tensors (ragged), or a list of msgpack-able values
        (object). ``group``/``version``/``length`` set row headers (one value, or one per row;
        a row without ``group`` is a group of its own).
        With ``meta`` from ``get_meta``, the lease is acknowledged when the write lands
        (``ack=False`` keeps it open). ``timeout_s`` bounds the wait for capacity (None:
        as long as the service is alive). New rows of a finished partition are a
        :class:`FinishedError`. Returns the rows written.

        New rows whose write meets a storage unit that died or restarted are put again
        (the failed try is undone first, and the controller places the next one on live
        units) for up to 30 s (or the handle's ``ride_through_s``, if longer: a restarted
        controller discards the rows of a commit it had not journaled); then the unit's
        :class:`PeerGoneError` or :class:`RowsLostError` is raised. A put with ``meta`` is
        never put again: its rows lost with a unit are a :class:`RowsLostError` naming them.

        ``share``: dense columns (``[rows, ...]`` tensors, on a GPU) that stay where they are,
        kept by this handle and read by other processes of the node by handle (CUDA IPC),
        until their rows are freed; if this process dies, readers lose those rows (see
        :mod:`transferqueue.device.shared`). Their field is an object field of references.

        ``tags``: one dict of msgpack values per row, set as the rows' custom metadata with
        the put (``get_custom_meta`` reads it). With tags, ``data`` may be empty: new rows
        (one per tag) or the rows of ``meta`` that hold only metadata so far; their fields
        come with later puts (``meta=``), and tasks see them once those are written.
        """
        raw = None if tags is None else encode_tags(tags, None if meta is None else len(meta))
        rest = (meta, partition, group, version, length, specs, ack, lease_s, timeout_s, raw)
        if not share:
            return await self._io.run_async(self._put(data, *rest))
        exporter = self._device.exporter()
        cells = dict(data)
        keys = []
        for name in share:
            col = cells.get(name)
            if not isinstance(col, torch.Tensor) or col.dim() == 0:
                raise SchemaError(
                    f"share: field {name!r} must be a dense column (a tensor [rows, ...]), got "
                    f"{type(col).__name__}"
                )
            key, cells[name] = exporter.share(col)
            keys.append(key)
        try:
            done = await self._io.run_async(self._put(cells, *rest))
        except BaseException:
            for key in keys:
                exporter.drop(key)
            raise
        for key in keys:
            exporter.bind(key, done.partition, done.indexes)
        return done

    async def _put(self, data: Mapping[str, Any], meta: BatchMeta | None, *args: Any) -> BatchMeta:
        try:
            return await self._put_columns(data, meta, *args)
        except SchemaError:
            # (the specs this client knew may be stale: another client cleared the partition
            # and wrote others; the next put learns them)
            self._specs.forget(args[0] if meta is None else meta.partition)
            raise

    async def _put_columns(
        self,
        data: Mapping[str, Any],
        meta: BatchMeta | None,
        partition: str,
        group: Any,
        version: Any,
        length: Any,
        specs: Mapping[str, FieldSpec] | None,
        ack: bool,
        lease_s: float,
        timeout_s: float | None,
        tags: list[bytes] | None = None,
    ) -> BatchMeta:
        where = partition if meta is None else meta.partition
        cols: dict[str, Column]
        col_specs: dict[str, FieldSpec]
        if tags is not None and not data:  # (rows that hold only metadata so far)
            cols, col_specs, n = {}, {}, len(tags)
        else:
            cols, col_specs, n = await self._specs.normalize(data, where, specs, keep_device=True)
        if tags is not None and len(tags) != n:
            raise BadRequestError(f"put: {n} rows but {len(tags)} tags; give one per row")
        timeout_s = timeout_of(timeout_s)
        if col_specs:
            await self._specs.register(col_specs, where)
        versions = header(version, n, "version")
        lengths = header(length, n, "length")
        if meta is not None:
            return await self._put_to(
                meta, cols, col_specs, n, versions, lengths, ack, lease_s, tags
            )
        groups = header(group, n, "group")
        loop = asyncio.get_running_loop()
        # (with ride_through_s: as long as a call rides through a controller's restart, whose
        # recovery discards the rows of a commit it had not journaled: put them again then)
        deadline = loop.time() + max(_REPUT_S, getattr(self._ctl, "ride_through_s", 0.0))
        attempt = 0
        while True:
            try:
                return await self._put_new(
                    cols, col_specs, n, partition, groups, versions, lengths, timeout_s, tags
                )
            except _PutAgain as gone:
                # the write met a unit that died or restarted: nothing of this try stays
                # and the controller learns of the unit; put the rows again (bounded)
                error = gone.error
                if loop.time() >= deadline:
                    raise error from error.__cause__
                log.info("put: %s; putting the rows again", error)
                self.puts_again += 1
                await asyncio.sleep(_REPUT_BACKOFF_S[min(attempt, len(_REPUT_BACKOFF_S) - 1)])
                attempt += 1

    async def _put_to(
        self,
        meta: BatchMeta,
        cols: Mapping[str, Column],
        col_specs: Mapping[str, FieldSpec],
        n: int,
        versions: Any,
        lengths: Any,
        ack: bool,
        lease_s: float,
        tags: list[bytes] | None = None,
    ) -> BatchMeta:
        """A put of new fields of the rows of ``meta`` (see :meth:`put`)."""
        if len(meta) != n:
            raise SchemaError(f"put with meta: the columns have {n} rows, meta has {len(meta)}")
        lease = meta.lease_id if meta.lease_id is not None and not meta.acked else None
        if lease is not None:
            lease_s = lease_s_of(lease_s)  # (checked whether the renewal is sent or not)
        fresh = lease is not None and self._holder is not None and self._holder.fresh(lease)
        if lease is not None and not (fresh and ack):  # (a fresh lease: see client.holder)
            msg = m.Renew(lease_id=lease, lease_s=lease_s, indexes=meta.indexes)
            await self._ctl.call(msg)
        try:
            dropped = await self.write_units(meta, cols, col_specs, create=False)
        except (PeerGoneError, UnknownRowError) as e:
            lost = await lost_with_unit(
                self._ctl, meta.indexes, e, meta_units(meta), raise_unreachable=True
            )
            if lost is None:
                raise
            raise RowsLostError(
                f"rows {lost[:5].tolist()} ({lost.size} of the batch's {len(meta)}) were lost "
                "with a storage unit that died; they left every task's queue and lease. "
                "Put the others: meta.select(positions)",
                lost,
            ) from e
        if tags is not None:
            await self._ctl.call(m.SetCustomMeta(indexes=meta.indexes, metas=tags))
        await self._ctl.call(
            m.Commit(
                indexes=meta.indexes,
                fields=list(cols),
                versions=versions,
                lengths=lengths,
                lease_id=lease if ack else None,
                dropped=dropped,
                copies=meta.replica_units,
                specs=dict(col_specs),
            )
        )
        if lease is not None and ack:
            meta.acked = True
        if versions is not None:
            meta.versions = np.broadcast_to(np.asarray(versions, dtype=np.int64), (n,)).copy()
        if lengths is not None:
            meta.lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (n,)).copy()
        return meta

    async def _put_new(
        self,
        cols: Mapping[str, Column],
        col_specs: Mapping[str, FieldSpec],
        n: int,
        partition: str,
        groups: Any,
        versions: Any,
        lengths: Any,
        timeout_s: float | None,
        tags: list[bytes] | None = None,
    ) -> BatchMeta:
        """One try at a put of new rows: allocate, write, commit. A try that committed
        nothing because of a unit that died or restarted is undone and raises
        :class:`_PutAgain`."""
        nbytes = payload_nbytes(cols)
        allocating = self._ctl.call(
            m.Allocate(
                n=n,
                partition=partition,
                groups=groups,
                versions=versions,
                lengths=lengths,
                nbytes=nbytes,
                producer=self.producer,
                timeout_s=timeout_s,
            )
        )
        wrote: bool | BaseException
        if any(is_device(c) for c in cols.values()):  # written through pinned chunks instead
            new, wrote = await allocating, False
            self._placed(new, nbytes)
        else:
            new, wrote = await self._allocate(allocating, cols, col_specs, nbytes)
        dropped: list[int] = []  # (units that a copy of each row missed, see replicas)
        writing = True
        try:
            if isinstance(wrote, BaseException):
                raise wrote  # (written ahead, and that write failed)
            if not wrote:
                dropped = await self.write_units(new, cols, col_specs, create=True)
            if tags is not None:  # (before the commit: rows undone take their tags along)
                await self._ctl.call(m.SetCustomMeta(indexes=new.indexes, metas=tags))
            writing = False  # (a commit gone with the controller may have landed)
            copies = new.replica_units
            commit = m.Commit(
                new.indexes, list(cols), dropped=dropped, copies=copies, specs=dict(col_specs)
            )
            await self._ctl.call(commit)
        except BaseException as e:
            lost = await lost_with_unit(self._ctl, new.indexes, e, meta_units(new))
            await self.undo_new_rows(new, e, writing)
            error: BaseException = e
            if lost is not None:
                error = RowsLostError(
                    f"the put's rows {lost[:5].tolist()} were lost with a storage unit "
                    "that died while the put wrote them; put the data again",
                    lost,
                )
                error.__cause__ = e
            # rows lost are not committed (also when the commit says so: a controller that
            # restarted discarded them); a unit gone while writing: nothing was committed
            if isinstance(error, RowsLostError) or (writing and isinstance(error, PeerGoneError)):
                raise _PutAgain(error) from e
            if error is e:
                raise
            raise error from e
        new.fields = tuple(cols)
        return new

    async def undo_new_rows(self, new: BatchMeta, error: BaseException, writing: bool) -> None:
        """Undo the new rows ``new`` of a put that failed with ``error`` (``writing``: before
        its commit was sent): nothing of it may stay half-written, so the units free what
        they hold and the controller discards the rows. But a commit that met the
        controller's death (or was cancelled) may have landed (it is journaled before its
        reply): then the rows stay on the units, where a restarted controller serves them
        if the commit landed and frees them if not; the discard frees them if the controller
        answers it and no task has seen them (else they are committed: served whole)."""
        if writing or not isinstance(error, PeerGoneError | asyncio.CancelledError):
            grants = new.grants or {}
            await asyncio.gather(
                *(u.free(new.indexes, grants.get(u.unit_id)) for u in self._units.values()),
                return_exceptions=True,
            )
        with contextlib.suppress(TQError, ValueError):  # (gone: reclaimed later; or seen)
            await self._ctl.call(m.Discard(indexes=new.indexes))

    async def _undo_allocation(self, pending: asyncio.Future[BatchMeta]) -> None:
        """Discard the rows of an allocation whose put failed before it used them. The
        request is already out, so the controller allocates them whether or not anybody waits
        for the reply: wait for it (bounded), then give the rows back."""
        try:
            new = await within(asyncio.shield(pending), _UNDO_WAIT_S)
        except BaseException:  # no reply in time (or the put is cancelled again): give up
            pending.cancel()
            return
        with contextlib.suppress(Exception):
            await self._ctl.call(m.Discard(indexes=new.indexes))

    async def _allocate(
        self,
        allocating: Coroutine[Any, Any, BatchMeta],
        cols: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        nbytes: int,
    ) -> tuple[BatchMeta, bool | BaseException]:
        """The new rows, and whether they are written already (or the error of that write).

        The controller keeps a producer's puts on its unit while the units are balanced, and
        places a put no larger than one it placed whole on one unit: such a put (of at least
        ``WRITE_AHEAD_BYTES``) is handed to the link of the unit this client's last put went
        to while the controller allocates (:meth:`UnitLink.write_new`: the link may prepare
        the write meanwhile). True: written there; False: placed elsewhere, to be written."""
        last = self._last_unit
        link = None
        if last is not None and WRITE_AHEAD_BYTES <= nbytes <= self._whole_bytes:
            link = self._units.get(last)
        if link is None:
            new = await allocating
            self._placed(new, nbytes)
            return new, False
        pending = asyncio.ensure_future(allocating)
        wrote: bool | BaseException
        try:
            await asyncio.sleep(0)  # the allocate request goes out first
            wrote = await link.write_new(pending, cols, specs)
        except BaseException as e:
            if not pending.done() or pending.cancelled() or pending.exception() is not None:
                await self._undo_allocation(pending)
                raise
            wrote = e  # (the rows were placed, their write failed: the put undoes them)
        new = pending.result()
        self._placed(new, nbytes)
        return new, wrote

    def _placed(self, new: BatchMeta, nbytes: int) -> None:
        """Remember where the controller put this client's rows (see :meth:`_allocate`)."""
        units = new.units
        # (a put of two copies writes two units: no unit takes it whole, see replicas)
        if units.size and new.replica_units is None and bool((units == units[0]).all()):
            self._last_unit = int(units[0])
            self._whole_bytes = max(self._whole_bytes, nbytes)
        else:
            self._last_unit = None

    async def write_units(
        self,
        meta: BatchMeta,
        cols: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
    ) -> list[int]:
        """Write the rows to their units; returns the units that a copy of each row missed
        (two copies: gone, while each row got its other one; else none)."""
        jobs = []
        grants = meta.grants or {}
        copies = meta.replica_units is not None
        groups = write_groups(meta) if copies else list(by_unit(meta.units).items())
        device = any(is_device(c) for c in cols.values())
        ready = ready_events(cols) if device else {}
        for u, pos in groups:
            part = {name: take_rows(col, pos) for name, col in cols.items()}
            link, rows, grant = link_of(self._units, u), meta.indexes[pos], grants.get(u)
            if device:
                jobs.append(
                    write_device(
                        link,
                        rows,
                        part,
                        specs,
                        self._device.staging,
                        ready,
                        create=create,
                        grant=grant,
                    )
                )
            else:
                jobs.append(link.write(rows, part, specs, create=create, grant=grant))
        if copies:  # (a copy on a unit that is gone is fine while the row has another)
            return await gather_copies(groups, jobs, len(meta))
        await asyncio.gather(*jobs)
        return []


def encode_tags(tags: Sequence[Mapping[str, Any]], n: int | None) -> list[bytes]:
    """One tag (a dict of msgpack values) per row (``n`` rows where known), encoded:
    checked before anything is put."""
    if isinstance(tags, Mapping) or (n is not None and len(tags) != n):
        got = "a single dict" if isinstance(tags, Mapping) else f"{len(tags)} tags"
        raise BadRequestError(f"{n} rows but {got}; give one tag (a dict) per row")
    return [
        encode_meta(dict(t) if isinstance(t, Mapping) else t, f"tags[{i}]")
        for i, t in enumerate(tags)
    ]


def lease_s_of(lease_s: float) -> float:
    """A lease time: finite seconds > 0 (the controller also bounds it by its max_lease_s)."""
    if not isinstance(lease_s, int | float) or not 0 < lease_s < float("inf"):
        raise BadRequestError(f"lease_s must be finite seconds > 0, got {lease_s!r}")
    return float(lease_s)


def timeout_of(timeout_s: float | None) -> float | None:
    """A wait bound: None or infinity (no bound), else finite seconds >= 0."""
    if timeout_s is None or timeout_s == float("inf"):
        return None
    if not isinstance(timeout_s, int | float) or not 0 <= timeout_s < float("inf"):
        raise BadRequestError(f"timeout_s must be seconds >= 0 or None, got {timeout_s!r}")
    return float(timeout_s)


def header(value: Any, n: int, name: str) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, int | np.integer):
        if not -(2**63) <= int(value) < 2**63:
            raise SchemaError(f"{name}={value} does not fit int64")
        return np.asarray(int(value), dtype=np.int64)  # (0-d: one value for every row)
    arr = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if arr.shape != (n,):
        raise SchemaError(f"{name}= has shape {arr.shape}; give one int, or one per row ({n},)")
    if arr.dtype.kind not in "iu":
        raise SchemaError(f"{name}= must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)
