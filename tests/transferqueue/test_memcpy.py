"""Bulk copies: ``copy_bytes`` splits a large copy over two threads and is bit-exact, for
sizes below and above the split and halves that do not fall on a 64-byte boundary."""

from __future__ import annotations

import numpy as np
import pytest

from transferqueue.memcpy import SPLIT_BYTES, copy_bytes


@pytest.mark.parametrize("n", [0, 1, 4096, SPLIT_BYTES - 1, SPLIT_BYTES, SPLIT_BYTES * 2 + 37])
def test_copy_bytes_is_bit_exact_whole_or_split(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.full(n + 2, 7, dtype=np.uint8)  # (a byte each side: nothing written past)
    copy_bytes(dst[1 : n + 1], src)
    assert np.array_equal(dst[1 : n + 1], src)
    assert dst[0] == 7 and dst[-1] == 7


def test_a_copy_of_mismatched_sizes_raises_and_the_helper_goes_on() -> None:
    src = np.ones(SPLIT_BYTES * 2, dtype=np.uint8)
    with pytest.raises(ValueError):
        copy_bytes(np.zeros(SPLIT_BYTES * 2, dtype=np.uint8)[::2], src)  # (shapes differ)
    dst = np.zeros_like(src)
    copy_bytes(dst, src)  # (the helper thread is free again)
    assert bool((dst == 1).all())
