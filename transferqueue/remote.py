"""Connecting to a running TransferQueue service over ZeroMQ.

``connect(address)`` asks the controller for its storage units, opens one long-lived socket
per server, and returns the same :class:`TransferQueue` handle as the embedded deployment:
client code does not change with the deployment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from transferqueue.errors import PeerGoneError, ProtocolError
from transferqueue.handle import TransferQueue
from transferqueue.links import UnitLink
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.rpc import DEFAULT_CALL_TIMEOUT_S, RpcClient
from transferqueue.schema import Column, FieldSpec
from transferqueue.server import PROTOCOL_VERSION

__all__ = ["RemoteControllerLink", "RemoteUnitLink", "connect"]

# A blocking get_meta waits on the server in slices of this length, so that a controller that
# died is noticed within a slice plus the call timeout, never never.
WAIT_SLICE_S = 20.0
_FOREVER_S = 10 * 365 * 86400.0


class RemoteControllerLink:
    """ControllerLink over ZeroMQ."""

    def __init__(self, rpc: RpcClient) -> None:
        self.rpc = rpc

    async def register_fields(self, specs: Mapping[str, FieldSpec]) -> dict[str, FieldSpec]:
        result = await self.rpc.call("register_fields", {"specs": dict(specs)})
        return _specs(result)

    async def get_specs(self) -> dict[str, FieldSpec]:
        return _specs(await self.rpc.call("get_specs"))

    async def allocate(
        self,
        n: int,
        partition: str,
        *,
        groups: np.ndarray | int | None = None,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        timeout_s: float | None = None,
        nbytes: int | None = None,
    ) -> BatchMeta:
        # Waiting for capacity has no natural bound when timeout_s is None.
        wait = _FOREVER_S if timeout_s is None else timeout_s + self.rpc.call_timeout_s
        args = {
            "n": n,
            "partition": partition,
            "groups": groups,
            "versions": versions,
            "lengths": lengths,
            "timeout_s": timeout_s,
            "nbytes": nbytes,
        }
        return _meta(await self.rpc.call("allocate", args, wait_s=wait))

    async def discard(self, indexes: np.ndarray) -> None:
        await self.rpc.call("discard", {"indexes": indexes})

    async def commit(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        *,
        versions: np.ndarray | int | None = None,
        lengths: np.ndarray | int | None = None,
        lease_id: int | None = None,
    ) -> None:
        await self.rpc.call(
            "commit",
            {
                "indexes": indexes,
                "fields": list(fields),
                "versions": versions,
                "lengths": lengths,
                "lease_id": lease_id,
            },
        )

    async def get_meta(
        self,
        *,
        task: str,
        partition: str,
        fields: Sequence[str] | None,
        batch_size: int,
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        sampler_options: Mapping[str, Any] | None = None,
        min_version: int | None = None,
        max_group: int | None = None,
    ) -> BatchMeta:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + max(0.0, timeout_s)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            last = remaining is not None and remaining <= WAIT_SLICE_S
            wait = remaining if last else WAIT_SLICE_S
            assert wait is not None
            meta = _meta(
                await self.rpc.call(
                    "get_meta",
                    {
                        "task": task,
                        "partition": partition,
                        "fields": None if fields is None else list(fields),
                        "batch_size": batch_size,
                        "timeout_s": wait,
                        "lease_s": lease_s,
                        "sampler": sampler,
                        "sampler_options": dict(sampler_options or {}),
                        "min_version": min_version,
                        "max_group": max_group,
                        "partial": last,
                    },
                    wait_s=wait + self.rpc.call_timeout_s,
                )
            )
            if last or len(meta) or meta.reason != "timeout":
                return meta

    async def ack(self, lease_id: int, indexes: np.ndarray | None = None) -> None:
        await self.rpc.call("ack", {"lease_id": lease_id, "indexes": indexes})

    async def release(self, lease_id: int, indexes: np.ndarray | None = None) -> None:
        await self.rpc.call("release", {"lease_id": lease_id, "indexes": indexes})

    async def renew(self, lease_id: int, lease_s: float, indexes: np.ndarray | None = None) -> None:
        await self.rpc.call("renew", {"lease_id": lease_id, "lease_s": lease_s, "indexes": indexes})

    async def declare_tasks(self, partition: str, tasks: Sequence[str]) -> None:
        await self.rpc.call("declare_tasks", {"partition": partition, "tasks": list(tasks)})

    async def finish(self, partition: str) -> None:
        await self.rpc.call("finish", {"partition": partition})

    async def clear(self, partition: str | None = None) -> None:
        await self.rpc.call("clear", {"partition": partition})

    async def stats(self) -> dict[str, Any]:
        result = await self.rpc.call("stats")
        assert isinstance(result, dict)
        return result

    async def reset(self) -> None:
        await self.rpc.call("reset")


class RemoteUnitLink(UnitLink):
    """UnitLink over ZeroMQ: columns travel as out-of-band frames."""

    def __init__(self, unit_id: int, rpc: RpcClient) -> None:
        self.unit_id = unit_id
        self.rpc = rpc

    async def write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
    ) -> None:
        await self.rpc.call(
            "write",
            {
                "indexes": indexes,
                "columns": dict(columns),
                "specs": {k: specs[k] for k in columns},
                "create": create,
            },
        )

    async def read(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Column]:
        result = await self.rpc.call("read", {"indexes": indexes, "fields": list(fields)})
        if not isinstance(result, dict):
            raise ProtocolError(f"unit {self.unit_id} answered a read with {type(result)}")
        return result

    async def free(self, indexes: np.ndarray) -> None:
        await self.rpc.call("free", {"indexes": indexes})

    async def clear(self) -> None:
        await self.rpc.call("clear")

    async def stats(self) -> dict[str, Any]:
        result = await self.rpc.call("stats")
        assert isinstance(result, dict)
        return result

    async def reset(self) -> None:
        await self.rpc.call("reset")


def _specs(value: Any) -> dict[str, FieldSpec]:
    if not isinstance(value, dict) or not all(isinstance(v, FieldSpec) for v in value.values()):
        raise ProtocolError("expected a map of field specs")
    return value


def _meta(value: Any) -> BatchMeta:
    if not isinstance(value, BatchMeta):
        raise ProtocolError(f"expected a BatchMeta, got {type(value).__name__}")
    return value


def connect(
    address: str,
    *,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    connect_timeout_s: float = 10.0,
) -> TransferQueue:
    """Connect to a TransferQueue service (``transferqueue serve`` prints its address)."""
    io = LoopThread("transferqueue-client")
    ctx = zmq.asyncio.Context()
    rpcs: list[RpcClient] = []

    async def setup() -> tuple[RemoteControllerLink, list[RemoteUnitLink]]:
        ctl = RpcClient(ctx, address, call_timeout_s=call_timeout_s)
        rpcs.append(ctl)
        try:
            hello = await ctl.call("hello", wait_s=connect_timeout_s)
        except PeerGoneError:
            raise PeerGoneError(
                f"no TransferQueue controller answered at {address} within "
                f"{connect_timeout_s} s; start one with `transferqueue serve`"
            ) from None
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolError(f"{address} speaks protocol {hello!r}, expected {PROTOCOL_VERSION}")
        units = []
        for uid, addr in enumerate(hello["units"]):
            rpc = RpcClient(ctx, addr, call_timeout_s=call_timeout_s)
            rpcs.append(rpc)
            units.append(RemoteUnitLink(uid, rpc))
        return RemoteControllerLink(ctl), units

    async def teardown() -> None:
        for rpc in rpcs:
            await rpc.close()

    def close_sockets() -> None:
        if not io.closed:
            io.run(teardown(), timeout=10)
        ctx.term()

    try:
        ctl_link, unit_links = io.run(setup())
    except BaseException:
        close_sockets()
        io.close()
        raise
    return TransferQueue(
        io, ctl_link, unit_links, closers=[close_sockets], address=address, mode="remote"
    )
