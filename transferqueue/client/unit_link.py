"""``RemoteUnitLink``: the client's link to one storage unit over ZeroMQ.

Column buffers go as out-of-band frames, or, where the unit runs on this host, through
shared-memory arenas (:mod:`transferqueue.storage.shm`). Made by
:func:`transferqueue.deploy.connect.connect`, one per unit of the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from transferqueue.client.links import OFFLOAD_BYTES, UnitLink, column_nbytes, placed_whole
from transferqueue.errors import (
    ClosedError,
    PeerGoneError,
    ProtocolError,
    TQError,
    UnknownArenaError,
)
from transferqueue.memcpy import copy_bytes
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.storage.shm import (
    SHM_DIR,
    WRITE_HEADER,
    Arena,
    Loan,
    Placer,
    ReadArenas,
    WriteArenas,
    align,
    new_token,
    shm_available,
)
from transferqueue.wire import messages as m
from transferqueue.wire.codec import SHM_MIN_BYTES
from transferqueue.wire.rpc import RpcClient

__all__ = ["SHM_MAX_BYTES", "RemoteUnitLink"]

R = TypeVar("R")

SHM_MAX_BYTES = 1 << 30  # default bound of one client's arena with one unit
_ARENA_MIN_BYTES = 16 << 20
# Read arenas are sized to the read (a power of two): a result kept alive keeps its arena.
_READ_ARENA_MIN_BYTES = 1 << 20
# Ragged writes at least this large go through write arenas (the unit keeps their values).
_WRITE_ARENA_MIN_BYTES = 1 << 20
_SLACK_PER_BUFFER = 64  # alignment padding per placed buffer

log = logging.getLogger(__name__)


@dataclass
class _Staged:
    """A put's columns copied into a write arena before its rows were known: ``columns``
    view the arena's first ``used`` bytes (small buffers stay where they were)."""

    columns: dict[str, Column]
    nbytes: int  # tensor payload of the columns
    arena: Arena
    used: int


def _write_need(columns: Mapping[str, Column], nbytes: int) -> int:
    """Arena bytes a write of ``columns`` (``nbytes`` of tensors) may take, padding included."""
    return nbytes + _SLACK_PER_BUFFER * 2 * len(columns)


class RemoteUnitLink(UnitLink):
    """UnitLink over ZeroMQ: columns travel as out-of-band frames, or through a
    shared-memory arena when the unit is on this host (see :mod:`transferqueue.storage.shm`).

    ``shm_max_bytes`` bounds the request arena, the read arenas together and the write arenas
    together (0: never share memory with this unit). A transfer larger than the bound, or one
    that finds the request arena in use by another request, goes as frames. A read lands in
    an arena lent to it and returns views of it (no copy here) while one is free or fits the
    bound; otherwise it lands in the request arena and is copied out. A write with ragged
    columns goes into a write arena the unit keeps its ragged values in (no copy there) until
    the rows are freed (see :class:`~transferqueue.storage.shm.WriteArenas`); without a free one
    within the bound it goes through the request arena, and the unit copies. A read of ragged
    rows this client wrote from a write arena gets them named in that arena and returns
    copy-on-write views of it (:meth:`~transferqueue.storage.shm.WriteArenas.view`): no copy at all.
    A put likely to land on this unit is copied into a write arena while its rows are
    allocated (:meth:`write_new`).
    """

    def __init__(self, unit_id: int, rpc: RpcClient, *, shm_max_bytes: int = SHM_MAX_BYTES):
        self.unit_id = unit_id
        self.rpc = rpc
        self.shm_dir = SHM_DIR
        self.shm_max_bytes = shm_max_bytes if shm_available(self.shm_dir) else 0
        self._token = new_token()
        self._generation = 0
        self._arena: Arena | None = None
        self._growing = False
        self._read_hint = 0  # bytes the last read of this unit returned
        # Arenas lent to reads: the result's tensors view them (see ReadArenas).
        self._reads = ReadArenas(self.shm_max_bytes)
        # Arenas ragged writes are placed in; the unit keeps their values as views of them
        # until the rows are gone (see WriteArenas).
        self._writes = WriteArenas(self.shm_max_bytes)
        self._creating = asyncio.Lock()
        self.staged_writes = 0  # puts copied into a write arena while their rows were allocated
        self.arenas_forgotten = 0  # times the unit no longer knew this client's arenas
        rpc.resolve = self._resolve

    @property
    def supports_out(self) -> bool:  # type: ignore[override]
        # Through shared memory, a read copies once anyway: straight into the batch.
        return self.shm_max_bytes > 0

    @property
    def arena_bytes(self) -> int:
        """Size of the shared-memory arena with this unit (0: none)."""
        return 0 if self._arena is None else self._arena.size

    @property
    def lends_reads(self) -> bool:  # type: ignore[override]
        """Whether a read may return views of shared memory (no copy on this side)."""
        return self.shm_max_bytes > 0

    def _resolve(self, name: str, offset: int, nbytes: int) -> memoryview:
        loan = self._reads.loan(name)
        if loan is not None:
            return loan.view(offset, nbytes)
        mine = self._writes.view(name, offset, nbytes)  # rows this client wrote
        if mine is not None:
            return mine
        if self._arena is None:
            raise ProtocolError(f"reply names shared-memory arena {name!r}; none is attached")
        return self._arena.resolve(name, offset, nbytes)

    async def _acquire(self, nbytes: int) -> Arena | None:
        """The arena, reserved for one request, holding at least ``nbytes``; None: frames."""
        if nbytes < SHM_MIN_BYTES or nbytes > self.shm_max_bytes:
            return None
        arena = self._arena
        if self._growing or (arena is not None and arena.busy):
            return None  # in use, or being replaced: this request sends frames
        if arena is None or arena.size < nbytes:
            self._growing = True
            try:
                arena = await self._grow(nbytes)
            finally:
                self._growing = False
            if arena is None:
                return None
        arena.busy = True
        return arena

    async def _grow(self, nbytes: int) -> Arena | None:
        size = self._arena_size(nbytes, _ARENA_MIN_BYTES)
        self._generation += 1
        # (no request can take it meanwhile: _acquire sees _growing)
        arena = await self._attach(self._token, self._generation, size)
        if arena is None:
            self.shm_max_bytes = 0
            self._reads.max_bytes = self._writes.max_bytes = 0
            return None
        if self._arena is not None:
            self._arena.close()
        self._arena = arena
        return arena

    def _arena_size(self, nbytes: int, minimum: int) -> int:
        """The next power of two holding ``nbytes``, at least ``minimum``, within the bound."""
        return min(max(minimum, 1 << (nbytes - 1).bit_length()), self.shm_max_bytes)

    async def _attach(
        self, token: str, generation: int, size: int, *, keep: bool = False
    ) -> Arena | None:
        """A new arena, mapped by the unit; None (logged) if it cannot be made or shared.
        ``keep``: a write arena (the unit may keep views of it)."""
        try:
            arena = Arena(token, generation, size, self.shm_dir, private=keep)
        except OSError as e:
            log.warning("no shared memory with unit %d (%s); sending frames", self.unit_id, e)
            return None
        try:
            await self.rpc.call(m.ShmAttach(name=arena.name, keep=keep, pid=os.getpid()))
        except TQError as e:
            arena.close()
            log.info("unit %d shares no memory with this client (%s)", self.unit_id, e)
            self.shm_max_bytes = 0  # it cannot see this client's arenas: frames from now on
            return None
        except BaseException:
            arena.close()
            raise
        arena.unlink()  # the unit has mapped it; the name is no longer needed
        return arena

    async def _borrow(self, nbytes: int) -> Loan | None:
        """An arena of at least ``nbytes`` lent to one read; None: no room (copy instead)."""
        if nbytes < SHM_MIN_BYTES or nbytes > self.shm_max_bytes:
            return None
        loan = self._reads.lend(nbytes)
        if loan is None:
            size = self._arena_size(nbytes, _READ_ARENA_MIN_BYTES)
            async with self._creating:  # one at a time: the bound counts every arena made
                if self._reads.room_for(size):
                    await self._detach_retired()
                    arena = await self._attach(new_token(), 1, size)
                    if arena is None:  # (logged) reads copy from now on
                        self._reads.max_bytes = 0
                    else:
                        loan = self._reads.add(arena)
        await self._detach_retired()
        return loan

    async def _lend_write(self, nbytes: int) -> Arena | None:
        """A write arena with ``nbytes`` of room, lent to one write; None: no room (the write
        goes through the request arena, and the unit copies)."""
        if nbytes < _WRITE_ARENA_MIN_BYTES or nbytes + WRITE_HEADER > self.shm_max_bytes:
            return None
        arena = self._writes.lend(nbytes)
        if arena is None:
            size = self._arena_size(nbytes + WRITE_HEADER, _READ_ARENA_MIN_BYTES)
            async with self._creating:  # one at a time: the bound counts every arena made
                if self._writes.room_for(size):
                    await self._detach_retired()
                    made = await self._attach(new_token(), 1, size, keep=True)
                    if made is None:  # (logged) writes are copied from now on
                        self._writes.max_bytes = 0
                    else:
                        arena = self._writes.add(made)
        return arena

    async def _detach_retired(self) -> None:
        for arena in self._reads.retired() + self._writes.retired():
            with contextlib.suppress(TQError):
                await self.rpc.call(m.ShmDetach(name=arena.name), wait_s=2.0)
            arena.close()

    def _done(self, arena: Arena, ok: bool) -> None:
        arena.busy = False
        if not ok and arena is self._arena:
            # The unit may still touch the arena (a request that timed out): never reuse it.
            self._arena = None
            arena.close()

    def _forget_arenas(self) -> None:
        """The unit does not know this client's arenas (it restarted since they were
        attached): drop them all; the next transfers attach new ones. Results and staged
        puts that view them keep their own mappings."""
        arena, self._arena = self._arena, None
        dropped = self._reads.reset() + self._writes.reset()
        if arena is not None and not arena.busy:  # (a busy one closes when its request ends)
            dropped.append(arena)
        for a in dropped:
            a.close()
        self.arenas_forgotten += 1

    async def write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
        grant: bytes | None = None,
    ) -> None:
        try:
            await self._write(indexes, columns, specs, create=create, grant=grant)
        except UnknownArenaError:  # (the unit applied nothing)
            self._forget_arenas()
            await self._write(indexes, columns, specs, create=create, grant=grant)

    async def _write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
        grant: bytes | None = None,
    ) -> None:
        msg = m.Write(
            indexes=indexes,
            columns=dict(columns),
            specs={k: specs[k] for k in columns},
            create=create,
            grant=grant,
        )
        nbytes = sum(column_nbytes(c) for c in columns.values())
        need = _write_need(columns, nbytes)
        if any(isinstance(c, Ragged) for c in columns.values()):
            kept = await self._lend_write(need)
            if kept is not None:
                await self._write_kept(kept, msg, nbytes)
                return
        arena = await self._acquire(need)
        if arena is None:
            await self.rpc.call(msg)
            return
        ok = False
        try:
            msg.shm = True
            place = Placer(arena.name, arena.buf)
            await self.rpc.call(msg, place=place, offload=nbytes >= OFFLOAD_BYTES)
            ok = True
        except TQError as e:
            ok = _answered(e)  # the unit answered: it is done with the arena
            raise
        finally:
            self._done(arena, ok)

    async def write_new(
        self,
        placing: Awaitable[BatchMeta],
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
    ) -> bool:
        """A put likely to land here (see :meth:`UnitLink.write_new`): its ragged columns
        are copied into a write arena while the rows are allocated (``staged_writes``), then
        written from there; if the rows land elsewhere, the arena is given back unwritten."""
        staged = await self._stage(columns)
        try:
            new = await placing
        except BaseException:
            if staged is not None:
                self._writes.unlend(staged.arena)
            raise
        if not placed_whole(new, self.unit_id):
            if staged is not None:
                self._writes.unlend(staged.arena)
            return False
        grant = (new.grants or {}).get(self.unit_id)
        if staged is None:
            await self.write(new.indexes, columns, specs, create=True, grant=grant)
            return True
        self.staged_writes += 1
        msg = m.Write(
            indexes=new.indexes,
            columns=staged.columns,
            specs={k: specs[k] for k in staged.columns},
            create=True,
            grant=grant,
        )
        try:
            await self._write_kept(staged.arena, msg, staged.nbytes, staged=staged.used)
        except UnknownArenaError:  # (the staged columns still view the arena's memory)
            self._forget_arenas()
            await self._write(new.indexes, staged.columns, specs, create=True, grant=grant)
        return True

    async def _stage(self, columns: Mapping[str, Column]) -> _Staged | None:
        """A ragged put's tensors copied into a write arena; None when the put would not go
        through one, or none is free within the bound."""
        if self._writes.max_bytes <= 0 or not any(isinstance(c, Ragged) for c in columns.values()):
            return None
        nbytes = sum(column_nbytes(c) for c in columns.values())
        if nbytes < _WRITE_ARENA_MIN_BYTES:
            return None
        # (the unit may still hold the last put's rows: then a second arena is made, once)
        arena = await self._lend_write(_write_need(columns, nbytes))
        if arena is None:
            return None
        region = arena.buf[WRITE_HEADER:]
        used = 0

        def into_arena(t: torch.Tensor) -> torch.Tensor:
            nonlocal used
            n = t.numel() * t.element_size()
            if n < SHM_MIN_BYTES:
                return t  # small: it goes as a frame, as any small buffer does
            dst = region[used : used + n]
            if t.device.type == "cpu" and t.is_contiguous():  # (numpy: one plain memcpy)
                copy_bytes(dst, t.reshape(-1).view(torch.uint8).numpy())
                out = torch.from_numpy(dst).view(t.dtype).view(t.shape)
            else:
                out = torch.from_numpy(dst).view(t.dtype).view(t.shape)
                out.copy_(t)
            used = align(used + n)
            return out

        staged: dict[str, Column] = {}
        for name, col in columns.items():
            if isinstance(col, Ragged):
                staged[name] = col.with_values(into_arena(col.values))
            elif isinstance(col, torch.Tensor):
                staged[name] = into_arena(col)
            else:
                staged[name] = col
        return _Staged(staged, nbytes, arena, used)

    async def _write_kept(
        self, arena: Arena, msg: m.Write, nbytes: int, *, staged: int = 0
    ) -> None:
        """A write placed in a write arena; the unit clears the arena's flag once it holds
        no view of it, and only then is the arena lent again. ``staged``: bytes at the
        start of the arena's region already holding the columns' buffers (they are named
        where they lie; other buffers are placed after them)."""
        msg.shm = True
        msg.keep = arena.name
        base = WRITE_HEADER + staged
        local = [(arena.name, arena.buf.ctypes.data, arena.size)] if staged else []
        place = Placer(arena.name, arena.buf[base:], base=base, local=local)
        try:
            # (buffers staged already are named where they lie: only the rest is copied)
            await self.rpc.call(msg, place=place, offload=nbytes - staged >= OFFLOAD_BYTES)
        except TQError:
            # The unit may not clear the flag of a request it could not read (or that got no
            # answer): never lend this arena again.
            self._writes.retire(arena)
            raise

    async def read(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Column]:
        msg = m.Read(indexes=indexes, fields=list(fields))
        # Rows this client wrote through write arenas come back as views of them (no copy on
        # either side); the arenas stay held until the reply is in (and then by the views).
        pinned = self._writes.pin()
        if pinned:
            msg.mine = [a.name for a in pinned]
        try:
            try:
                return await self._read(msg, out)
            except UnknownArenaError:
                self._forget_arenas()
                msg.mine = []
                return await self._read(msg, out)
        finally:
            self._writes.unpin(pinned)

    async def _read(self, msg: m.Read, out: Mapping[str, torch.Tensor] | None) -> dict[str, Column]:
        want = max(sum(t.numel() * t.element_size() for t in (out or {}).values()), 0)
        loan = await self._borrow(max(want, self._read_hint))
        if loan is not None:  # the rows land in an arena lent to this read: no copy here
            answered = False
            try:
                msg.shm = loan.arena.name
                result = _columns(await self.rpc.call(msg), self.unit_id)
                answered = True
            except TQError as e:
                answered = _answered(e)
                raise
            finally:
                loan.seal(reusable=answered)
            self._read_hint = _tensor_bytes(result)
            return _into(result, out, copy=False) if out else result
        arena = await self._acquire(max(want, self._read_hint))
        if arena is None:
            result = _columns(await self.rpc.call(msg), self.unit_id)
            self._read_hint = _tensor_bytes(result)
            return _into(result, out, copy=False) if out else result
        ok = False
        try:
            msg.shm = arena.name
            result = _columns(await self.rpc.call(msg), self.unit_id)
            self._read_hint = _tensor_bytes(result)
            # Views of the arena must be copied out before the arena serves another request.
            if self._read_hint >= OFFLOAD_BYTES:
                result = await asyncio.to_thread(_into, result, out, copy=True)
            else:
                result = _into(result, out, copy=True)
            ok = True
            return result
        except TQError as e:
            ok = _answered(e)
            raise
        finally:
            self._done(arena, ok)

    async def close(self) -> None:
        arena, self._arena = self._arena, None
        arenas = self._reads.close() + self._writes.close() + ([] if arena is None else [arena])
        for a in arenas:
            with contextlib.suppress(TQError):
                await self.rpc.call(m.ShmDetach(name=a.name), wait_s=2.0)
            a.close()

    async def free(self, indexes: np.ndarray, grant: bytes | None = None) -> None:
        await self.rpc.call(m.Free(indexes=indexes, grant=grant))

    async def clear(self) -> None:
        await self.rpc.call(m.ClearUnit())

    async def stats(self) -> dict[str, Any]:
        return await self.rpc.call(m.UnitStats())

    async def reset(self) -> None:
        await self.rpc.call(m.ResetUnit())


def _answered(e: TQError) -> bool:
    """Whether the unit answered the request that failed with ``e`` (and so is done with any
    arena it named). A call that timed out or was closed may still be served later."""
    return not isinstance(e, PeerGoneError | ClosedError)


def _columns(value: Any, unit_id: int) -> dict[str, Column]:
    if not isinstance(value, dict):
        raise ProtocolError(f"unit {unit_id} answered a read with {type(value).__name__}")
    return value


def _tensor_bytes(cols: Mapping[str, Column]) -> int:
    return sum(column_nbytes(c) for c in cols.values())


def _into(
    cols: dict[str, Column], out: Mapping[str, torch.Tensor] | None, *, copy: bool
) -> dict[str, Column]:
    """Dense columns copied into ``out`` where given; with ``copy``, every other tensor is
    copied too (it may be a view of the shared-memory arena)."""
    result: dict[str, Column] = {}
    for name, col in cols.items():
        dst = None if out is None else out.get(name)
        if isinstance(col, torch.Tensor):
            if dst is not None and dst.shape == col.shape:
                dst.copy_(col)
                result[name] = dst
            else:
                result[name] = col.clone() if copy else col
        elif isinstance(col, Ragged) and copy:
            result[name] = col.clone()
        else:
            result[name] = col
    return result
