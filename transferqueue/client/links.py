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
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
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
    "Staged",
    "UnitLink",
    "column_nbytes",
    "link_of",
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
