"""Per-task and per-partition state of the controller, and what an operation changed.

Kept apart from :mod:`transferqueue.controller.core` so that the controller module holds the
operations and this one the records they update::

    TaskState       fields it consumes, its sampler, per-slot state (waiting / queued /
                    leased / done) and lease id, counters
    PartitionState  declared tasks, tasks by name, row counters, finished and loading flags
    HEADER          the controller's per-slot header columns: dtype and fill value
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferqueue.controller.leases import TaskKey
from transferqueue.controller.samplers import Sampler
from transferqueue.errors import SchemaError

__all__ = [
    "HEADER",
    "Changes",
    "PartitionState",
    "TaskState",
    "header_column",
]


@dataclass
class Changes:
    """What an operation changed that the service layer must act on."""

    woken: set[TaskKey] = field(default_factory=set)  # tasks whose waiters should re-check
    freed: list[np.ndarray] = field(default_factory=list)  # freed row indexes
    freed_units: list[np.ndarray] = field(default_factory=list)  # their units
    space: bool = False  # rows were freed: allocations waiting for capacity may proceed

    def merge(self, other: Changes) -> Changes:
        self.woken |= other.woken
        self.freed += other.freed
        self.freed_units += other.freed_units
        self.space |= other.space
        return self


class TaskState:
    def __init__(
        self,
        key: TaskKey,
        fields: tuple[str, ...],
        sampler: Sampler,
        sampler_name: str,
        options: dict[str, Any],
        capacity: int,
    ) -> None:
        self.key = key
        self.fields = fields
        self.sampler = sampler
        self.sampler_name = sampler_name
        self.options = options
        self.state = np.zeros(capacity, dtype=np.uint8)
        self.lease = np.full(capacity, -1, dtype=np.int64)
        self.leased = 0
        self.done = 0
        self.dropped = 0
        self.lost = 0  # rows lost with a dead unit before this task consumed them
        self.retired = (
            0  # rows retired (transferqueue.controller.retire) before this task consumed them
        )

    def grown(self, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        """``state`` and ``lease`` grown to ``capacity`` (new arrays; the caller swaps them
        in once every array of the controller has been grown)."""
        extra = capacity - self.state.size
        state = np.concatenate([self.state, np.zeros(extra, dtype=np.uint8)])
        lease = np.concatenate([self.lease, np.full(extra, -1, dtype=np.int64)])
        return state, lease


class PartitionState:
    def __init__(self, pid: int, name: str) -> None:
        self.id = pid
        self.name = name
        self.declared: list[str] | None = None
        self.tasks: dict[str, TaskState] = {}
        self.rows_put = 0
        self.rows_live = 0
        self.rows_freed = 0
        self.rows_lost = 0
        self.rows_retired = 0
        self.finished = False
        self.loading = False  # rows being loaded from a save: no task may consume them yet


HEADER: dict[str, tuple[type, int]] = {
    "index": (np.int64, -1),
    "partition": (np.int16, -1),
    "unit": (np.int32, -1),
    "replica": (np.int32, -1),  # the unit of the row's second copy (replicas=2; -1: none)
    "group": (np.int64, -1),
    "version": (np.int64, -1),
    "length": (np.int64, -1),
    "done": (np.int16, 0),
    "live": (np.bool_, False),
    "nbytes": (np.int64, 0),  # the row's share of the payload its put reported (placement)
    "committed": (np.bool_, False),  # a commit landed (else reclaimed after allocation_s)
    "copying": (
        np.int64,
        -1,
    ),  # the copy plan under way of the row (transferqueue.controller.rereplicate)
}


def header_column(name: str, value: np.ndarray | int | None, n: int, *, default: int) -> np.ndarray:
    if value is None:
        return np.full(n, default, dtype=np.int64)
    arr = np.asarray(value)
    if arr.ndim == 0:
        return np.full(n, int(arr), dtype=np.int64)
    if arr.shape != (n,):
        raise SchemaError(f"header {name!r} has shape {arr.shape}, expected ({n},): one per row")
    if arr.dtype.kind not in "iub":
        raise SchemaError(f"header {name!r} must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)
