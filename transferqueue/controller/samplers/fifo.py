"""``fifo``: oldest policy version first, arrival order within a version.

Rows without a version (-1, e.g. prompts) come first, then version 0, 1, ... so consumers
always drain the stalest data before fresher data (what bounded staleness needs), and for a
stream whose versions never decrease this is plain arrival order. Rows returned from an
expired lease go to the front of their version.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

import numpy as np

from transferqueue.controller.samplers.base import HeaderView, Sampler, Selection
from transferqueue.controller.samplers.registry import register_sampler

__all__ = ["FifoSampler", "VersionQueue"]


class VersionQueue:
    """Items (arrays of row indexes) bucketed by version; buckets served lowest version first.

    Each bucket is a deque of arrays, so adding and taking cost O(items touched), not O(rows
    queued). Versions form a heap with lazy deletion of emptied buckets.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, deque[np.ndarray]] = {}
        self._heap: list[int] = []
        self.rows = 0
        self.items = 0

    def push(self, version: int, rows: np.ndarray, *, front: bool = False) -> None:
        bucket = self._buckets.get(version)
        if bucket is None:
            bucket = self._buckets[version] = deque()
            heapq.heappush(self._heap, version)
        if front:
            bucket.appendleft(rows)
        else:
            bucket.append(rows)
        self.rows += int(rows.size)
        self.items += 1

    def push_by_version(self, rows: np.ndarray, versions: np.ndarray, *, front: bool) -> None:
        """Split ``rows`` by version (order kept within a version) and push each part."""
        if rows.size == 0:
            return
        if versions.size and bool((versions == versions[0]).all()):
            self.push(int(versions[0]), rows, front=front)
            return
        order = np.argsort(versions, kind="stable")
        vs = versions[order]
        cuts = np.flatnonzero(np.diff(vs)) + 1
        for part, v in zip(np.split(rows[order], cuts), vs[np.r_[0, cuts]].tolist(), strict=True):
            self.push(int(v), part, front=front)

    def _lowest(self) -> int | None:
        while self._heap:
            v = self._heap[0]
            if self._buckets.get(v):
                return v
            heapq.heappop(self._heap)
            self._buckets.pop(v, None)
        return None

    def take(self, n: int, *, split: bool) -> list[np.ndarray]:
        """Take up to ``n`` rows, oldest version first; ``split=False`` takes whole items only."""
        out: list[np.ndarray] = []
        need = n
        while need > 0:
            v = self._lowest()
            if v is None:
                break
            bucket = self._buckets[v]
            item = bucket[0]
            if item.size <= need:
                bucket.popleft()
                self.items -= 1
            elif split:
                bucket[0] = item[need:]
                item = item[:need]
            else:
                break
            out.append(item)
            need -= int(item.size)
            self.rows -= int(item.size)
        return out

    def drop_below(self, min_version: int) -> list[np.ndarray]:
        dropped: list[np.ndarray] = []
        while True:
            v = self._lowest()
            if v is None or v >= min_version:
                return dropped
            bucket = self._buckets.pop(v)
            heapq.heappop(self._heap)
            for item in bucket:
                self.rows -= int(item.size)
                self.items -= 1
                dropped.append(item)

    def ordered(self) -> np.ndarray:
        """Every queued row, in the order ``take`` would hand them out."""
        parts = [item for v in sorted(self._buckets) for item in self._buckets[v]]
        return _concat(parts)

    def clear(self) -> None:
        self._buckets.clear()
        self._heap.clear()
        self.rows = self.items = 0


@register_sampler("fifo")
class FifoSampler(Sampler):
    """Oldest version first, arrival order within a version (the default sampler)."""

    def __init__(self, header: HeaderView, **options: Any) -> None:
        super().__init__(header, **options)
        self._queue = VersionQueue()

    def add(self, indexes: np.ndarray, *, returned: bool = False) -> None:
        self._queue.push_by_version(indexes, self.header.versions(indexes), front=returned)

    def available(self, max_group: int | None = None) -> int:
        return self._queue.rows

    def sample(self, batch_size: int, max_group: int | None = None) -> Selection:
        parts = self._queue.take(batch_size, split=True)
        return Selection(_concat(parts))

    def drop_below(self, min_version: int) -> np.ndarray:
        return _concat(self._queue.drop_below(min_version))

    def queued(self) -> np.ndarray:
        return self._queue.ordered()

    def clear(self) -> None:
        self._queue.clear()


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
