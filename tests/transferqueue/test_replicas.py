"""Two copies of each row (``replicas=2``): a storage unit that dies loses no row.

The placement never puts both copies of a row on one unit (and puts them on two hosts when
the units span several); a lost unit drops only its copies, so ``rows_lost`` stays 0 while
every row has its other copy; freeing frees both copies. Against real service processes
(``serve()`` and the ``transferqueue serve`` CLI), a SIGKILLed unit costs no row: every task
still consumes every row exactly once, bit-exact, and puts keep working while the unit is
down and after it is restarted. (The embedded deployment with ``replicas=2`` runs every
behaviour test of the ``tq`` fixture: the ``replicas`` deployment in conftest.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tq_helpers import until

import transferqueue
from transferqueue import Liveness
from transferqueue.controller.core import Controller
from transferqueue.controller.handlers import RowHandlers
from transferqueue.controller.service import ControllerService
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.grants import Grants, new_grant_key

LIVENESS = Liveness()
SLACK_S = 30.0  # a loaded 2-core machine may stall a process for seconds


# -- the controller core ---------------------------------------------------------------------
def _check_copies(ctl: Controller, meta: transferqueue.BatchMeta) -> None:
    """Both copies of every row on two different live units, on two hosts where it can."""
    units, rep = meta.units, meta.replica_units
    assert rep is not None
    alive = ctl.placement.alive
    hosts = np.array(ctl.placement.hosts)
    assert alive[units].all()
    if alive.sum() < 2:
        assert (rep == -1).all()
        return
    assert (rep >= 0).all() and (rep != units).all() and alive[rep].all()
    for u in np.unique(units).tolist():
        elsewhere = alive & (hosts != hosts[u])
        if elsewhere.any():
            assert (hosts[rep[units == u]] != hosts[u]).all()


@pytest.mark.parametrize("layout", ["one host", "two hosts", "a host each"])
@pytest.mark.parametrize("num_units", [2, 3, 5])
def test_placement_never_puts_both_copies_on_one_unit(num_units: int, layout: str) -> None:
    rng = np.random.default_rng(num_units)
    ctl = Controller(num_units, spread_bytes=1 << 10, replicas=2)
    for u in range(num_units):
        host = {"one host": "h", "two hosts": f"h{u % 2}", "a host each": f"h{u}"}[layout]
        ctl.placement.set_host(u, host)
    for step in range(300):
        if step % 25 == 24:  # a unit dies or comes back (one stays alive)
            u = int(rng.integers(num_units))
            if ctl.placement.alive[u] and ctl.placement.alive.sum() > 1:
                ctl.health.lose_unit(u)
            else:
                ctl.health.unit_back(u)
        n = int(rng.integers(1, 40))
        nbytes = int(rng.integers(0, 8 << 10))
        producer = f"p{int(rng.integers(3))}" if rng.random() < 0.5 else None
        meta = ctl.writes.allocate(n, "p", nbytes=nbytes, producer=producer)
        _check_copies(ctl, meta)
    # every live row, after all those deaths: its copies on distinct live units
    h = ctl.rows.header
    live = np.flatnonzero(h["live"])
    assert ctl.placement.alive[h["unit"][live]].all()
    rep = h["replica"][live]
    assert (rep[rep >= 0] != h["unit"][live][rep >= 0]).all()
    assert ctl.placement.alive[rep[rep >= 0]].all()


def test_a_lost_unit_loses_no_row_that_has_another_copy_and_free_frees_both() -> None:
    ctl = Controller(3, spread_bytes=0, replicas=2)
    ctl.queues.declare_tasks("p", ["t"])
    meta = ctl.writes.allocate(30, "p")
    assert meta.replica_units is not None
    ctl.rows.register_fields({"x": transferqueue.FieldSpec("dense", "float32", ())}, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    on1 = (meta.units == 1) | (meta.replica_units == 1)
    ctl.health.lose_unit(1)
    stats = ctl.stats()
    assert (stats["rows_lost"], stats["units_lost"]) == (0, 1)
    assert stats["rows_one_copy"] == int(on1.sum())
    got, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=30, lease_s=60)
    assert got is not None and got.indexes.tolist() == meta.indexes.tolist()
    assert got.replica_units is not None
    assert 1 not in got.units.tolist() and 1 not in got.replica_units.tolist()
    # the rows that kept one copy: on the unit of their other copy
    other = np.where(meta.units == 1, meta.replica_units, meta.units)
    assert (got.units[on1] == other[on1]).all() and (got.replica_units[on1] == -1).all()
    # losing a second unit loses the rows whose one copy was there, and only those
    ctl.health.lose_unit(0)
    gone = on1 & (other == 0)
    assert ctl.stats()["rows_lost"] == int(gone.sum())
    ctl.health.unit_back(0)
    ctl.health.unit_back(1)
    changes = ctl.queues.ack(got.lease_id or 0, got.indexes[~gone])
    freed = np.concatenate(changes.freed)
    freed_units = np.concatenate(changes.freed_units)
    # each row freed on every unit that still held a copy of it, on no other
    kept = zip(got.indexes[~gone], got.units[~gone], got.replica_units[~gone], strict=True)
    want = sorted((int(i), int(u)) for i, a, b in kept for u in (a, b) if u >= 0 and u != 0)
    assert sorted(zip(freed.tolist(), freed_units.tolist(), strict=True)) == want
    assert ctl.stats()["rows_live"] == 0
    assert ctl.placement.unit_bytes.tolist() == [0, 0, 0]


def test_the_grant_of_each_unit_covers_the_rows_of_both_copies() -> None:
    key = new_grant_key()
    svc = ControllerService(
        Controller(3, spread_bytes=0, replicas=2), lambda u, i: None, grants=Grants(key)
    )  # type: ignore[arg-type,return-value]
    meta = RowHandlers(svc).allocate(m.Allocate(n=100, partition="p"), protocol.TRUSTED)
    assert isinstance(meta, transferqueue.BatchMeta) and meta.replica_units is not None
    assert meta.grants is not None and sorted(meta.grants) == [0, 1, 2]
    check = Grants(key)
    for u, grant in meta.grants.items():
        rows = meta.indexes[(meta.units == u) | (meta.replica_units == u)]
        check.check(grant, u, rows)  # (raises DeniedError if not covered)
        with pytest.raises(transferqueue.DeniedError):
            check.check(grant, u, np.array([int(meta.indexes[-1]) + 1]))


def test_replicas_must_be_one_or_two_and_at_most_the_units() -> None:
    with pytest.raises(ValueError, match="replicas must be 1"):
        transferqueue.start(num_units=2, replicas=3)
    with pytest.raises(ValueError, match="replicas=2 needs at least 2 storage units"):
        transferqueue.start(num_units=1, replicas=2)
    with pytest.raises(ValueError, match="replicas=2 needs at least as many storage units"):
        transferqueue.serve(num_units=1, replicas=2)


# -- the local service -----------------------------------------------------------------------
def _rows(start: int, n: int) -> dict[str, Any]:
    """Columns whose every bit depends on the row (a wrong row or copy shows)."""
    gen = torch.Generator().manual_seed(start)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    r = [torch.full((1 + (start + i) % 7,), start + i, dtype=torch.int32) for i in range(n)]
    return {"x": x, "r": r}


class Expected:
    """What each row index must read back as."""

    def __init__(self) -> None:
        self.x: dict[int, torch.Tensor] = {}
        self.r: dict[int, torch.Tensor] = {}

    def put(self, c: transferqueue.Client, start: int, n: int) -> transferqueue.BatchMeta:
        cols = _rows(start, n)
        meta = c.put(cols, partition="p")
        for k, i in enumerate(meta.indexes.tolist()):
            self.x[i], self.r[i] = cols["x"][k], cols["r"][k]
        return meta

    def check(self, meta: transferqueue.BatchMeta, cols: dict[str, Any]) -> None:
        for k, i in enumerate(meta.indexes.tolist()):
            assert torch.equal(cols["x"][k], self.x[i]), i  # (float64 equal: bit-exact)
            assert torch.equal(cols["r"][k], self.r[i]), i


def _consume(c: transferqueue.Client, task: str, want: Expected, batch: int = 97) -> list[int]:
    seen: list[int] = []
    while True:
        b = c.get_meta(task, ["x", "r"], batch, partition="p", timeout_s=60)
        if len(b):
            want.check(b, c.get_data(b))
            seen += b.indexes.tolist()
            c.ack(b)
        if b.is_end:
            return seen
        assert len(b), f"task {task!r}: no batch within 60 s"


def _ctl(c: transferqueue.Client) -> dict[str, Any]:
    return c.stats()["controller"]  # type: ignore[no-any-return]


def _kill_and_recover(
    c: transferqueue.Client,
    kill: Callable[[], None],
    restarted: Callable[[], bool],
    num_units: int,
) -> None:
    """The scenario both deployments go through (see the module docstring)."""
    want = Expected()
    c.declare_tasks(["a", "b"], partition="p")
    first = want.put(c, 0, 600)
    assert first.replica_units is not None and (first.replica_units >= 0).all()
    held = c.get_meta("a", ["x", "r"], 300, partition="p", lease_s=600)  # leased before
    kill()
    during = want.put(c, 1000, 300)  # the unit is dead, not yet declared so
    want.check(held, c.get_data(held))  # its rows come from their other copies
    c.ack(held)
    until(lambda: _ctl(c)["units_lost"] == 1, LIVENESS.bound_s + SLACK_S, "unit lost")
    down = want.put(c, 2000, 300)  # (with 2 units: one copy each, on the live one)
    until(restarted, LIVENESS.bound_s + SLACK_S + 30, "restart")
    until(lambda: all(_ctl(c)["units_alive"]), SLACK_S, "unit back")
    after = want.put(c, 3000, 300)
    assert after.replica_units is not None and (after.replica_units >= 0).all()
    c.finish("p")
    put = np.concatenate([x.indexes for x in (first, during, down, after)]).tolist()
    for task, done in (("a", held.indexes.tolist()), ("b", [])):
        seen = done + _consume(c, task, want)
        assert len(seen) == len(set(seen)), f"task {task!r} got a row twice"
        assert sorted(seen) == sorted(put), f"task {task!r} missed rows"
    stats = _ctl(c)
    assert (stats["rows_lost"], stats["units_lost"]) == (0, 1)
    assert stats["partitions"]["p"]["tasks"]["b"]["lost"] == 0
    assert stats["rows_live"] == 0
    units = c.stats()["units"]
    assert len(units) == num_units
    # every copy freed (a unit that never died holds nothing; the restarted one was cleared)
    assert all(u["rows"] == 0 for i, u in enumerate(units) if i != 1), units


@pytest.mark.slow
@pytest.mark.service
def test_a_unit_killed_under_serve_with_replicas_loses_no_row() -> None:
    with (
        transferqueue.serve(num_units=3, spread_bytes=0, replicas=2) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        _kill_and_recover(
            c,
            lambda: os.kill(svc.pids[1], signal.SIGKILL),
            lambda: svc.restarts[1] == 1,
            3,
        )
        assert svc.alive()


@pytest.mark.slow
@pytest.mark.service
def test_stats_do_not_wait_on_a_unit_the_controller_declared_gone() -> None:
    """A unit down for good (no restart): once the controller declared it gone, ``stats()``
    answers at once, that unit's entry an error naming it; before, every call waited the
    liveness bound on it (the step records of a Ray run whose node was lost lagged 4 s a step
    until a new node took the unit)."""
    import time

    with (
        transferqueue.serve(num_units=2, replicas=2, max_restarts=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        os.kill(svc.pids[1], signal.SIGKILL)
        until(lambda: _ctl(c)["units_lost"] == 1, LIVENESS.bound_s + SLACK_S, "unit lost")
        t0 = time.monotonic()
        stats = c.stats()
        took = time.monotonic() - t0
        assert stats["controller"]["units_alive"] == [True, False]
        assert "storage unit 1 is gone" in stats["units"][1]["error"], stats["units"]
        assert "rows" in stats["units"][0]
        assert took < LIVENESS.dead_after_s / 2, took


def _unit_pid(cli_pid: int, unit: int) -> int:
    found = []
    for task in os.listdir(f"/proc/{cli_pid}/task"):
        with open(f"/proc/{cli_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as g:
                    if f" unit --unit-id {unit} " in g.read().replace(b"\0", b" ").decode():
                        found.append(int(child))
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
@pytest.mark.service
def test_a_unit_killed_under_the_cli_with_replicas_loses_no_row() -> None:
    cmd = [sys.executable, "-m", "transferqueue.deploy.cli", "serve", "--units", "2"]
    cmd += ["--replicas", "2", "--spread-bytes", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        with transferqueue.connect(address) as tq:
            c = tq.client()
            assert _ctl(c)["replicas"] == 2
            victim = _unit_pid(proc.pid, 1)
            _kill_and_recover(
                c,
                lambda: os.kill(victim, signal.SIGKILL),
                lambda: _unit_pid(proc.pid, 1) != victim,
                2,
            )
        assert proc.poll() is None  # the CLI still serves
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_a_copy_the_writer_found_gone_is_dropped_and_the_rows_keep_the_other() -> None:
    # A client may lose sight of a unit the controller still hears (it stalled, or the
    # network between them did): the put lands on each row's other copy, and the commit
    # tells the controller, which forgets (and frees) the copies there.
    with transferqueue.start(num_units=3, spread_bytes=0, replicas=2) as tq:
        c = tq.client()
        link = tq._units[1]
        write = link.write

        async def gone(*args: Any, **kwargs: Any) -> None:
            raise transferqueue.PeerGoneError("unit 1 has not answered (simulated)")

        link.write = gone  # type: ignore[method-assign]
        want = Expected()
        meta = want.put(c, 0, 90)
        assert meta.replica_units is not None
        on1 = (meta.units == 1) | (meta.replica_units == 1)
        stats = _ctl(c)
        assert (stats["rows_lost"], stats["rows_one_copy"]) == (0, int(on1.sum()))
        assert c.stats()["units"][1]["rows"] == 0
        got = c.get_meta("t", ["x", "r"], 90, partition="p")
        assert got.replica_units is not None
        assert 1 not in got.units.tolist() and 1 not in got.replica_units.tolist()
        want.check(got, c.get_data(got))
        # a field added while the unit is out of sight: the same
        link.write = write  # type: ignore[method-assign]
        fresh = want.put(c, 100, 90)
        assert fresh.replica_units is not None
        held = c.get_meta("t", ["x", "r"], 90, partition="p")
        assert held.indexes.tolist() == fresh.indexes.tolist()
        link.write = gone  # type: ignore[method-assign]
        c.put({"y": torch.arange(90.0)}, meta=held)
        assert _ctl(c)["rows_one_copy"] == int(on1.sum()) * 2
        read = c.get_meta("u", ["y"], 90, partition="p", timeout_s=5)
        assert read.indexes.tolist() == fresh.indexes.tolist()
        assert read.replica_units is not None and 1 not in read.units.tolist()
        assert torch.equal(c.get_data(read)["y"], torch.arange(90.0))
        # a put whose only unit left for some rows is gone fails, as with one copy
        link.write = gone  # type: ignore[method-assign]
        tq._units[2].write = gone  # type: ignore[method-assign]
        with pytest.raises(transferqueue.PeerGoneError):
            c.put(
                {
                    "x": torch.zeros(30, 4, dtype=torch.float64),
                    "r": [torch.ones(1, dtype=torch.int32)] * 30,
                }
            )


@pytest.mark.slow
@pytest.mark.ray
def test_a_unit_actor_killed_on_ray_with_replicas_loses_no_row(ray_cluster: None) -> None:
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-replicas-{os.getpid()}"
    with start_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix, replicas=2) as tq:
        c = tq.client()
        assert _ctl(c)["replicas"] == 2
        unit = ray.get_actor(f"{prefix}-unit1")
        pid = ray.get(unit.pid.remote(), timeout=60)

        def restarted() -> bool:
            try:
                return bool(ray.get(unit.pid.remote(), timeout=5) != pid)
            except Exception:  # (restarting)
                return False

        _kill_and_recover(c, lambda: os.kill(pid, signal.SIGKILL), restarted, 2)
