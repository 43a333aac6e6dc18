"""Links: how a client reaches the controller and the storage units.

The client is written once against two small interfaces. In the embedded deployment the links
call the objects in this process; over ZeroMQ they send messages to the servers. Every link
method runs on the client's I/O loop.

| link            | embedded                          | service (ZeroMQ)              |
|-----------------|-----------------------------------|-------------------------------|
| ControllerLink  | :class:`LocalControllerLink`      | RPC to the controller server  |
| UnitLink        | :class:`LocalUnitLink`            | RPC to a storage unit server  |
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from transferqueue import messages as m
from transferqueue.chunked import ChunkedTensor
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.storage import StorageUnit

__all__ = [
    "ControllerLink",
    "LocalControllerLink",
    "LocalUnitLink",
    "Staged",
    "UnitLink",
    "column_nbytes",
]

T = TypeVar("T")
R = TypeVar("R")

# Payloads above this are copied on a worker thread so the I/O loop keeps serving requests.
# Below it the copy (at most a few ms) is cheaper than the hand-off to a thread: moving the
# bound from 1 MiB to 16 MiB took 0.2-0.3 ms off each 4.5 MB put through a storage unit.
OFFLOAD_BYTES = 16 << 20


class ControllerLink(Protocol):
    """The controller: one method, ``call``, for every message kind it takes (declared in
    :mod:`transferqueue.messages`; the reply has the kind's declared type)."""

    async def call(self, msg: m.ControllerRequest[R]) -> R: ...


class LocalControllerLink:
    """The controller in this process: messages go straight to the service's handlers, with
    no encoding (the embedded deployment)."""

    def __init__(self, service: object) -> None:
        self._handlers = m.handlers("controller", service)

    async def call(self, msg: m.ControllerRequest[R]) -> R:
        return await m.dispatch(self._handlers, msg, m.TRUSTED)


@dataclass
class Staged:
    """A put's columns copied to where a link sends them from, before the put's rows are
    known (see :meth:`UnitLink.stage`); ``columns`` are views of that memory."""

    columns: dict[str, Column]
    nbytes: int  # tensor payload of the columns
    token: Any  # the link's own record of where they lie


class UnitLink(ABC):
    """One storage unit, as seen from a client."""

    unit_id: int
    supports_out: bool = False
    """True when ``read`` can gather straight into caller-provided dense buffers."""
    lends_reads: bool = False
    """True when ``read`` (without ``out``) may return views of memory the link lends to the
    result, with no copy on the client side: a batch from this unit alone is best read so."""

    @abstractmethod
    async def write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
        grant: bytes | None = None,
    ) -> None:
        """Store columns of rows; ``create`` new rows, under the controller's ``grant`` for
        this unit (from ``BatchMeta.grants``)."""

    def stages(self, nbytes: int) -> bool:
        """Whether :meth:`stage` may take a put of ``nbytes`` of tensors."""
        return False

    async def stage(self, columns: Mapping[str, Column]) -> Staged | None:
        """Copy a put's columns to where this link will send them from, while the put's rows
        are still being allocated (the copy overlaps that round trip). Then either
        :meth:`write_staged` or :meth:`unstage`. None: this link gains nothing by it."""
        return None

    async def write_staged(
        self,
        indexes: np.ndarray,
        staged: Staged,
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
        grant: bytes | None = None,
    ) -> None:
        """``write`` of the columns :meth:`stage` returned."""
        await self.write(indexes, staged.columns, specs, create=create, grant=grant)

    def unstage(self, staged: Staged) -> None:  # noqa: B027 (nothing to give back here)
        """Give back what :meth:`stage` took, unwritten."""

    @abstractmethod
    async def read(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Column]: ...

    @abstractmethod
    async def free(self, indexes: np.ndarray, grant: bytes | None = None) -> None: ...

    @abstractmethod
    async def clear(self) -> None: ...

    @abstractmethod
    async def stats(self) -> dict[str, Any]: ...

    @abstractmethod
    async def reset(self) -> None: ...


def column_nbytes(col: Column | ChunkedTensor) -> int:
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    if isinstance(col, Ragged | ChunkedTensor):
        return col.nbytes
    return 0


class LocalUnitLink(UnitLink):
    """A storage unit in this process. Large copies run on ``executor`` threads; an asyncio
    lock serializes access to the unit, which is a plain single-threaded object."""

    supports_out = True

    def __init__(self, unit: StorageUnit, executor: Executor, *, adopt: bool = False) -> None:
        self.unit = unit
        self.unit_id = unit.unit_id
        # A server link: ragged writes keep the received frames as they are, and reads may
        # return views of stored segments (they are only sent on, never handed to user code).
        self.adopt = adopt
        self._executor = executor
        self._lock = asyncio.Lock()

    async def _run(self, nbytes: int, fn: Callable[[], T]) -> T:
        async with self._lock:
            if nbytes < OFFLOAD_BYTES:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def write(
        self,
        indexes: np.ndarray,
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
        *,
        create: bool,
        grant: bytes | None = None,
        adopt: bool | None = None,
    ) -> None:
        # (a unit in this process trusts its caller: no grant is checked)
        # An adopting (server) unit keeps ragged frames as they are: only dense data is copied.
        # ``adopt=False`` overrides that for buffers the unit does not own (shared memory).
        keep = self.adopt if adopt is None else adopt
        nbytes = sum(
            column_nbytes(c) for c in columns.values() if not (keep and isinstance(c, Ragged))
        )
        await self._run(
            nbytes,
            lambda: self.unit.write(indexes, columns, specs, create=create, adopt=keep),
        )

    async def read(
        self,
        indexes: np.ndarray,
        fields: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, Column]:
        nbytes = sum(column_nbytes(t) for t in out.values()) if out else 0
        nbytes = max(nbytes, OFFLOAD_BYTES if len(indexes) * len(fields) > 4096 else 0)
        return await self._run(
            nbytes, lambda: self.unit.read(indexes, fields, out, share=self.adopt)
        )

    async def read_pinned(
        self, indexes: np.ndarray, fields: Sequence[str]
    ) -> tuple[dict[str, Column], list[int]]:
        """Like ``read``, but dense runs come back as views of the unit's buffers, pinned
        until :meth:`unpin` (for a server that sends them without a copy)."""
        pins: list[int] = []
        # Views cost nothing; only scattered dense rows are gathered (then off the loop).
        nbytes = OFFLOAD_BYTES if len(indexes) * len(fields) > 4096 else 0
        cols = await self._run(
            nbytes, lambda: self.unit.read(indexes, fields, share=True, pin=pins)
        )
        return cols, pins

    async def unpin(self, pins: Sequence[int]) -> None:
        def release() -> None:
            for p in pins:
                self.unit.unpin(p)

        await self._run(0, release)

    async def free(self, indexes: np.ndarray, grant: bytes | None = None) -> None:
        await self._run(0, lambda: self.unit.free(indexes))

    async def clear(self) -> None:
        await self._run(0, self.unit.clear)

    async def inventory(self) -> np.ndarray:
        """The indexes of every row the unit holds."""
        return await self._run(0, self.unit.indexes)

    async def stats(self) -> dict[str, Any]:
        return await self._run(0, self.unit.stats)

    async def reset(self) -> None:
        await self._run(0, self.unit.reset)
