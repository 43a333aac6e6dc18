"""SlotMap and ExtentAllocator against simple models, over random operation sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from transferqueue.slots import ExtentAllocator, SlotMap, runs


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=60))
def test_slotmap_matches_a_dict(ops: list[tuple[bool, int]]) -> None:
    sm = SlotMap(capacity=16)
    model: dict[int, int] = {}
    next_index = 0
    rng = np.random.default_rng(len(ops))
    for insert, n in ops:
        if insert or not model:
            # indexes arrive mostly in order, sometimes a batch from the past is late
            start = next_index if rng.random() < 0.8 or next_index < 50 else next_index - 45
            idx = np.arange(start, start + n, dtype=np.int64)
            idx = idx[[int(i) not in model for i in idx]]
            if start == next_index:
                next_index += n
            slots = rng.integers(0, 1 << 20, idx.size)
            sm.insert(idx, slots)
            model.update(zip(idx.tolist(), slots.tolist(), strict=True))
        else:
            keys = np.array(sorted(model), dtype=np.int64)
            drop = rng.choice(keys, size=min(n, keys.size), replace=False)
            sm.remove(drop)
            for k in drop.tolist():
                del model[k]
        assert len(sm) == len(model)
        probe = np.arange(0, next_index + 5, dtype=np.int64)
        want = np.array([model.get(int(i), -1) for i in probe])
        assert np.array_equal(sm.lookup(probe), want)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 50)), min_size=1, max_size=60))
def test_extent_allocator_never_double_allocates(ops: list[tuple[bool, int]]) -> None:
    alloc = ExtentAllocator(64)
    held: set[int] = set()
    rng = np.random.default_rng(len(ops))
    for allocate, n in ops:
        if allocate:
            got = alloc.allocate(n)
            if got is None:
                assert alloc.free_count < n
                alloc.grow(alloc.capacity + n)
                got = alloc.allocate(n)
                assert got is not None
            assert got.size == n and len(set(got.tolist()) & held) == 0
            assert got.min() >= 0 and got.max() < alloc.capacity
            if alloc.free_count + n == alloc.capacity and not held:
                assert runs(got) == [(int(got[0]), int(got[0]) + n)]  # contiguous when free
            held |= set(got.tolist())
        elif held:
            drop = rng.choice(sorted(held), size=min(n, len(held)), replace=False)
            alloc.free(drop)
            held -= set(drop.tolist())
        assert alloc.used == len(held)


def test_freed_ranges_merge_back_into_one() -> None:
    alloc = ExtentAllocator(100)
    a, b, c = alloc.allocate(30), alloc.allocate(30), alloc.allocate(40)
    assert a is not None and b is not None and c is not None
    alloc.free(b)
    alloc.free(a)
    alloc.free(c)
    whole = alloc.allocate(100)
    assert whole is not None and runs(whole) == [(0, 100)]


def test_reserve_takes_slots_out_of_the_free_ranges() -> None:
    alloc = ExtentAllocator(10)
    alloc.reserve(np.array([0, 1, 5]))
    got = alloc.allocate(7)
    assert got is not None and sorted(got.tolist()) == [2, 3, 4, 6, 7, 8, 9]
    alloc.free(np.array([5]))
    assert alloc.allocate(1) is not None and alloc.free_count == 0


def test_slot_map_keys_are_the_indexes_present_after_rebases() -> None:
    sm = SlotMap(16)
    rng = np.random.default_rng(5)
    present: set[int] = set()
    for lo in (1000, 3, 70000, 5):  # (windows that move down and grow)
        idx = np.unique(rng.integers(lo, lo + 500, size=200)).astype(np.int64)
        idx = idx[~np.isin(idx, list(present))]
        sm.insert(idx, np.arange(idx.size, dtype=np.int64))
        present |= set(idx.tolist())
        gone = idx[::3]
        sm.remove(gone)
        present -= set(gone.tolist())
        assert sm.keys().tolist() == sorted(present)


def test_slot_map_lookup_outside_its_window_finds_nothing() -> None:
    sm = SlotMap(capacity=16)
    sm.insert(np.arange(1000, 1010, dtype=np.int64), np.arange(10, dtype=np.int64))
    probe = np.array([-5, 0, 999, 1000, 1009, 1010, 1000 + 16, 2**62], dtype=np.int64)
    assert sm.lookup(probe).tolist() == [-1, -1, -1, 0, 9, -1, -1, -1]
    assert sm.lookup(np.array([1003, 1001], dtype=np.int32)).tolist() == [3, 1]
    assert sm.lookup(np.empty(0, dtype=np.int64)).tolist() == []
