"""The links of a client to a controller and storage units in this process.

The embedded deployment (:mod:`transferqueue.deploy.embedded`) links its clients to the
controller service and the units it made; a storage unit server (:mod:`transferqueue.deploy.server`)
drives its unit through a :class:`LocalUnitLink` too (``adopt=True``: received frames are kept
as they are). Messages go straight to the handlers, with no encoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, TypeVar

import numpy as np
import torch

from transferqueue.client.links import OFFLOAD_BYTES, UnitLink, column_nbytes
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.storage.unit import StorageUnit
from transferqueue.wire import protocol

__all__ = ["LocalControllerLink", "LocalUnitLink"]

T = TypeVar("T")
R = TypeVar("R")


class LocalControllerLink:
    """The controller in this process: messages go straight to the service's handlers, with
    no encoding (the embedded deployment)."""

    def __init__(self, *handlers: object) -> None:
        """``handlers``: the objects answering the controller's message kinds
        (:func:`transferqueue.controller.handlers.handlers`)."""
        self._handlers = protocol.handlers("controller", *handlers)

    async def call(self, msg: protocol.ControllerRequest[R]) -> R:
        return await protocol.dispatch(self._handlers, msg, protocol.TRUSTED)


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
