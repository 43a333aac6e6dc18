"""Links: how a client reaches the controller and the storage units.

The client is written once against two small interfaces. In the embedded deployment the links
call the objects in this process; over ZeroMQ they send messages to the servers. Every link
method runs on the client's I/O loop.

| link            | embedded                | service (ZeroMQ)          |
|-----------------|-------------------------|---------------------------|
| ControllerLink  | ``LocalControllerLink`` | ``RemoteControllerLink``  |
| UnitLink        | ``LocalUnitLink``       | ``RemoteUnitLink``        |

The embedded links are in :mod:`transferqueue.deploy.local_links`; the ZeroMQ ones in
:mod:`transferqueue.client.controller_link` and :mod:`transferqueue.client.unit_link`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import SchemaError
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.schema import Column, FieldSpec
from transferqueue.wire import protocol

__all__ = [
    "OFFLOAD_BYTES",
    "ControllerLink",
    "Read",
    "UnitLink",
    "column_nbytes",
    "link_of",
    "placed_whole",
]

T = TypeVar("T")
R = TypeVar("R")

# Payloads above this are copied on a worker thread so the I/O loop keeps serving requests.
# Below it the copy (at most a few ms) is cheaper than the hand-off to a thread: moving the
# bound from 1 MiB to 16 MiB took 0.2-0.3 ms off each 4.5 MB put through a storage unit.
OFFLOAD_BYTES = 16 << 20


class ControllerLink(Protocol):
    """The controller: one method, ``call``, for every message kind it takes (declared in
    :mod:`transferqueue.wire.messages`; the reply has the kind's declared type)."""

    async def call(self, msg: protocol.ControllerRequest[R]) -> R: ...


Read = Callable[[BatchMeta, Sequence[str] | None], Coroutine[Any, Any, dict[str, Column]]]
"""How the parts of a client read rows: the columns of a meta's rows (``fields`` None: the
meta's), rows lost with a unit named in a RowsLostError (the client's ``get_data``)."""


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

    async def write_new(
        self,
        placing: Awaitable[BatchMeta],
        columns: Mapping[str, Column],
        specs: Mapping[str, FieldSpec],
    ) -> bool:
        """Write a put's ``columns`` as the new rows the allocation ``placing`` gives, if it
        placed them all on this unit, one copy each (True); else write nothing (False: the
        caller writes them where they lie). Errors of the allocation are raised here.

        A put that will likely land here is handed to the link before its rows are known,
        so that the link may prepare the write meanwhile (a shared-memory link copies the
        columns into shared memory while the allocation makes its round trip); this one
        waits for the rows, then writes."""
        new = await placing
        if not placed_whole(new, self.unit_id):
            return False
        grant = (new.grants or {}).get(self.unit_id)
        await self.write(new.indexes, columns, specs, create=True, grant=grant)
        return True

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


def placed_whole(meta: BatchMeta, unit_id: int) -> bool:
    """Whether every row of ``meta`` lies on unit ``unit_id`` alone (one copy each)."""
    units = meta.units
    return bool(units.size) and meta.replica_units is None and bool((units == unit_id).all())


def link_of(units: Mapping[int, UnitLink], unit_id: int) -> UnitLink:
    """The link to unit ``unit_id`` (a meta naming another unit: a SchemaError)."""
    try:
        return units[unit_id]
    except KeyError:
        raise SchemaError(
            f"meta names storage unit {unit_id}, which this client does not know"
        ) from None


def column_nbytes(col: Column | ChunkedTensor) -> int:
    if isinstance(col, torch.Tensor):
        return col.numel() * col.element_size()
    if isinstance(col, Ragged | ChunkedTensor):
        return col.nbytes
    return 0


def nbytes_to_copy(col: Column | ChunkedTensor, ranges: Sequence[tuple[str, int, int]]) -> int:
    """Bytes of ``col`` that a reply must copy: a tensor (or a ragged column's values) lying
    inside one of ``ranges`` (``(name, address, size)``: the reader's own write arenas) is
    named where it lies instead (:class:`~transferqueue.storage.shm.Placer`)."""
    t = col.values if isinstance(col, Ragged) else col
    if isinstance(t, torch.Tensor) and t.numel():
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if any(a <= start and end <= a + size for _, a, size in ranges):
            return 0
    return column_nbytes(col)
