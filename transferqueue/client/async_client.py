"""``AsyncClient``: the one implementation of the TransferQueue client API.

It routes writes to storage units, reports readiness to the controller, gathers reads from
the units in parallel and assembles columns. It works unchanged over every deployment because
it talks only to a :class:`ControllerLink` and :class:`UnitLink` objects. All of its work runs
on the handle's I/O loop (``LoopThread``); calls from other loops or threads hop onto it.

The client reads and consumes itself; the rest is done by parts it holds, each with its own
state, whose calls it offers as its own (``put = _part_call(...)``: the same function, run on
the part)::

    part          module       calls
    Writer        put          put
    StatusCalls   status       status, reset_consumption, set/get_custom_meta, lost_rows,
                               retire_groups, claim
    KeyValue      kv           kv_put, kv_batch_put, kv_get, kv_batch_get, kv_meta, kv_list,
                               kv_delete, kv_clear
    Checkpoints   checkpoint   save, load
    Specs         specs        (the field specs known, shared by writes and reads)
    DeviceSide    device_io    (pinned chunks, shared columns: the handle's, shared by its
                               clients; puts write through it, device reads land through it)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar, overload

import numpy as np
import torch

from transferqueue.client import assemble
from transferqueue.client.buffers import ResultBuffers
from transferqueue.client.checkpoint import Checkpoints
from transferqueue.client.device_io import DeviceSide, to_device
from transferqueue.client.holder import Holder
from transferqueue.client.kv import KeyValue
from transferqueue.client.links import OFFLOAD_BYTES, ControllerLink, UnitLink, link_of
from transferqueue.client.lost import lost_with_unit
from transferqueue.client.put import Writer, by_unit, take_rows
from transferqueue.client.replicas import (
    UnitReadError,
    fall_back,
    meta_units,
    tag,
)
from transferqueue.client.requests import ack_request, get_meta_request, release_request
from transferqueue.client.specs import Specs
from transferqueue.client.status import StatusCalls
from transferqueue.device.shared import ProducerGoneError, is_ref_column
from transferqueue.errors import (
    PeerGoneError,
    RowsLostError,
    TQError,
    UnknownRowError,
)
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.schema import Column, FieldSpec
from transferqueue.slots import runs
from transferqueue.wire import messages as m

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["FORMATS", "AsyncClient", "take_rows"]

log = logging.getLogger(__name__)

FORMATS = ("torch", "arrow")
"""What ``get_data`` returns: ``torch`` (a dict of tensors, Ragged and lists) or ``arrow``
(a ``pyarrow.Table`` over the same memory, see :mod:`transferqueue.arrow`)."""

_MAX_RUNS_FOR_DIRECT_READ = 8

P = ParamSpec("P")
R = TypeVar("R")
Part = TypeVar("Part")


def _part_call(
    part: Callable[[AsyncClient], Part], method: Callable[Concatenate[Part, P], R]
) -> Callable[Concatenate[AsyncClient, P], R]:
    """``method`` of a part of the client, offered as the client's own (name, signature and
    docstring are the part's)."""

    @functools.wraps(method)
    def call(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(part(self), *args, **kwargs)

    call.__module__ = __name__
    call.__qualname__ = f"AsyncClient.{method.__name__}"
    return call


class AsyncClient:
    """Async TransferQueue client, from ``tq.async_client()``. Writes (``put``):
    :mod:`transferqueue.client.put`; status, consumption resets,
    custom metadata, loss logs: :mod:`transferqueue.client.status`; key-value calls:
    :mod:`transferqueue.client.kv`; ``save``/``load``: :mod:`transferqueue.client.checkpoint`."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        units: Sequence[UnitLink],
        buffers: ResultBuffers | None = None,
        owner: object = None,
        device: DeviceSide | None = None,
        holder: Holder | None = None,
    ):
        # The handle this client came from: held, so that the handle (and its connections)
        # lives as long as any of its clients (``connect(address).client()`` works).
        self._owner = owner
        self._holder = holder  # (the handle's: the leases' holder, see client.holder)
        self._io = io
        self._ctl = controller
        self._units = {u.unit_id: u for u in units}
        # Warm memory that reads gathering dense rows assemble into (shared by the handle's
        # clients): fresh memory would be faulted in page by page on every read.
        self._buffers = ResultBuffers() if buffers is None else buffers
        # Device columns: pinned chunks, shared columns (shared by the handle's clients).
        self._device = DeviceSide(io, controller) if device is None else device
        self._specs = Specs(controller)
        self._writer = Writer(io, controller, self._units, self._specs, self._device, holder)
        self._status = StatusCalls(io, controller)
        self._kv = KeyValue(io, controller, self._specs, self._writer, self._get_data_or_lost)
        self._checkpoints = Checkpoints(
            io, controller, self._specs, self._writer, self._get_data_or_lost
        )

    @property
    def holder(self) -> Holder | None:
        """The holder the leases this client takes are held under (its handle's)."""
        return self._holder

    @property
    def puts_again(self) -> int:
        """Tries of puts of new rows undone because a unit died or restarted mid-write, and
        put again (see :meth:`put`)."""
        return self._writer.puts_again

    # -- the parts' calls (see the module) ---------------------------------------------------
    put = _part_call(lambda c: c._writer, Writer.put)
    status = _part_call(lambda c: c._status, StatusCalls.status)
    reset_consumption = _part_call(lambda c: c._status, StatusCalls.reset_consumption)
    set_custom_meta = _part_call(lambda c: c._status, StatusCalls.set_custom_meta)
    get_custom_meta = _part_call(lambda c: c._status, StatusCalls.get_custom_meta)
    lost_rows = _part_call(lambda c: c._status, StatusCalls.lost_rows)
    retire_groups = _part_call(lambda c: c._status, StatusCalls.retire_groups)
    claim = _part_call(lambda c: c._status, StatusCalls.claim)
    kv_put = _part_call(lambda c: c._kv, KeyValue.kv_put)
    kv_batch_put = _part_call(lambda c: c._kv, KeyValue.kv_batch_put)
    kv_get = _part_call(lambda c: c._kv, KeyValue.kv_get)
    kv_batch_get = _part_call(lambda c: c._kv, KeyValue.kv_batch_get)
    kv_meta = _part_call(lambda c: c._kv, KeyValue.kv_meta)
    kv_list = _part_call(lambda c: c._kv, KeyValue.kv_list)
    kv_delete = _part_call(lambda c: c._kv, KeyValue.kv_delete)
    kv_clear = _part_call(lambda c: c._kv, KeyValue.kv_clear)
    save = _part_call(lambda c: c._checkpoints, Checkpoints.save)
    load = _part_call(lambda c: c._checkpoints, Checkpoints.load)

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
        consume: bool = False,
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
        ``order=``) go as keywords. ``consume=True``: at most once, a full batch comes back
        acknowledged (``meta.acked``; one round trip instead of two, a crash after it loses
        the rows); a short one stays leased.
        """
        msg = get_meta_request(
            task,
            fields,
            batch_size,
            partition=partition,
            timeout_s=timeout_s,
            lease_s=lease_s,
            sampler=sampler,
            min_version=min_version,
            max_group=max_group,
            consume=consume,
            **sampler_options,
        )
        holder = self._holder
        if holder is not None:
            if not holder.started:
                await asyncio.to_thread(holder.start)
            msg.holder = holder.id
        asked = time.monotonic()
        meta = await self._io.run_async(self._ctl.call(msg))
        if holder is not None and meta.lease_id is not None and not meta.acked and len(meta):
            holder.took(meta.lease_id, asked, meta.lease_s or 0.0)  # (its put need not renew)
        return meta

    @overload
    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["torch"] = "torch",
        device: str | torch.device | None = None,
    ) -> dict[str, Column]: ...

    @overload
    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["arrow"],
        device: None = None,
    ) -> pa.Table: ...

    async def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: str = "torch",
        device: str | torch.device | None = None,
    ) -> dict[str, Column] | pa.Table:
        """Columns of the batch's rows, in the batch's order: dense fields as one tensor,
        ragged as one :class:`Ragged`, object fields as a list; with ``format="arrow"``, a
        ``pyarrow.Table`` of the same columns over the same memory (ragged: ``large_list``,
        dense: primitive or fixed-size lists; see :mod:`transferqueue.arrow`).

        ``device`` (``"cuda:0"``): tensors (and Ragged values) land there, copied through the
        handle's pinned chunks (:mod:`transferqueue.device.staging`), ready on any stream
        when this returns; Ragged offsets stay on the host."""
        check_format(format)
        if device is not None and format != "torch":
            raise ValueError("get_data(device=...) returns tensors: use format='torch'")
        cols = await self._io.run_async(self._get_data_or_lost(meta, fields))
        if any(is_ref_column(c) for c in cols.values()):
            cols = await self._resolve_shared(meta, cols, device)
        if device is not None:
            cols = await to_device(cols, device, self._device.staging)
        return as_format(cols, format)

    async def _resolve_shared(
        self, meta: BatchMeta, cols: dict[str, Column], device: str | torch.device | None
    ) -> dict[str, Column]:
        """Columns shared by their producer (``put(share=...)``) read by handle, as tensors
        of this reader's own. Rows whose producer is gone are lost: their groups are retired
        (as rows of a dead unit leave every queue and lease) and RowsLostError names them."""
        target = None if device is None else torch.device(device)
        importer = self._device.importer()
        out = dict(cols)
        for name, col in cols.items():
            if not is_ref_column(col):
                continue
            try:
                out[name] = await asyncio.to_thread(importer.resolve, col, target)  # type: ignore[arg-type]
            except ProducerGoneError as e:
                lost = meta.indexes[e.positions]
                await self.retire_groups(np.unique(meta.groups[e.positions]), meta.partition)
                raise RowsLostError(
                    f"field {name!r} of rows {lost[:5].tolist()} ({lost.size} of the batch's "
                    f"{len(meta)}) was shared by a producer that is gone ({e}); their groups "
                    "were retired from every task: put them again",
                    lost,
                ) from e
        return out

    async def _get_data_or_lost(
        self, meta: BatchMeta, fields: Sequence[str] | None
    ) -> dict[str, Column]:
        """A read that fails because rows were lost with a unit raises RowsLostError. With
        two copies of each row, the rows of a unit that fails are read from their other
        copies (see :mod:`transferqueue.client.replicas`)."""
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
            lost = await lost_with_unit(
                self._ctl, meta.indexes, error, meta_units(meta), raise_unreachable=True
            )
            if lost is None:
                raise error
            raise RowsLostError(
                f"rows {lost[:5].tolist()} ({lost.size} of the batch's {len(meta)}) were lost "
                "with a storage unit that died; they left every task's queue and lease. "
                "Acknowledge the batch (ack skips lost rows), or read the others: "
                "meta.select(positions)",
                lost,
            ) from error

    async def _get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None, units: np.ndarray | None = None
    ) -> dict[str, Column]:
        """``units``: the unit to read each row from (default ``meta.units``; a replicated
        read that fell back: some rows from their second copies). With two copies, a unit's
        failure is a UnitReadError naming it."""
        names = list(meta.fields if fields is None else fields)
        if not names:
            raise ValueError("get_data needs fields: the meta names none; pass fields=[...]")
        specs = await self._specs.of(names, meta.partition)
        try:
            return await self._gather(meta, names, specs, units)
        except assemble.StaleSpecs:
            # (the partition was cleared and written with other specs since they were learnt)
            specs = await self._specs.of(names, meta.partition, refresh=True)
            return await self._gather(meta, names, specs, units)

    async def _gather(
        self,
        meta: BatchMeta,
        names: list[str],
        specs: dict[str, FieldSpec],
        units: np.ndarray | None,
    ) -> dict[str, Column]:
        n = len(meta)
        if n == 0:
            return {f: assemble.empty_column(specs[f]) for f in names}
        copies = meta.replica_units is not None
        groups = by_unit(meta.units if units is None else units)
        if len(groups) == 1:
            ((u, _),) = groups.items()
            link = link_of(self._units, u)
            if not link.supports_out or link.lends_reads:
                if copies:
                    got = await tag(u, link.read(meta.indexes, names))
                else:
                    got = await link.read(meta.indexes, names)
                return assemble.conform(got, specs)  # type: ignore[arg-type]
        shapes = {f: ((n, *s.shape), s.torch_dtype) for f, s in specs.items() if s.kind == "dense"}
        out = self._buffers.tensors(shapes) or {
            f: torch.empty(shape, dtype=dt) for f, (shape, dt) in shapes.items()
        }
        row_bytes = sum(t[0].numel() * t.element_size() for t in out.values())
        pieces: list[tuple[np.ndarray, dict[str, Column]]] = []

        async def read_unit(u: int, pos: np.ndarray) -> None:
            link = link_of(self._units, u)
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
                    assemble.place_dense(out, np.arange(a, b), got)
                return
            got = await link.read(meta.indexes[pos], names)
            if row_bytes * pos.size >= OFFLOAD_BYTES:  # off the I/O loop (numpy drops the GIL)
                await asyncio.to_thread(assemble.place_dense, out, pos, got)
            else:
                assemble.place_dense(out, pos, got)
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
            elif kind in ("ragged", "shaped"):
                parts = [(p, g[f]) for p, g in pieces]
                result[f] = assemble.merge_ragged(parts, n, specs[f], self._buffers.tensor)
            else:
                values: list[Any] = [None] * n
                for pos, got in pieces:
                    col = assemble.check_objects(got[f])
                    for i, v in zip(pos.tolist(), col, strict=True):
                        values[i] = v
                result[f] = values
        return result

    # -- consumption -------------------------------------------------------------------------
    async def ack(self, meta: BatchMeta) -> None:
        """Consume the batch's rows for its task (idempotent)."""
        msg = ack_request(meta)
        if msg is None:
            return
        self.settled(meta)
        await self._io.run_async(self._ctl.call(msg))
        meta.acked = True

    async def release(self, meta: BatchMeta) -> None:
        """Give the batch's rows back to its task unconsumed (e.g. a consumer shutting down)."""
        msg = release_request(meta)
        if msg is None:
            return
        self.settled(meta)
        await self._io.run_async(self._ctl.call(msg))
        meta.acked = True

    def settled(self, meta: BatchMeta) -> None:
        """(Of this client's ``ack`` and ``release``, and the blocking client's.) Rows of
        ``meta``'s lease are settled: a later put of that lease renews it first."""
        if self._holder is not None:
            self._holder.settled(meta.lease_id)

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
        device: str | torch.device | None = None,
        **sampler_options: Any,
    ) -> AsyncGenerator[tuple[BatchMeta, dict[str, Column]], None]:
        """Yield (meta, columns) until the task's stream ends; each batch is acknowledged when
        the loop body finishes it (unless the body acked it itself, e.g. by ``put(meta=)``).
        A body that raises leaves its lease open: the rows are redelivered after ``lease_s``.
        ``timeout_s`` bounds each wait; an empty timeout ends nothing, the loop keeps waiting.
        ``device``: columns land there (as :meth:`get_data`'s).
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
                cols = await self.get_data(meta, device=device)
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
        """Drop every row of the partition (all partitions if None); it forgets its field
        specs (its fields may come back with other shapes, dtypes or kinds)."""
        await self._io.run_async(self._ctl.call(m.Clear(partition=partition)))
        self._specs.forget(partition)

    async def specs(self, partition: str = "default") -> dict[str, FieldSpec]:
        """The field specs of ``partition`` (each field's kind, dtype and per-row shape; a
        partition without them, never written or cleared, has none)."""
        return await self._io.run_async(self._specs.refresh(partition))

    async def stats(self) -> dict[str, Any]:
        """Controller state (rows, tasks, leases) and every unit's storage."""
        return await self._io.run_async(self._stats())

    async def _stats(self) -> dict[str, Any]:
        ctl = await self._ctl.call(m.Stats())
        # A unit the controller declared gone is not asked: a call to it would wait for the
        # liveness bound (seconds) on every stats call until the unit is back.
        alive = ctl.get("units_alive") or []
        gone = {u for u, ok in enumerate(alive) if not ok}
        got = await asyncio.gather(
            *(_gone_unit(i) if i in gone else u.stats() for i, u in self._units.items()),
            return_exceptions=True,
        )
        # (a unit that is down reports its error: the stats of a degraded service still come)
        units = [
            {"error": f"{type(u).__name__}: {u}"} if isinstance(u, TQError) else u for u in got
        ]
        for u in got:
            if isinstance(u, BaseException) and not isinstance(u, TQError):
                raise u
        return {"controller": ctl, "units": units}


async def _gone_unit(unit: int) -> dict[str, Any]:
    raise PeerGoneError(f"storage unit {unit} is gone (the controller's view): not asked")


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")


def as_format(cols: dict[str, Column], format: str) -> dict[str, Column] | pa.Table:
    """``get_data``'s columns in the asked format (see :data:`FORMATS`)."""
    if format == "arrow":
        from transferqueue.arrow import to_table  # (pyarrow loads only when asked for)

        return to_table(cols)
    return cols
