"""Row bookkeeping shared by the controller and the storage units.

Global row indexes grow forever; memory must not. Two small structures turn an index into a
reusable *slot* (a position in columnar arrays) in O(1), vectorized over a batch:

``SlotMap``: index -> slot, a ring over the window of live indexes::

    ring   [cap] int32      ring[i & (cap - 1)] = slot of index i, or -1
    base   int              indexes below base are gone; live ones lie in [base, base + cap)

``ExtentAllocator``: hands out slots, contiguous whenever it can (so a batch's rows are one
slice of every column and reads/writes are single memcpys), merging freed ranges back::

    free   sorted, disjoint [start, end) ranges of unused slots
"""

from __future__ import annotations

import bisect

import numpy as np

__all__ = ["ExtentAllocator", "SlotMap", "runs"]


class SlotMap:
    """Maps global row indexes to slots. Not thread-safe: its owner serializes access."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1
        while cap < max(capacity, 16):
            cap <<= 1
        self._ring = np.full(cap, -1, dtype=np.int32)
        self._base = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def window(self) -> int:
        return self._ring.size

    def insert(self, indexes: np.ndarray, slots: np.ndarray) -> None:
        """Record ``indexes[k] -> slots[k]``; indexes must not be present already."""
        if indexes.size == 0:
            return
        lo, hi = int(indexes.min()), int(indexes.max())
        if self._count == 0:
            self._base = lo
        elif lo < self._base:
            self._rebase(lo, hi)
        if hi >= self._base + self._ring.size:
            self._rebase(lo, hi)
        pos = indexes & (self._ring.size - 1)
        if bool((self._ring[pos] >= 0).any()):
            dup = indexes[self._ring[pos] >= 0][:5].tolist()
            raise KeyError(f"rows {dup} are already present")
        self._ring[pos] = slots
        self._count += int(indexes.size)

    def lookup(self, indexes: np.ndarray) -> np.ndarray:
        """Slots of ``indexes`` (int64 array); -1 where a row is absent."""
        # (one unsigned compare: an index below base wraps to a huge offset)
        off = np.asarray(indexes - self._base, dtype=np.int64)
        inside = off.view(np.uint64) < self._ring.size
        if inside.all():
            return self._ring[indexes & (self._ring.size - 1)].astype(np.int64)
        out = np.full(indexes.shape, -1, dtype=np.int64)
        out[inside] = self._ring[indexes[inside] & (self._ring.size - 1)]
        return out

    def remove(self, indexes: np.ndarray) -> None:
        """Forget ``indexes`` (absent ones are ignored)."""
        if indexes.size == 0:
            return
        inside = indexes[(indexes >= self._base) & (indexes < self._base + self._ring.size)]
        pos = inside & (self._ring.size - 1)
        present = self._ring[pos] >= 0
        self._ring[pos[present]] = -1
        self._count -= int(present.sum())

    def clear(self) -> None:
        self._ring.fill(-1)
        self._count = 0

    def keys(self) -> np.ndarray:
        """Every index present, ascending."""
        pos = np.flatnonzero(self._ring >= 0)
        cap = self._ring.size
        return np.sort(self._base + ((pos - self._base) & (cap - 1))).astype(np.int64)

    def _rebase(self, lo: int, hi: int) -> None:
        """Make [new_base, hi] fit: drop the dead prefix of the window, grow if still short."""
        old = self._ring
        old_cap = old.size
        live_pos = np.flatnonzero(old >= 0)
        # Indexes live in the window map back from their ring positions relative to base.
        live_idx = self._base + ((live_pos - self._base) & (old_cap - 1))
        new_base = min(lo, int(live_idx.min())) if live_idx.size else lo
        if live_idx.size:
            hi = max(hi, int(live_idx.max()))
        cap = old_cap
        while hi - new_base >= cap:
            cap <<= 1
        if cap != old_cap or new_base != self._base:
            ring = np.full(cap, -1, dtype=np.int32)
            ring[live_idx & (cap - 1)] = old[live_pos]
            self._ring = ring
        self._base = new_base


class ExtentAllocator:
    """Allocates slots in ``[0, capacity)``, preferring one contiguous range per request."""

    def __init__(self, capacity: int = 0) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.capacity = 0
        self.grow(capacity)

    @property
    def free_count(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def used(self) -> int:
        return self.capacity - self.free_count

    def grow(self, capacity: int) -> None:
        """Raise capacity; the new slots join the free ranges."""
        if capacity > self.capacity:
            self._release(self.capacity, capacity)
            self.capacity = capacity

    def allocate(self, n: int) -> np.ndarray | None:
        """``n`` slots (int64, ascending), or None when fewer than ``n`` are free."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        for k, (s, e) in enumerate(zip(self._starts, self._ends, strict=True)):
            if e - s >= n:
                if e - s == n:
                    del self._starts[k], self._ends[k]
                else:
                    self._starts[k] = s + n
                return np.arange(s, s + n, dtype=np.int64)
        if self.free_count < n:
            return None
        # Fragmented: take whole ranges from the front until n slots are gathered.
        parts, need = [], n
        while need:
            s, e = self._starts[0], self._ends[0]
            take = min(need, e - s)
            parts.append(np.arange(s, s + take, dtype=np.int64))
            if take == e - s:
                del self._starts[0], self._ends[0]
            else:
                self._starts[0] = s + take
            need -= take
        return np.concatenate(parts)

    def free(self, slots: np.ndarray) -> None:
        """Return slots (any order, no duplicates) to the free ranges."""
        for s, e in runs(np.sort(slots)):
            self._release(s, e)

    def reserve(self, slots: np.ndarray) -> None:
        """Mark free ``slots`` as used (they must be free)."""
        for s, e in runs(np.sort(slots)):
            k = bisect.bisect_right(self._starts, s) - 1
            if k < 0 or self._ends[k] < e:
                raise ValueError(f"slots [{s}, {e}) are not free")
            start, end = self._starts[k], self._ends[k]
            del self._starts[k], self._ends[k]
            if e < end:
                self._starts.insert(k, e)
                self._ends.insert(k, end)
            if start < s:
                self._starts.insert(k, start)
                self._ends.insert(k, s)

    def reset(self) -> None:
        self._starts, self._ends = [], []
        cap, self.capacity = self.capacity, 0
        self.grow(cap)

    def _release(self, s: int, e: int) -> None:
        if s >= e:
            return
        k = bisect.bisect_left(self._starts, s)
        if (k > 0 and self._ends[k - 1] > s) or (k < len(self._starts) and self._starts[k] < e):
            raise ValueError(f"slots [{s}, {e}) are already free")
        merge_left = k > 0 and self._ends[k - 1] == s
        merge_right = k < len(self._starts) and self._starts[k] == e
        if merge_left and merge_right:
            self._ends[k - 1] = self._ends[k]
            del self._starts[k], self._ends[k]
        elif merge_left:
            self._ends[k - 1] = e
        elif merge_right:
            self._starts[k] = s
        else:
            self._starts.insert(k, s)
            self._ends.insert(k, e)


def runs(sorted_values: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers in a sorted array, as [start, end) pairs."""
    if sorted_values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_values) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [sorted_values.size]))
    return [
        (int(sorted_values[a]), int(sorted_values[b - 1]) + 1)
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
    ]
