"""The controller's replies that carry more than a scalar: typed values a client receives.

Declared here, beside the message kinds that return them (:mod:`transferqueue.wire.messages`),
so that a client decodes them without importing the controller, which builds them:

| reply            | to the call      | built by                                      |
|------------------|------------------|-----------------------------------------------|
| ``KeyRows``      | ``kv_rows``      | :mod:`transferqueue.controller.keys`          |
| ``KeyListing``   | ``kv_list``      | :mod:`transferqueue.controller.keys`          |
| ``LostRows``     | ``lost_rows``    | :mod:`transferqueue.controller.retire`        |
| ``Retired``      | ``retire_groups``| :mod:`transferqueue.controller.retire`        |
| ``PartitionStatus`` | ``status``    | :mod:`transferqueue.controller.status`        |
| ``StoreExport``  | ``export_state`` | :mod:`transferqueue.controller.snapshot`      |

``TaskImport`` goes the other way (``import_tasks``: a loader's request). A task's per-row
state codes (:data:`WAITING` ... :data:`DONE`, named by :data:`STATES`) are the controller's
own and those of an export.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import Meta

from transferqueue.errors import BadRequestError, UnknownKeyError
from transferqueue.limits import MAX_NAME_CHARS, MAX_NAMES, MAX_OPTIONS, MAX_ROWS, MAX_TASKS
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec

__all__ = [
    "DONE",
    "LEASED",
    "QUEUED",
    "STATES",
    "WAITING",
    "KeyListing",
    "KeyRows",
    "LostRows",
    "PartitionExport",
    "PartitionStatus",
    "Retired",
    "StoreExport",
    "TaskExport",
    "TaskImport",
    "TaskImports",
]

WAITING, QUEUED, LEASED, DONE = 0, 1, 2, 3
"""A task's state of a row, by code (named by :data:`STATES`)."""


@dataclass(eq=False)
class KeyRows:
    """The answer to ``kv_rows``: the rows of the asked keys, in the keys' order."""

    meta: BatchMeta
    created: np.ndarray
    """int64: positions (in the keys) of the keys that got a new row in this call."""
    fields: list[str] = field(default_factory=list)
    """A read's fields: those asked, or (none asked) every field all the rows have."""


@dataclass(eq=False)
class KeyListing:
    """The answer to ``kv_list``: the keys of a partition, in row (index) order."""

    partition: str
    keys: list[str]
    indexes: np.ndarray
    """int64: each key's row."""
    ready: dict[str, np.ndarray] = field(default_factory=dict)
    """Per field, bool: that key's row has the field written."""
    tags: list[dict[str, Any]] | None = None
    """Asked with ``tags=True`` (filled by the client): each key's tags (``{}``: none)."""

    def __post_init__(self) -> None:  # (also what a decoded reply holds)
        n = len(self.keys)
        if not isinstance(self.indexes, np.ndarray) or self.indexes.shape != (n,):
            raise BadRequestError(f"kv_list: indexes must have one entry per key ({n})")
        if any(not isinstance(a, np.ndarray) or a.shape != (n,) for a in self.ready.values()):
            raise BadRequestError(f"kv_list: ready arrays must have one entry per key ({n})")

    def __len__(self) -> int:
        return len(self.keys)

    def fields_of(self, key: str) -> list[str]:
        """The listed fields that ``key``'s row has written."""
        try:
            pos = self.keys.index(key)
        except ValueError:
            raise UnknownKeyError(
                f"key {key!r} is not in this listing of partition {self.partition!r}"
            ) from None
        return [name for name, arr in self.ready.items() if arr[pos]]


@dataclass
class LostRows:
    """A page of a task's loss log: rows lost before the task consumed them."""

    indexes: np.ndarray  # int64 row indexes
    groups: np.ndarray  # their group ids (-1: none)
    next: int  # the cursor to pass next time
    missed: int = 0  # rows logged after ``after`` that the log no longer holds


@dataclass
class Retired:
    """The answer to ``retire_groups``."""

    rows: int  # rows retired
    busy: np.ndarray  # int64 group ids left alone: a row of each is leased by the named task


STATES = ("waiting", "queued", "leased", "done")
"""The names of a task's per-row states, by code (``PartitionStatus.states``):
``waiting`` (a field the task consumes is not written yet, or the task has not started),
``queued`` (ready, not handed out), ``leased`` (handed out, not acknowledged), ``done``."""


@dataclass(eq=False)
class PartitionStatus:
    """The answer to ``status``: one entry per live row of ``partition``, in index order."""

    partition: str
    indexes: np.ndarray
    """int64: the live rows (put, not freed, lost or cleared)."""
    ready: dict[str, np.ndarray] = field(default_factory=dict)
    """Per asked field, bool: the field of that row is written."""
    task: str | None = None
    states: np.ndarray | None = None
    """uint8, with ``task``: the task's state of each row, a code of :data:`STATES`."""
    meta: BatchMeta | None = None
    """Asked with ``meta=True``: the same rows as a ``BatchMeta`` without a lease."""

    def __post_init__(self) -> None:  # (also what a decoded reply holds)
        n = np.asarray(self.indexes).shape
        arrays = [*self.ready.values(), *(() if self.states is None else (self.states,))]
        if any(not isinstance(a, np.ndarray) or a.shape != n for a in arrays):
            raise BadRequestError(f"status arrays must have one entry per row ({n})")

    def __len__(self) -> int:
        return int(self.indexes.size)

    def state_names(self) -> list[str]:
        """The task's state of each row, by name (see :data:`STATES`)."""
        if self.states is None:
            raise BadRequestError("this status was asked without task=; ask with the task")
        return [STATES[s] for s in self.states.tolist()]

    def rows(self, state: str) -> np.ndarray:
        """The rows the task holds in ``state`` (``waiting``, ``queued``, ``leased``,
        ``done``)."""
        if state not in STATES:
            raise BadRequestError(f"state must be one of {STATES}, got {state!r}")
        if self.states is None:
            raise BadRequestError("this status was asked without task=; ask with the task")
        return self.indexes[self.states == STATES.index(state)]


_Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
_Options = Annotated[
    dict[Annotated[str, Meta(max_length=64)], int | float | str | bool | None],
    Meta(max_length=MAX_OPTIONS),
]


class TaskExport(msgspec.Struct, array_like=True):
    name: str
    fields: list[str]
    sampler: str
    options: dict[str, Any]
    states: np.ndarray  # uint8 [N]: the task's state of each row (status.STATES codes)
    queue: np.ndarray | None  # int64: positions of queued rows in serve order, or None
    leases: list[np.ndarray]  # int64: positions of each open lease's rows, leases in order


class PartitionExport(msgspec.Struct, array_like=True):
    name: str
    declared: list[str] | None
    finished: bool
    indexes: np.ndarray  # int64 [N], ascending: the rows' indexes in the exporting store
    units: np.ndarray  # int32 [N]
    groups: np.ndarray  # int64 [N]
    versions: np.ndarray  # int64 [N]
    lengths: np.ndarray  # int64 [N]
    ready: dict[str, np.ndarray]  # field -> bool [N]
    custom_rows: np.ndarray  # int64: positions of the rows that carry custom metadata
    custom: list[bytes]  # their msgpack maps
    tasks: list[TaskExport]
    key_rows: np.ndarray | None = None  # int64: positions of the rows with a string key
    keys: list[str] = msgspec.field(default_factory=list)  # their keys


class StoreExport(msgspec.Struct, array_like=True):
    """The reply to ``export_state``: a snapshot of partitions at one controller instant."""

    snapshot_id: int  # holds the rows' payload on the units (see ExportHolds); 0: none
    specs: dict[str, dict[str, FieldSpec]]  # {partition: {field: spec}}
    partitions: list[PartitionExport]


class TaskImport(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One task of a partition being loaded: rows it consumed, and its queue in serve order
    (rows of the partition, by their new indexes; ready rows in neither join the queue
    after these, in index order)."""

    name: _Name
    fields: Annotated[list[_Name], Meta(min_length=1, max_length=MAX_NAMES)]
    sampler: Annotated[str, Meta(max_length=64)]
    options: _Options
    consumed: np.ndarray
    queue: np.ndarray
    leases: Annotated[list[np.ndarray], Meta(max_length=MAX_ROWS)] = []
    """Rows leased at save time, per lease: they come back as from an expired lease."""

    def __post_init__(self) -> None:
        self.consumed = _ints(self.consumed, self.name, "consumed")
        self.queue = _ints(self.queue, self.name, "queue")
        self.leases = [_ints(a, self.name, "leases") for a in self.leases]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TaskImport):
            return NotImplemented
        return all(
            np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
            for a, b in zip(
                msgspec.structs.astuple(self), msgspec.structs.astuple(other), strict=True
            )
        )

    __hash__ = None  # type: ignore[assignment]  # (mutable arrays: not hashable)


def _ints(arr: Any, task: str, what: str) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise BadRequestError(f"task {task!r}: {what} must be 1-D integer arrays")
    return arr.astype(np.int64, copy=False)


TaskImports = Annotated[list[TaskImport], Meta(max_length=MAX_TASKS)]
