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
from transferqueue.links import LocalUnitLink
from transferqueue.rpc import RpcClient, RpcServer, SendThenRelease
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


def _strings(args: dict[str, Any], name: str) -> list[str]:
    value = args.get(name)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
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
    ) -> None:
        self.unit = StorageUnit(unit_id, capacity_bytes=capacity_bytes)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tq-unit{unit_id}")
        # Ragged values received as frames are owned by the server: adopt them, no copy.
        self.link = LocalUnitLink(self.unit, self._executor, adopt=True)
        self.rpc = RpcServer(ctx, address, wire.UNIT_KINDS, self._handle, join=False)
        self.address = self.rpc.address

    def start(self) -> None:
        self.rpc.start()

    async def _handle(self, kind: str, args: dict[str, Any]) -> Any:
        link = self.link
        if kind == "write":
            columns, specs = args.get("columns"), args.get("specs")
            if not isinstance(columns, dict) or not isinstance(specs, dict):
                raise ProtocolError("write needs 'columns' and 'specs' maps")
            return await link.write(
                _indexes(args), columns, specs, create=bool(args.get("create", False))
            )
        if kind == "read":
            cols, pins = await link.read_pinned(_indexes(args), _strings(args, "fields"))
            if not pins:
                return cols
            return SendThenRelease(cols, lambda: link.unpin(pins))
        if kind == "free":
            return await link.free(_indexes(args))
        if kind == "clear":
            return await link.clear()
        if kind == "reset":
            return await link.reset()
        return await link.stats()

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
