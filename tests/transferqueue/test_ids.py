"""Lease and request ids drawn in blocks from the OS's CSPRNG (transferqueue.wire.ids): in range,
distinct, one OS call per block, and never the parent's ids again in a forked child."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transferqueue.controller.leases import LeaseTable
from transferqueue.wire import ids


def test_ids_are_63_bit_nonzero_and_distinct() -> None:
    drawn = [ids.random_id63() for _ in range(5 * ids.BLOCK)]
    assert all(0 < v < 2**63 for v in drawn)
    assert len(set(drawn)) == len(drawn)
    assert max(drawn).bit_length() >= 60  # (63 random bits, not a counter)


def test_one_os_call_draws_a_block(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        calls.append(n)
        return real(n)

    monkeypatch.setattr(ids.os, "urandom", counting)
    ids._pool.clear()
    for _ in range(ids.BLOCK - 1):  # (a zero id, one in 2**63, would be dropped)
        ids.random_id63()
    assert calls == [8 * ids.BLOCK]


def test_a_forked_child_does_not_reuse_the_parents_pool() -> None:
    ids._pool.clear()
    ids.random_id63()  # the pool now holds ids the parent will hand out next
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first id goes to the parent
        os.close(read)
        os.write(write, ids.random_id63().to_bytes(8, "little"))
        os._exit(0)
    os.close(write)
    child = int.from_bytes(os.read(read, 8), "little")
    os.close(read)
    os.waitpid(pid, 0)
    assert not ids._pool or child not in ids._pool
    assert child != ids.random_id63()


def test_lease_ids_come_from_the_pool() -> None:
    table = LeaseTable(lambda: 0.0)
    ids._pool.clear()
    ids._pool.extend([7, 9])
    lease = table.open((0, "t"), np.arange(4, dtype=np.int64), 10.0)
    assert lease.lease_id == 9
