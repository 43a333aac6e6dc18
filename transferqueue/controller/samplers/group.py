"""``group``: hand out only whole groups (the n responses of one GRPO prompt).

Rows carry a ``group`` id in their header. A group is complete for a task once
``group_size`` of its rows are ready for that task; only complete groups are handed out, never
split across batches. A group that receives more than ``group_size`` rows completes at
``group_size`` and the extra rows start a new group with the same id. A group that can never
complete (its partition is finished and it has fewer rows: a row lost with a storage unit, a
short last group) is never handed out: the task's stream ends without it.

``order`` says which complete groups go first:

- ``"version"`` (default): the lowest version among a group's rows, oldest first;
- ``"group"``: ascending group id. With it, ``get_meta(max_group=g)`` hands out only groups
  with id <= g: a consumer that must take groups in windows (a train step that consumes the
  groups admitted for it, in whatever order they complete) asks for exactly its window;
- ``"length"``: longest first by the rows' ``length`` header (ties: ascending group id):
  longest-processing-time-first scheduling, e.g. generation of the prompts predicted to give
  the longest responses before the others, so that they do not become the step's long tail.
  With ``window=W``, longest first within consecutive windows of ``W`` group ids, older
  windows first (``W`` = groups per train step: the next step's long prompts never overtake
  this step's short ones).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from transferqueue.controller.samplers.base import HeaderView, Sampler, Selection
from transferqueue.controller.samplers.fifo import VersionQueue, _concat
from transferqueue.controller.samplers.registry import register_sampler

__all__ = ["GroupSampler"]


@register_sampler("group")
class GroupSampler(Sampler):
    """Whole groups of ``group_size`` rows, oldest version first."""

    def __init__(
        self,
        header: HeaderView,
        *,
        group_size: int,
        order: str = "version",
        window: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(header, **options)
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group sampler needs group_size >= 1, got {group_size!r}")
        if order not in ("version", "group", "length"):
            raise ValueError(
                f"group sampler order must be 'version', 'group' or 'length', got {order!r}"
            )
        if window is not None and (order != "length" or not isinstance(window, int) or window < 1):
            raise ValueError(
                f"group sampler window must be an int >= 1 and needs order='length', got "
                f"window={window!r}, order={order!r}"
            )
        self.order = order
        self.window = window
        self.group_size = group_size
        self.supports_max_group = order == "group"  # bounds the key; only ids are group ids
        self._partial: dict[int, list[int]] = {}  # group id -> ready rows so far
        self._partial_rows = 0  # rows in self._partial
        self._complete: VersionQueue | KeyedGroupQueue = (
            VersionQueue() if order == "version" else KeyedGroupQueue()
        )

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
            self._partial_rows += 1
            if len(members) == gs:
                del self._partial[g]
                self._partial_rows -= gs
                self._push(np.asarray(members, dtype=np.int64), front=False)

    def _push(self, rows: np.ndarray, *, front: bool) -> None:
        if isinstance(self._complete, KeyedGroupQueue):
            gid = int(self.header.groups(rows[:1])[0])
            if self.order == "group":
                key: tuple[int, ...] = (gid, gid)
            else:
                longest = -int(self.header.lengths(rows).max())
                key = (longest, gid) if self.window is None else (gid // self.window, longest, gid)
            self._complete.push(key, rows)
        else:
            self._complete.push(int(self.header.versions(rows).min()), rows, front=front)

    def available(self, max_group: int | None = None) -> int:
        if isinstance(self._complete, KeyedGroupQueue):
            return self._complete.available(max_group)
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

    def sample(self, batch_size: int, max_group: int | None = None) -> Selection:
        n = self.batch_rows(batch_size)
        if isinstance(self._complete, KeyedGroupQueue):
            return Selection(_concat(self._complete.take(n, max_group)))
        return Selection(_concat(self._complete.take(n, split=False)))

    def drop_below(self, min_version: int) -> np.ndarray:
        if isinstance(self._complete, KeyedGroupQueue):
            return _concat(self._complete.drop_if(lambda rows: self._stale(rows, min_version)))
        return _concat(self._complete.drop_below(min_version))

    def queued(self) -> np.ndarray:
        # Complete groups in serve order, then the rows of incomplete groups as they came:
        # added again in this order, the groups complete in the same order.
        partial = [np.asarray(m, dtype=np.int64) for m in self._partial.values()]
        return _concat([self._complete.ordered(), *partial])

    def _stale(self, rows: np.ndarray, min_version: int) -> bool:
        return bool(int(self.header.versions(rows).min()) < min_version)

    def held(self) -> int:
        return self._complete.rows + self._partial_rows

    def clear(self) -> None:
        self._partial.clear()
        self._partial_rows = 0
        self._complete.clear()

    @property
    def partial_groups(self) -> int:
        """Groups with some but not all rows ready."""
        return len(self._partial)


class KeyedGroupQueue:
    """Complete groups sorted by a key (group id, or minus the length); the keys of group-id
    order are the ids themselves, so ``max_group`` bounds them directly."""

    def __init__(self) -> None:
        self._keys: list[tuple[int, ...]] = []
        self._rows: dict[tuple[int, ...], list[np.ndarray]] = {}
        self.rows = 0

    def push(self, key: tuple[int, ...], rows: np.ndarray) -> None:
        items = self._rows.get(key)
        if items is None:
            bisect.insort(self._keys, key)
            items = self._rows[key] = []
        items.append(rows)
        self.rows += int(rows.size)

    def available(self, max_group: int | None) -> int:
        if max_group is None:
            return self.rows
        end = bisect.bisect_right(self._keys, (max_group, max_group))
        return sum(int(r.size) for key in self._keys[:end] for r in self._rows[key])

    def take(self, n: int, max_group: int | None) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        need = n
        while self._keys and need > 0:
            key = self._keys[0]
            if max_group is not None and key[0] > max_group:
                break
            items = self._rows[key]
            if items[0].size > need:
                break
            rows = items.pop(0)
            if not items:
                del self._rows[key]
                self._keys.pop(0)
            out.append(rows)
            need -= int(rows.size)
            self.rows -= int(rows.size)
        return out

    def ordered(self) -> np.ndarray:
        """Every queued row, in the order ``take`` would hand them out."""
        return _concat([rows for key in self._keys for rows in self._rows[key]])

    def drop_if(self, stale: Any) -> list[np.ndarray]:
        dropped = []
        for key in list(self._keys):
            keep = []
            for rows in self._rows[key]:
                if stale(rows):
                    dropped.append(rows)
                    self.rows -= int(rows.size)
                else:
                    keep.append(rows)
            if keep:
                self._rows[key] = keep
            else:
                del self._rows[key]
                self._keys.remove(key)
        return dropped

    def clear(self) -> None:
        self._keys.clear()
        self._rows.clear()
        self.rows = 0
