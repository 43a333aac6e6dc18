"""ZeroMQ servers: the controller and the storage units as request/reply services.

Each server is a plain object on an asyncio loop: a :class:`RpcServer` in front of the same
core the embedded deployment uses (:class:`ControllerService`, :class:`StorageUnit` through a
:class:`LocalUnitLink`). Nothing here knows how it was started: ``transferqueue serve`` runs
them as processes, the Ray deployment inside actors, tests inside threads.

Message handlers check argument types before touching any state, so a malformed request is a
typed error reply and the server keeps serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq.asyncio

from transferqueue import wire
from transferqueue.controller import SPREAD_BYTES, Controller
from transferqueue.controller_service import ControllerService
from transferqueue.errors import ProtocolError
from transferqueue.links import OFFLOAD_BYTES, LocalUnitLink, column_nbytes
from transferqueue.rpc import RpcClient, RpcServer, SendThenRelease
from transferqueue.shm import SHM_DIR, Placer, Segments
from transferqueue.storage import StorageUnit

__all__ = ["PROTOCOL_VERSION", "ControllerServer", "UnitServer"]

PROTOCOL_VERSION = 1


def _indexes(args: dict[str, Any], name: str = "indexes", *, optional: bool = False) -> Any:
    value = args.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "iu":
        raise ProtocolError(f"argument {name!r} must be a 1-D integer array")
    return value.astype(np.int64, copy=False)


def _is_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _strings(args: dict[str, Any], name: str) -> list[str]:
    value = args.get(name)
    if not isinstance(value, list) or not _is_strings(value):
        raise ProtocolError(f"argument {name!r} must be a list of strings")
    return value


class UnitServer:
    """One storage unit behind a ROUTER socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        unit_id: int,
        address: str = "tcp://127.0.0.1:0",
        *,
        capacity_bytes: int | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        self.unit = StorageUnit(unit_id, capacity_bytes=capacity_bytes)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tq-unit{unit_id}")
        # Ragged values received as frames are owned by the server: adopt them, no copy.
        self.link = LocalUnitLink(self.unit, self._executor, adopt=True)
        # Arenas of clients on this host (see transferqueue.shm).
        self.segments = Segments(shm_dir)
        self.shm_writes = 0
        self.shm_reads = 0
        self.rpc = RpcServer(
            ctx, address, wire.UNIT_KINDS, self._handle, join=False, resolve=self.segments.resolve
        )
        self.address = self.rpc.address

    def start(self) -> None:
        self.rpc.start()

    async def _handle(self, kind: str, args: dict[str, Any]) -> Any:
        link = self.link
        if kind == "write":
            columns, specs = args.get("columns"), args.get("specs")
            if not isinstance(columns, dict) or not isinstance(specs, dict):
                raise ProtocolError("write needs 'columns' and 'specs' maps")
            shared = args.get("shm") is True  # views of the client's arena: copy, never adopt
            # ... unless it is a write arena (the client reuses it only when the unit holds no
            # view of it): then ragged values stay views of it, no copy.
            keep = args.get("keep") if shared else None
            if keep is not None and not isinstance(keep, str):
                raise ProtocolError("argument 'keep' of a write must be an arena name")
            self.shm_writes += shared
            try:
                return await link.write(
                    _indexes(args),
                    columns,
                    specs,
                    create=bool(args.get("create", False)),
                    adopt=(keep is not None) if shared else None,
                )
            finally:
                if keep is not None:
                    del columns, args  # (the request's views: only what the unit kept stays)
                    self.segments.seal(keep)
        if kind == "read":
            target = args.get("shm")  # the client's arena to place the rows in, if any
            if target is not None and not isinstance(target, str):
                raise ProtocolError("argument 'shm' of a read must be an arena name")
            region = None if target is None else self.segments.region(target)
            # The client's write arenas: ragged values it wrote from them go back named where
            # they are (the client views them; no copy on either side).
            mine = args.get("mine")
            if mine is not None and not _is_strings(mine):
                raise ProtocolError("argument 'mine' of a read must be a list of arena names")
            local = self.segments.kept_ranges(mine) if mine else []
            cols, pins = await link.read_pinned(_indexes(args), _strings(args, "fields"))
            release = (lambda: link.unpin(pins)) if pins else None
            if region is None and not local:
                return cols if release is None else SendThenRelease(cols, release)
            if region is None:  # no arena to copy into: the rest goes as frames
                target, region = "", np.empty(0, dtype=np.uint8)
            place = Placer(str(target), region, local=local)
            self.shm_reads += 1
            big = sum(column_nbytes(c) for c in cols.values()) >= OFFLOAD_BYTES
            return SendThenRelease(cols, release, place=place, offload=big)
        if kind == "shm_attach":
            return self.segments.attach(args.get("name"), keep=args.get("keep") is True)  # type: ignore[arg-type]
        if kind == "shm_detach":
            return self.segments.detach(args.get("name"))  # type: ignore[arg-type]
        if kind == "free":
            return await link.free(_indexes(args))
        if kind == "clear":
            return await link.clear()
        if kind == "reset":  # data and counters; attached arenas stay valid
            self.shm_writes = self.shm_reads = 0
            return await link.reset()
        stats = await link.stats()
        stats.update(
            shm_arenas=len(self.segments), shm_writes=self.shm_writes, shm_reads=self.shm_reads
        )
        return stats

    async def close(self) -> None:
        await self.rpc.close()
        self._executor.shutdown(wait=False)


class ControllerServer:
    """The controller behind a ROUTER socket; it frees payload on the units it knows."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        unit_addresses: Sequence[str],
        address: str = "tcp://127.0.0.1:0",
        *,
        capacity_rows: int | None = None,
        spread_bytes: int = SPREAD_BYTES,
    ) -> None:
        if not unit_addresses:
            raise ValueError("a controller needs at least one storage unit address")
        self.unit_addresses = list(unit_addresses)
        self._units = [RpcClient(ctx, a) for a in self.unit_addresses]
        self.service = ControllerService(
            Controller(len(self._units), capacity_rows=capacity_rows, spread_bytes=spread_bytes),
            self._free_rows,
        )
        self.rpc = RpcServer(ctx, address, wire.CONTROLLER_KINDS, self._handle)
        self.address = self.rpc.address

    async def start(self) -> None:
        await self.service.start()
        self.rpc.start()

    async def _free_rows(self, unit_id: int, indexes: np.ndarray) -> None:
        await self._units[unit_id].call("free", {"indexes": indexes})

    def _handle(self, kind: str, args: dict[str, Any]) -> Any:
        """The answer, or a coroutine producing it when the request must wait."""
        if kind == "hello":
            return {"protocol": PROTOCOL_VERSION, "units": self.unit_addresses}
        if kind == "reset":
            return self._reset()
        if args.get("indexes") is not None:
            args["indexes"] = _indexes(args, "indexes")
        try:
            done, result = self.service.call_now(kind, args)
            if done:
                return result
            return getattr(self.service, kind)(**args)
        except TypeError as e:
            if "argument" in str(e):
                raise ProtocolError(f"bad arguments for {kind!r}: {e}") from None
            raise

    async def _reset(self) -> None:
        await self.service.reset()
        await asyncio.gather(*(u.call("reset") for u in self._units))

    async def close(self) -> None:
        await self.rpc.close()
        await self.service.close()
        for u in self._units:
            await u.close()
