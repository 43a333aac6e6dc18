"""Claims: a name bound once to rows, for consumers that must share a batch.

The first claim of a name binds it; every later claim of the name, however the calls race,
returns the same rows, across the wire in every deployment. A consumer that lost the race
releases its batch and its rows are handed out again. Names are bounded per partition, go
with a cleared partition, survive a controller restart, and bad claims are typed errors.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from transferqueue import TransferQueue
from transferqueue.controller.claims import Claims
from transferqueue.controller.core import Controller
from transferqueue.controller.journal import JournalSettings
from transferqueue.controller.journaled import JournaledController, open_controller
from transferqueue.errors import BadRequestError, UnknownRowError
from transferqueue.schema import FieldSpec


def test_the_first_claim_binds_and_racing_ones_get_its_rows(tq: TransferQueue) -> None:
    """Eight consumers of one group race, each with a batch of its own: all come back with
    the winner's rows; the losers' rows are handed out again, none consumed twice."""
    client = tq.client()
    client.put({"x": torch.arange(40).view(20, 2)}, partition="p")
    assert len(client.claim("g/0", partition="p")) == 0  # a lookup of an unbound name

    async def rank(ac: object) -> tuple[list[int], bool]:
        got = await ac.get_meta("t", ["x"], 2, partition="p", timeout_s=5.0)  # type: ignore[attr-defined]
        won = await ac.claim("g/0", got.indexes, partition="p")  # type: ignore[attr-defined]
        if np.array_equal(won.indexes, got.indexes):
            await ac.ack(got)  # type: ignore[attr-defined]
            return won.indexes.tolist(), True
        await ac.release(got)  # type: ignore[attr-defined]
        cols = await ac.get_data(won, ["x"])  # type: ignore[attr-defined]
        assert cols["x"][:, 0].tolist() == [2 * i for i in won.indexes.tolist()]
        return won.indexes.tolist(), False

    async def race() -> list[tuple[list[int], bool]]:
        ac = tq.async_client()
        return await asyncio.gather(*(rank(ac) for _ in range(8)))

    results = asyncio.run(race())
    shared = results[0][0]
    assert all(rows == shared for rows, _ in results)
    assert sum(won for _, won in results) == 1
    assert client.claim("g/0", partition="p").indexes.tolist() == shared
    rest = client.get_meta(task="t", fields=["x"], batch_size=20, partition="p", timeout_s=0.0)
    assert sorted(rest.indexes.tolist()) == sorted(set(range(20)) - set(shared))
    assert client.stats()["controller"]["partitions"]["p"]["claims"] == 1


def _core(n: int = 6) -> tuple[Controller, np.ndarray]:
    ctl = Controller(1)
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    meta = ctl.writes.allocate(n, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    return ctl, meta.indexes


def test_claims_are_bounded_and_go_with_a_cleared_partition() -> None:
    ctl, rows = _core()
    claims = Claims(ctl.rows, ctl.partitions, limit=2)
    for k in range(3):
        claims.claim("p", f"n{k}", rows[k : k + 1])
    assert claims.count("p") == 2  # the oldest went first
    assert len(claims.claim("p", "n0")) == 0
    assert claims.claim("p", "n2").indexes.tolist() == [int(rows[2])]
    ctl.queues.clear("p")
    assert claims.count("p") == 0 and ctl.claims.count("p") == 0


def test_bad_claims_are_typed_errors_and_bind_nothing() -> None:
    ctl, rows = _core()
    with pytest.raises(BadRequestError, match="indexes is empty"):
        ctl.claims.claim("p", "n", np.empty(0, dtype=np.int64))
    with pytest.raises(UnknownRowError):
        ctl.claims.claim("p", "n", np.array([10_000]))
    assert ctl.claims.count("p") == 0
    assert ctl.claims.claim("p", "n", rows[:2]).indexes.tolist() == rows[:2].tolist()


def test_a_claim_survives_a_controller_restart(tmp_path: Path) -> None:
    def make() -> JournaledController:
        return JournaledController(1)

    settings = JournalSettings(fsync="never")
    ctl, _ = open_controller(tmp_path / "d", make, settings)
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    meta = ctl.writes.allocate(4, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    ctl.claims.claim("p", "g/0", meta.indexes[1:3])
    ctl.claims.claim("p", "g/0", meta.indexes[:1])  # (bound already: changes nothing)
    shutil.copytree(tmp_path / "d", tmp_path / "copy")
    back, recovered = open_controller(tmp_path / "copy", make, settings)
    assert recovered
    assert back.claims.claim("p", "g/0").indexes.tolist() == meta.indexes[1:3].tolist()
    assert back.claims.bound == 1
