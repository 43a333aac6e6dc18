"""``AsyncClient``: the one implementation of the TransferQueue client API.

It routes writes to storage units, reports readiness to the controller, gathers reads from
the units in parallel and assembles columns. It works unchanged over every deployment because
it talks only to a :class:`ControllerLink` and :class:`UnitLink` objects. All of its work runs
on the handle's I/O loop (``LoopThread``); calls from other loops or threads hop onto it.

A ``put`` of new rows::

    client -> controller  register_fields (first time a field is seen) , allocate(n)
    client -> units       write(rows of that unit)              (in parallel)
    client -> controller  commit(fields ready)                  (consumers can now see them)

A ``put`` that adds fields to leased rows renews the lease first (so an expired or unknown
lease fails before anything is written) and acknowledges it in the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator, Awaitable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np
import torch

from transferqueue import messages as m
from transferqueue.aio import within
from transferqueue.assemble import empty_column as _empty
from transferqueue.assemble import merge_ragged as _merge_ragged
from transferqueue.assemble import place_dense as _place_dense
from transferqueue.buffers import ResultBuffers
from transferqueue.checkpoint import CheckpointCalls
from transferqueue.errors import (
    BadRequestError,
    PeerGoneError,
    RowsLostError,
    SchemaError,
    TQError,
    UnknownFieldError,
    UnknownRowError,
)
from transferqueue.kv_client import KVCalls
from transferqueue.links import OFFLOAD_BYTES, ControllerLink, Staged, UnitLink
from transferqueue.loop import LoopThread
from transferqueue.memcpy import gather_rows
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.replicas import (
    UnitReadError,
    fall_back,
    gather_copies,
    meta_units,
    tag,
    write_groups,
)
from transferqueue.schema import Column, FieldSpec, normalize_columns
from transferqueue.slots import runs
from transferqueue.status_client import StatusCalls

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["FORMATS", "AsyncClient", "take_rows"]

FORMATS = ("torch", "arrow")
"""What ``get_data`` returns: ``torch`` (a dict of tensors, Ragged and lists) or ``arrow``
(a ``pyarrow.Table`` over the same memory, see :mod:`transferqueue.arrow`)."""

_MAX_RUNS_FOR_DIRECT_READ = 8
_UNDO_WAIT_S = 30.0
# A read that failed on a unit asks the controller which rows were lost for this long: the
# controller may declare the unit dead a little after this client gave up on it.
_LOST_WAIT_S = 6.0
"""How long a failed put waits for the reply to its allocation, to discard the rows."""


def take_rows(col: Column, pos: np.ndarray) -> Column:
    """Rows ``pos`` of a column: a view when they are one ascending run, else a copy."""
    n = pos.size
    contiguous = n > 0 and int(pos[-1]) - int(pos[0]) + 1 == n and bool((np.diff(pos) == 1).all())
    if isinstance(col, torch.Tensor):
        if contiguous:
            return col[int(pos[0]) : int(pos[-1]) + 1]
        src = col if col.is_contiguous() else col.contiguous()
        out = torch.empty((n, *col.shape[1:]), dtype=col.dtype)
        gather_rows(out, src, pos)
        return out
    if isinstance(col, Ragged):
        if contiguous:
            return col.slice(int(pos[0]), int(pos[-1]) + 1)
        return col.take(pos)
    return [col[i] for i in pos.tolist()]


def _payload_nbytes(cols: Mapping[str, Column]) -> int:
    """Bytes of the tensor data of a put (object columns count as nothing)."""
    total = 0
    for col in cols.values():
        if isinstance(col, torch.Tensor):
            total += col.numel() * col.element_size()
        elif isinstance(col, Ragged):
            total += col.nbytes
    return total


def _by_unit(units: np.ndarray) -> dict[int, np.ndarray]:
    """Positions of the rows of each unit, ascending."""
    if units.size and bool((units == units[0]).all()):
        return {int(units[0]): np.arange(units.size, dtype=np.int64)}
    return {int(u): np.flatnonzero(units == u) for u in np.unique(units).tolist()}


class AsyncClient(StatusCalls, KVCalls, CheckpointCalls):
    """Async TransferQueue client, from ``tq.async_client()``. Status, consumption resets,
    custom metadata, loss logs: :mod:`transferqueue.status_client`; key-value calls:
    :mod:`transferqueue.kv_client`; ``save``/``load``: :mod:`transferqueue.checkpoint`."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        units: Sequence[UnitLink],
        buffers: ResultBuffers | None = None,
        owner: object = None,
    ):
        # The handle this client came from: held, so that the handle (and its connections)
        # lives as long as any of its clients (``connect(address).client()`` works).
        self._owner = owner
        self._io = io
        self._ctl = controller
        self._units = {u.unit_id: u for u in units}
        # Warm memory that reads gathering dense rows assemble into (shared by the handle's
        # clients): fresh memory would be faulted in page by page on every read.
        self._buffers = ResultBuffers() if buffers is None else buffers
        self._schema: dict[str, FieldSpec] = {}
        # Names this client's puts to the controller, which keeps a producer's small puts on
        # one unit for a while (Placement.place).
        self._producer = secrets.token_hex(8)
        self._last_unit: int | None = None  # the unit the last put's rows all went to
        self._whole_bytes = 0  # the largest put the controller placed on one unit

    # -- writes ------------------------------------------------------------------------------
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
        """
        return await self._io.run_async(
            self._put(data, meta, partition, group, version, length, specs, ack, lease_s, timeout_s)
        )

    async def _put(
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
    ) -> BatchMeta:
        known = dict(self._schema)
        if specs:
            known.update(specs)
        cols, col_specs, n = normalize_columns(data, known)
        timeout_s = _timeout(timeout_s)
        await self._register(col_specs)
        versions = _header(version, n, "version")
        lengths = _header(length, n, "length")
        if meta is None:
            nbytes = _payload_nbytes(cols)
            allocating = self._ctl.call(
                m.Allocate(
                    n=n,
                    partition=partition,
                    groups=_header(group, n, "group"),
                    versions=versions,
                    lengths=lengths,
                    nbytes=nbytes,
                    producer=self._producer,
                    timeout_s=timeout_s,
                )
            )
            new, staged = await self._allocate_staging(allocating, cols, nbytes)
            grants = new.grants or {}
            dropped: list[int] = []  # (units that a copy of each row missed, see replicas)
            try:
                if staged is not None:
                    link, token = staged
                    await link.write_staged(
                        new.indexes, token, col_specs, create=True, grant=grants.get(link.unit_id)
                    )
                else:
                    dropped = await self._write_units(new, cols, col_specs, create=True)
                await self._ctl.call(
                    m.Commit(indexes=new.indexes, fields=list(cols), dropped=dropped)
                )
            except BaseException as e:
                # Nothing of the put may stay half-written: free what units hold, undo rows.
                await asyncio.gather(
                    *(u.free(new.indexes, grants.get(u.unit_id)) for u in self._units.values()),
                    return_exceptions=True,
                )
                lost = await self._lost(new.indexes, e, meta_units(new))
                await self._ctl.call(m.Discard(indexes=new.indexes))
                if lost is not None:
                    raise RowsLostError(
                        f"the put's rows {lost[:5].tolist()} were lost with a storage unit "
                        "that died while the put wrote them; put the data again",
                        lost,
                    ) from e
                raise
            new.fields = tuple(cols)
            return new
        if len(meta) != n:
            raise SchemaError(f"put with meta: the columns have {n} rows, meta has {len(meta)}")
        lease = meta.lease_id if meta.lease_id is not None and not meta.acked else None
        if lease is not None:
            msg = m.Renew(lease_id=lease, lease_s=_lease(lease_s), indexes=meta.indexes)
            await self._ctl.call(msg)
        try:
            dropped = await self._write_units(meta, cols, col_specs, create=False)
        except (PeerGoneError, UnknownRowError) as e:
            lost = await self._lost(meta.indexes, e, meta_units(meta))
            if lost is None:
                raise
            raise RowsLostError(
                f"rows {lost[:5].tolist()} ({lost.size} of the batch's {len(meta)}) were lost "
                "with a storage unit that died; they left every task's queue and lease. "
                "Put the others: meta.select(positions)",
                lost,
            ) from e
        await self._ctl.call(
            m.Commit(
                indexes=meta.indexes,
                fields=list(cols),
                versions=versions,
                lengths=lengths,
                lease_id=lease if ack else None,
                dropped=dropped,
            )
        )
        if lease is not None and ack:
            meta.acked = True
        if versions is not None:
            meta.versions = np.broadcast_to(np.asarray(versions, dtype=np.int64), (n,)).copy()
        if lengths is not None:
            meta.lengths = np.broadcast_to(np.asarray(lengths, dtype=np.int64), (n,)).copy()
        return meta

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

    async def _allocate_staging(
        self, allocating: Coroutine[Any, Any, BatchMeta], cols: Mapping[str, Column], nbytes: int
    ) -> tuple[BatchMeta, tuple[UnitLink, Staged] | None]:
        """The new rows, and the columns staged by the unit they went to (or None).

        While the controller allocates, the columns are copied to where the unit this
        client's last put went to will take them from (:meth:`UnitLink.stage`), when this
        put can go there too: the controller keeps a producer's puts on its unit while the
        units are balanced, and a put no larger than one it placed whole is placed whole.
        """
        last = self._last_unit
        link = None if last is None or nbytes > self._whole_bytes else self._units.get(last)
        if link is None or not link.stages(nbytes):
            new = await allocating
            self._placed(new, nbytes)
            return new, None
        pending = asyncio.ensure_future(allocating)
        staged: Staged | None = None
        try:
            await asyncio.sleep(0)  # the allocate request goes out first
            staged = await link.stage(cols)
            new = await pending
        except BaseException:
            if staged is not None:
                link.unstage(staged)
            await self._undo_allocation(pending)
            raise
        self._placed(new, nbytes)
        if staged is None:
            return new, None
        if self._last_unit != link.unit_id:  # placed elsewhere (or over several units)
            link.unstage(staged)
            return new, None
        return new, (link, staged)

    def _placed(self, new: BatchMeta, nbytes: int) -> None:
        """Remember where the controller put this client's rows (see _allocate_staging)."""
        units = new.units
        # (a put of two copies writes two units: nothing to stage for one, see replicas)
        if units.size and new.replica_units is None and bool((units == units[0]).all()):
            self._last_unit = int(units[0])
            self._whole_bytes = max(self._whole_bytes, nbytes)
        else:
            self._last_unit = None

    async def _register(self, specs: Mapping[str, FieldSpec]) -> None:
        new = {k: v for k, v in specs.items() if self._schema.get(k) != v}
        if new:
            registered: dict[str, FieldSpec] = await self._ctl.call(m.RegisterFields(specs=new))
            self._schema.update(registered)

    async def _write_units(
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
        groups = write_groups(meta) if copies else list(_by_unit(meta.units).items())
        for u, pos in groups:
            part = {name: take_rows(col, pos) for name, col in cols.items()}
            write = self._unit(u).write(
                meta.indexes[pos], part, specs, create=create, grant=grants.get(u)
            )
            jobs.append(write)
        if copies:  # (a copy on a unit that is gone is fine while the row has another)
            return await gather_copies(groups, jobs, len(meta))
        await asyncio.gather(*jobs)
        return []

    def _unit(self, unit_id: int) -> UnitLink:
        try:
            return self._units[unit_id]
        except KeyError:
            raise SchemaError(
                f"meta names storage unit {unit_id}, which this client does not know"
            ) from None

    # -- reads -------------------------------------------------------------------------------
    async def get_meta(
        self,
        task: str,
        fields: Sequence[str] | None = None,
        batch_size: int = 1,
        *,
        partition: str = "default",
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        min_version: int | None = None,
        max_group: int | None = None,
        **sampler_options: Any,
    ) -> BatchMeta:
        """Lease up to ``batch_size`` rows whose ``fields`` are all ready for ``task``.

        Blocks until the batch is full, the partition is finished and drained for this task
        (``reason == "end"``), or ``timeout_s`` passes (``reason == "timeout"``, short or
        empty). ``None`` waits as long as the service is alive; a finished partition whose
        rows wait for fields nobody has written, with no other task left to write them, is an
        :class:`UnknownFieldError` (a misspelt field). Rows below ``min_version`` are dropped
        for this task (counted in stats). ``max_group`` bounds the group ids handed out (group
        sampler with ``order="group"``). Sampler options (``group_size=``, ``dp_size=``,
        ``order=``) go as keywords.
        """
        msg = m.GetMeta(
            task=task,
            partition=partition,
            fields=None if fields is None else list(fields),
            batch_size=batch_size,
            lease_s=_lease(lease_s),
            sampler=sampler,
            sampler_options=sampler_options,
            min_version=min_version,
            max_group=max_group,
            timeout_s=_timeout(timeout_s),
        )
        return await self._io.run_async(self._ctl.call(msg))

    @overload
    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["torch"] = "torch",
    ) -> dict[str, Column]: ...

    @overload
    async def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, *, format: Literal["arrow"]
    ) -> pa.Table: ...

    async def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, *, format: str = "torch"
    ) -> dict[str, Column] | pa.Table:
        """Columns of the batch's rows, in the batch's order: dense fields as one tensor,
        ragged as one :class:`Ragged`, object fields as a list; with ``format="arrow"``, a
        ``pyarrow.Table`` of the same columns over the same memory (ragged: ``large_list``,
        dense: primitive or fixed-size lists; see :mod:`transferqueue.arrow`)."""
        check_format(format)
        cols = await self._io.run_async(self._get_data_or_lost(meta, fields))
        return as_format(cols, format)

    async def _get_data_or_lost(
        self, meta: BatchMeta, fields: Sequence[str] | None
    ) -> dict[str, Column]:
        """A read that fails because rows were lost with a unit raises RowsLostError. With
        two copies of each row, the rows of a unit that fails are read from their other
        copies (see :mod:`transferqueue.replicas`)."""
        units, dead = meta.units, set[int]()
        while True:
            try:
                return await self._get_data(meta, fields, units)
            except (PeerGoneError, UnknownRowError) as e:
                error: PeerGoneError | UnknownRowError = e
            except UnitReadError as e:
                dead.add(e.unit)
                moved = fall_back(meta, units, dead)
                if moved is not None:
                    units = moved
                    continue
                error = e.error
            lost = await self._lost(meta.indexes, error, meta_units(meta))
            if lost is None:
                raise error
            raise RowsLostError(
                f"rows {lost[:5].tolist()} ({lost.size} of the batch's {len(meta)}) were lost "
                "with a storage unit that died; they left every task's queue and lease. "
                "Acknowledge the batch (ack skips lost rows), or read the others: "
                "meta.select(positions)",
                lost,
            ) from error

    async def _lost(
        self, indexes: np.ndarray, error: BaseException, units: list[int]
    ) -> np.ndarray | None:
        """The rows of ``indexes`` lost with a unit, when ``error`` (of a unit) may be due to
        that; None when none is (then ``error`` stands). ``units``: those the read used."""
        if not isinstance(error, PeerGoneError | UnknownRowError):
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (_LOST_WAIT_S if isinstance(error, PeerGoneError) else 0.0)
        while True:
            try:
                lost: np.ndarray = await self._ctl.call(m.Lost(indexes=indexes, units=units))
            except Exception:  # the controller is gone too: the unit's error stands
                return None
            if lost.size:
                return lost
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.25)

    async def _get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None, units: np.ndarray | None = None
    ) -> dict[str, Column]:
        """``units``: the unit to read each row from (default ``meta.units``; a replicated
        read that fell back: some rows from their second copies). With two copies, a unit's
        failure is a UnitReadError naming it."""
        names = list(meta.fields if fields is None else fields)
        if not names:
            raise ValueError("get_data needs fields: the meta names none; pass fields=[...]")
        missing = [f for f in names if f not in self._schema]
        if missing:
            known: dict[str, FieldSpec] = await self._ctl.call(m.GetSpecs())
            self._schema.update(known)
            missing = [f for f in names if f not in self._schema]
            if missing:
                raise UnknownFieldError(
                    f"fields {missing} have never been written; known: {sorted(self._schema)}"
                )
        specs = {f: self._schema[f] for f in names}
        n = len(meta)
        if n == 0:
            return {f: _empty(specs[f]) for f in names}
        copies = meta.replica_units is not None
        groups = _by_unit(meta.units if units is None else units)
        if len(groups) == 1:
            ((u, _),) = groups.items()
            link = self._unit(u)
            if not link.supports_out or link.lends_reads:
                if copies:
                    return await tag(u, link.read(meta.indexes, names))  # type: ignore[return-value]
                return await link.read(meta.indexes, names)
        shapes = {f: ((n, *s.shape), s.torch_dtype) for f, s in specs.items() if s.kind == "dense"}
        out = self._buffers.tensors(shapes) or {
            f: torch.empty(shape, dtype=dt) for f, (shape, dt) in shapes.items()
        }
        row_bytes = sum(t[0].numel() * t.element_size() for t in out.values())
        pieces: list[tuple[np.ndarray, dict[str, Column]]] = []

        async def read_unit(u: int, pos: np.ndarray) -> None:
            link = self._unit(u)
            pos_runs = runs(pos)
            # A unit in this process gathers straight into the batch. A remote unit's rows
            # come back as views of an arena lent to this read (or as frames) and are copied
            # into the batch here, as they arrive, so the arena is free again at once.
            direct = link.supports_out and not link.lends_reads
            if direct and len(pos_runs) <= _MAX_RUNS_FOR_DIRECT_READ:
                for a, b in pos_runs:
                    views = {f: t[a:b] for f, t in out.items()}
                    got = await link.read(meta.indexes[a:b], names, views)
                    pieces.append((np.arange(a, b), got))
                    _place_dense(out, np.arange(a, b), got)
                return
            got = await link.read(meta.indexes[pos], names)
            if row_bytes * pos.size >= OFFLOAD_BYTES:  # off the I/O loop (numpy drops the GIL)
                await asyncio.to_thread(_place_dense, out, pos, got)
            else:
                _place_dense(out, pos, got)
            pieces.append((pos, got))

        reads: list[Awaitable[object]] = [read_unit(u, pos) for u, pos in groups.items()]
        if copies:
            reads = [tag(u, r) for u, r in zip(groups, reads, strict=True)]
        await asyncio.gather(*reads)
        pieces.sort(key=lambda p: int(p[0][0]))
        result: dict[str, Column] = {}
        for f in names:
            kind = specs[f].kind
            if kind == "dense":
                result[f] = out[f]
            elif kind == "ragged":
                result[f] = _merge_ragged([(p, g[f]) for p, g in pieces], n, specs[f])
            else:
                values: list[Any] = [None] * n
                for pos, got in pieces:
                    col = got[f]
                    assert isinstance(col, list)
                    for i, v in zip(pos.tolist(), col, strict=True):
                        values[i] = v
                result[f] = values
        return result

    # -- consumption -------------------------------------------------------------------------
    async def ack(self, meta: BatchMeta) -> None:
        """Consume the batch's rows for its task (idempotent)."""
        if meta.lease_id is None:
            raise ValueError("this BatchMeta holds no lease (it came from put, or was empty)")
        if meta.acked:
            return
        await self._io.run_async(
            self._ctl.call(m.Ack(lease_id=meta.lease_id, indexes=meta.indexes))
        )
        meta.acked = True

    async def release(self, meta: BatchMeta) -> None:
        """Give the batch's rows back to its task unconsumed (e.g. a consumer shutting down)."""
        if meta.lease_id is None or meta.acked:
            return
        msg = m.Release(lease_id=meta.lease_id, indexes=meta.indexes)
        await self._io.run_async(self._ctl.call(msg))
        meta.acked = True

    async def stream(
        self,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        partition: str = "default",
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        **sampler_options: Any,
    ) -> AsyncGenerator[tuple[BatchMeta, dict[str, Column]], None]:
        """Yield (meta, columns) until the task's stream ends; each batch is acknowledged when
        the loop body finishes it (unless the body acked it itself, e.g. by ``put(meta=)``).
        A body that raises leaves its lease open: the rows are redelivered after ``lease_s``.
        ``timeout_s`` bounds each wait; an empty timeout ends nothing, the loop keeps waiting.
        """
        while True:
            meta = await self.get_meta(
                task,
                fields,
                batch_size,
                partition=partition,
                timeout_s=timeout_s,
                lease_s=lease_s,
                sampler=sampler,
                **sampler_options,
            )
            if len(meta):
                cols = await self.get_data(meta)
                yield meta, cols
                if not meta.acked:
                    await self.ack(meta)
            if meta.is_end:
                return

    # -- administration ----------------------------------------------------------------------
    async def declare_tasks(self, tasks: Sequence[str], *, partition: str = "default") -> None:
        """Name every consumer task of the partition; rows are freed once all have acked."""
        msg = m.DeclareTasks(partition=partition, tasks=list(tasks))
        await self._io.run_async(self._ctl.call(msg))

    async def finish(self, partition: str = "default") -> None:
        """No more rows will be put into the partition; consumers end once drained."""
        await self._io.run_async(self._ctl.call(m.Finish(partition=partition)))

    async def clear(self, partition: str | None = None) -> None:
        """Drop every row of the partition (all partitions if None)."""
        await self._io.run_async(self._ctl.call(m.Clear(partition=partition)))

    async def stats(self) -> dict[str, Any]:
        """Controller state (rows, tasks, leases) and every unit's storage."""
        return await self._io.run_async(self._stats())

    async def _stats(self) -> dict[str, Any]:
        ctl = await self._ctl.call(m.Stats())
        got = await asyncio.gather(
            *(u.stats() for u in self._units.values()), return_exceptions=True
        )
        # (a unit that is down reports its error: the stats of a degraded service still come)
        units = [
            {"error": f"{type(u).__name__}: {u}"} if isinstance(u, TQError) else u for u in got
        ]
        for u in got:
            if isinstance(u, BaseException) and not isinstance(u, TQError):
                raise u
        return {"controller": ctl, "units": units}


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")


def as_format(cols: dict[str, Column], format: str) -> dict[str, Column] | pa.Table:
    """``get_data``'s columns in the asked format (see :data:`FORMATS`)."""
    if format == "arrow":
        from transferqueue.arrow import to_table  # (pyarrow loads only when asked for)

        return to_table(cols)
    return cols


def _lease(lease_s: float) -> float:
    """A lease time: finite seconds > 0 (the controller also bounds it by its max_lease_s)."""
    if not isinstance(lease_s, int | float) or not 0 < lease_s < float("inf"):
        raise BadRequestError(f"lease_s must be finite seconds > 0, got {lease_s!r}")
    return float(lease_s)


def _timeout(timeout_s: float | None) -> float | None:
    """A wait bound: None or infinity (no bound), else finite seconds >= 0."""
    if timeout_s is None or timeout_s == float("inf"):
        return None
    if not isinstance(timeout_s, int | float) or not 0 <= timeout_s < float("inf"):
        raise BadRequestError(f"timeout_s must be seconds >= 0 or None, got {timeout_s!r}")
    return float(timeout_s)


def _header(value: Any, n: int, name: str) -> np.ndarray | None:
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
