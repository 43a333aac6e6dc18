"""The storage unit's message kinds (see :mod:`transferqueue.messages`, which declares the
controller's, the field types and the dispatch, and re-exports these: import them from
there, ``messages.Write``; this module is loaded by it).
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from msgspec import Meta

from transferqueue.limits import MAX_NAMES
from transferqueue.messages import (
    ArenaName,
    ColumnMap,
    Grant,
    Names,
    Rows,
    Specs,
    UnitRequest,
    WaitS,
)

__all__ = [
    "ClearUnit",
    "CopyRows",
    "Free",
    "Read",
    "ResetUnit",
    "ShmAttach",
    "ShmDetach",
    "UnitInventory",
    "UnitPing",
    "UnitStats",
    "Write",
]


class Write(UnitRequest[None]):
    """Store columns of rows. ``create``: new rows (under the controller's ``grant``).
    ``shm``: buffers lie in the writer's arena; ``keep``: in its write arena ``keep``."""

    kind = "write"
    indexes: Rows
    columns: ColumnMap
    specs: Specs
    create: bool = False
    grant: Grant | None = None
    shm: bool = False
    keep: ArenaName | None = None


class Read(UnitRequest[dict[str, Any]]):
    """Gather ``fields`` of rows, in order: one buffer per field. ``shm``: into the reader's
    arena; ``mine``: its write arenas, where rows it wrote may be named instead of copied."""

    kind = "read"
    indexes: Rows
    fields: Names
    shm: ArenaName | None = None
    mine: Annotated[list[ArenaName], Meta(max_length=MAX_NAMES)] = []  # noqa: RUF012 (a Struct)


class Free(UnitRequest[None]):
    """Drop rows (the controller, once consumed; a writer, under its grant, after a failed
    put)."""

    kind = "free"
    indexes: Rows
    grant: Grant | None = None


class UnitPing(UnitRequest[str]):
    """Are you alive? The answer is the unit's incarnation (see :class:`Ping`)."""

    kind = "ping"


class ClearUnit(UnitRequest[None]):
    """Drop every row of the unit."""

    kind = "clear"
    needs = "admin"


class UnitStats(UnitRequest[dict[str, Any]]):
    """Rows, bytes and fields the unit holds."""

    kind = "stats"


class UnitInventory(UnitRequest[np.ndarray]):
    """The indexes of every row the unit holds (a restarted controller reconciles them)."""

    kind = "inventory"
    needs = "admin"


class ResetUnit(UnitRequest[None]):
    """Forget every row and field of the unit."""

    kind = "reset"
    needs = "admin"


class ShmAttach(UnitRequest[int]):
    """Map the client's shared-memory arena ``name`` (``keep``: a write arena); its size."""

    kind = "shm_attach"
    name: ArenaName
    keep: bool = False
    pid: Annotated[int, Meta(ge=0, le=2**31)] | None = None
    """The client's process id: the unit drops the client's arenas once it is gone."""


class ShmDetach(UnitRequest[None]):
    """Drop the mapping of arena ``name``."""

    kind = "shm_detach"
    name: ArenaName


class CopyRows(UnitRequest[int]):
    """Write a copy of rows ``indexes`` (their ``fields``, of ``specs``) to unit ``target``
    at ``address``, creating them there under the controller's ``grant`` for that unit,
    within ``timeout_s``; the answer is the rows copied (the controller re-replicating rows
    left with one copy, see :mod:`transferqueue.recopy`; the service's own key)."""

    kind = "copy_rows"
    needs = "service"
    indexes: Rows
    fields: Names
    specs: Specs
    target: Annotated[int, Meta(ge=0, le=4095)]
    address: Annotated[str, Meta(min_length=1, max_length=1024)]
    grant: Grant
    timeout_s: WaitS = 30.0
