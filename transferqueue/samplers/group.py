"""``group``: hand out only whole groups (the n responses of one GRPO prompt).

Rows carry a ``group`` id in their header. A group is complete for a task once
``group_size`` of its rows are ready for that task; only complete groups are handed out, never
split across batches. Groups are served oldest first by the lowest version among their rows.
A group that receives more than ``group_size`` rows completes at ``group_size`` and the extra
rows start a new group with the same id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transferqueue.samplers.base import HeaderView, Sampler, Selection
from transferqueue.samplers.fifo import VersionQueue, _concat
from transferqueue.samplers.registry import register_sampler

__all__ = ["GroupSampler"]


@register_sampler("group")
class GroupSampler(Sampler):
    """Whole groups of ``group_size`` rows, oldest version first."""

    def __init__(self, header: HeaderView, *, group_size: int, **options: Any) -> None:
        super().__init__(header, **options)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group sampler needs group_size >= 1, got {group_size!r}")
        self.group_size = group_size
        self._partial: dict[int, list[int]] = {}  # group id -> ready rows so far
        self._complete = VersionQueue()  # items: one complete group each

    def add(self, indexes: np.ndarray, *, returned: bool = False) -> None:
        if indexes.size == 0:
            return
        groups = self.header.groups(indexes)
        if returned:
            # Returned rows were handed out as whole groups: requeue them as such.
            order = np.argsort(groups, kind="stable")
            cuts = np.flatnonzero(np.diff(groups[order])) + 1
            for rows in np.split(indexes[order], cuts):
                self._push(rows, front=True)
            return
        gs = self.group_size
        for idx, g in zip(indexes.tolist(), groups.tolist(), strict=True):
            members = self._partial.get(g)
            if members is None:
                members = self._partial[g] = []
            members.append(idx)
            if len(members) == gs:
                del self._partial[g]
                self._push(np.asarray(members, dtype=np.int64), front=False)

    def _push(self, rows: np.ndarray, *, front: bool) -> None:
        version = int(self.header.versions(rows).min())
        self._complete.push(version, rows, front=front)

    def available(self) -> int:
        return self._complete.rows

    def check_batch_size(self, batch_size: int) -> None:
        super().check_batch_size(batch_size)
        if batch_size < self.group_size:
            raise ValueError(
                f"batch_size {batch_size} is smaller than group_size {self.group_size}: "
                "the group sampler never splits a group; use a multiple of group_size"
            )

    def batch_rows(self, batch_size: int) -> int:
        return (batch_size // self.group_size) * self.group_size

    def sample(self, batch_size: int) -> Selection:
        return Selection(_concat(self._complete.take(self.batch_rows(batch_size), split=False)))

    def drop_below(self, min_version: int) -> np.ndarray:
        return _concat(self._complete.drop_below(min_version))

    def clear(self) -> None:
        self._partial.clear()
        self._complete.clear()

    @property
    def partial_groups(self) -> int:
        """Groups with some but not all rows ready."""
        return len(self._partial)
