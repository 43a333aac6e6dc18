"""A controller with a ``state_dir`` survives its own SIGKILL: the supervisor restarts it on
its address, it recovers its rows, tasks and leases, reconciles with the storage units, and
the clients that were connected go on (real processes on loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tq_helpers import answered, child_processes, row_values, until

import transferqueue
from transferqueue.client.async_client import AsyncClient
from transferqueue.errors import PeerGoneError, RowsLostError
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m

pytestmark = [pytest.mark.service, pytest.mark.slow]  # (every test restarts a controller)

SLACK_S = 60.0  # a restart on a loaded 2-core machine: a new interpreter, recovery, units


def _half_put(client: transferqueue.Client, partition: str) -> BatchMeta:
    """Rows allocated and written to their unit, never committed (a producer the controller
    died under): the client's own steps of a put, less the commit."""
    ac = client.async_client
    cols = {"x": row_values(10**6, 1)}
    specs = {"x": FieldSpec.dense("float64", (4,))}

    async def go() -> BatchMeta:
        meta = await ac._ctl.call(m.Allocate(n=1, partition=partition))
        await ac._writer.write_units(meta, cols, specs, create=True)
        return meta

    return ac._io.run(go(), timeout=60)


def _x(client: transferqueue.Client, meta: BatchMeta) -> torch.Tensor:
    x = client.get_data(meta)["x"]
    assert isinstance(x, torch.Tensor)
    return x


def _stats(client: transferqueue.Client) -> dict[str, Any]:
    return client.stats()


def _kill_controller(svc: transferqueue.LocalService) -> None:
    old = svc.pids[-1]
    os.kill(old, signal.SIGKILL)
    until(lambda: svc.controller_restarts[0] == 1 and svc.pids[-1] != old, SLACK_S, "restart")


def test_a_killed_controller_comes_back_with_every_row_lease_and_ack(tmp_path: Path) -> None:
    with (
        transferqueue.serve(num_units=2, state_dir=tmp_path / "state", spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["t"], partition="p")
        value_of: dict[int, torch.Tensor] = {}
        for k in range(10):
            meta = c.put({"x": row_values(100 * k, 100)}, partition="p")
            for pos, index in enumerate(meta.indexes.tolist()):
                value_of[index] = row_values(100 * k + pos, 1)[0]
        assert len(value_of) == 1000
        acked: list[int] = []
        for _ in range(3):
            b = c.get_meta("t", ["x"], 100, partition="p", timeout_s=30)
            assert torch.equal(_x(c, b), torch.stack([value_of[i] for i in b.indexes]))
            c.ack(b)
            acked += b.indexes.tolist()
        held = c.get_meta("t", ["x"], 100, partition="p", timeout_s=30, lease_s=600)
        assert len(held) == 100
        half = _half_put(c, "q")
        before = _stats(c)
        units_rows_before = sum(u["rows"] for u in before["units"])
        assert units_rows_before == 701  # (700 unconsumed, 1 written and not committed)

        _kill_controller(svc)
        after = answered(lambda: _stats(c), SLACK_S)  # the same client, connected all along
        was, now = before["controller"], after["controller"]
        assert now["rows_live"] == was["rows_live"] - 1  # (the row never committed: below)
        for key in ("next_index", "active_leases", "fields", "rows_lost", "units_alive"):
            assert now[key] == was[key], key
        part_before = before["controller"]["partitions"]["p"]
        assert after["controller"]["partitions"]["p"] == part_before
        assert after["controller"]["rows_reclaimed"] == 1  # the row never committed...
        assert sum(u["rows"] for u in after["units"]) == 700  # ...is freed on its unit
        with pytest.raises(RowsLostError):  # (its producer learns it, should it commit now)
            c.async_client._io.run(
                c.async_client._ctl.call(m.Commit(indexes=half.indexes, fields=["x"])),
                timeout=30,
            )

        c.ack(held)  # the lease taken before the crash
        new = c.put({"x": row_values(5000, 50)}, partition="p")  # fresh indexes, no overwrite
        assert int(new.indexes.min()) > max(value_of) and int(new.indexes.min()) > half.indexes[0]
        for pos, index in enumerate(new.indexes.tolist()):
            value_of[index] = row_values(5000 + pos, 1)[0]
        seen: list[int] = []
        while True:
            b = c.get_meta("t", ["x"], 128, partition="p", timeout_s=5)
            if not len(b):
                break
            assert torch.equal(_x(c, b), torch.stack([value_of[i] for i in b.indexes]))
            c.ack(b)
            seen += b.indexes.tolist()
        old = set(value_of) - set(new.indexes.tolist())
        assert not set(seen) & (set(acked) | set(held.indexes.tolist()))  # nothing comes back
        assert sorted(set(seen) | set(acked) | set(held.indexes.tolist())) == sorted(value_of)
        assert len(seen) == len(set(seen)) == 650 and len(old) == 1000
        final = _stats(c)["controller"]["partitions"]["p"]
        assert final["tasks"]["t"]["done"] == 1050 and final["rows_live"] == 0
        assert final["rows_lost"] == 0


class _CommitThenDie:
    """The client's controller link, whose commit lands (journaled) and whose reply dies
    with the controller: SIGKILLed right after, the call fails as a dropped connection."""

    def __init__(self, real: Any, pid: int) -> None:
        self.real, self.pid = real, pid

    async def call(self, msg: Any) -> Any:
        result = await self.real.call(msg)
        if isinstance(msg, m.Commit):
            os.kill(self.pid, signal.SIGKILL)
            raise PeerGoneError("the connection dropped while 'commit' waited on it")
        return result


def _dying(client: transferqueue.Client, pid: int) -> transferqueue.Client:
    """Another client of ``client``'s TransferQueue whose commits land (journaled) and
    then die with the controller (process ``pid``)."""
    ac = client.async_client
    units = list(ac._units.values())
    dying = AsyncClient(ac._io, _CommitThenDie(ac._ctl, pid), units, owner=ac._owner)
    return transferqueue.Client(dying, ac._io)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("polled", [True, False], ids=["polled", "unpolled"])
def test_a_put_whose_commit_landed_as_the_controller_died_loses_nothing(
    tmp_path: Path, replicas: int, polled: bool
) -> None:
    """The put fails (its outcome unknown to the producer) but its commit was journaled.
    The client no longer frees its rows on the units (the restarted controller found them
    committed and missing: lost); it asks the controller to discard them, which it does
    while no consumer has polled the partition's task (the rows never were, for anyone).
    Otherwise the rows are served whole. Either way no row is lost."""
    with (
        transferqueue.serve(
            num_units=2, replicas=replicas, state_dir=tmp_path / "state", spread_bytes=0
        ) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["t"], partition="p")
        if polled:
            assert not len(c.get_meta("t", ["x"], 32, partition="p", timeout_s=0))
        x = row_values(7000, 16)
        with pytest.raises(PeerGoneError):
            _dying(c, svc.pids[-1]).put({"x": x}, partition="p")
        until(lambda: svc.controller_restarts[0] == 1, SLACK_S, "restart")
        meta = answered(lambda: c.get_meta("t", ["x"], 32, partition="p", timeout_s=2), SLACK_S)
        stats = _stats(c)
        controller = stats["controller"]
        assert controller["rows_lost"] == 0
        if polled:
            assert len(meta) == 16, "the committed rows are served after the restart"
            got = _x(c, meta)
            assert torch.equal(got[torch.argsort(got[:, 0])], x)
            assert controller["rows_live"] == 16
        else:
            assert len(meta) == 0 and controller["rows_live"] == 0
            until(lambda: sum(u["rows"] for u in _stats(c)["units"]) == 0, SLACK_S, "freed")


def test_a_kv_put_whose_commit_landed_as_the_controller_died_loses_nothing(
    tmp_path: Path,
) -> None:
    """As above, for a new key (no task has seen its row): the key's row is discarded, the
    key forgotten, nothing lost and nothing left on the units."""
    with (
        transferqueue.serve(num_units=2, replicas=2, state_dir=tmp_path / "state") as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.kv_put("kept", {"x": row_values(1, 1)[0]}, partition="kv")
        with pytest.raises(PeerGoneError):
            _dying(c, svc.pids[-1]).kv_put("k", {"x": row_values(7, 1)[0]}, partition="kv")
        until(lambda: svc.controller_restarts[0] == 1, SLACK_S, "restart")
        listing = answered(lambda: c.kv_list("kv"), SLACK_S)
        assert list(listing.keys) == ["kept"]
        assert torch.equal(c.kv_get("kept", partition="kv")["x"], row_values(1, 1)[0])
        assert _stats(c)["controller"]["rows_lost"] == 0
        until(lambda: [u["rows"] for u in _stats(c)["units"]] == [1, 1], SLACK_S, "freed")


def test_rows_of_a_unit_that_restarted_while_the_controller_was_down_are_lost(
    tmp_path: Path,
) -> None:
    with (
        transferqueue.serve(num_units=2, state_dir=tmp_path / "state", spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        meta = c.put({"x": row_values(0, 200)}, partition="p")
        on1 = meta.indexes[meta.units == 1]
        assert on1.size and on1.size < 200
        # the controller dies; then unit 1 dies too (restarted empty by the supervisor)
        ctl, unit1 = svc.pids[-1], svc.pids[1]
        os.kill(ctl, signal.SIGKILL)
        os.kill(unit1, signal.SIGKILL)
        until(lambda: svc.controller_restarts[0] == 1, SLACK_S, "controller restart")
        until(lambda: svc.restarts[1] == 1, SLACK_S, "unit restart")
        answered(lambda: _stats(c), SLACK_S)
        # (the unit may come back before the controller's reconcile or after: either way its
        # rows are lost, by the inventory or by the heartbeat that sees a new incarnation)
        until(lambda: _stats(c)["controller"]["rows_lost"] == on1.size, SLACK_S, "lost")
        st = _stats(c)["controller"]
        assert st["partitions"]["p"]["rows_live"] == 200 - on1.size
        got = c.get_meta("t", ["x"], 200, partition="p", timeout_s=5)
        assert sorted(got.indexes.tolist()) == sorted(meta.indexes[meta.units == 0].tolist())
        pos = np.searchsorted(meta.indexes, got.indexes)
        assert torch.equal(_x(c, got), row_values(0, 200)[torch.from_numpy(pos)])


def test_a_restarted_controller_serves_without_a_unit_that_does_not_answer(
    tmp_path: Path,
) -> None:
    """Unit 1 hangs (SIGSTOP: alive, silent, so nobody restarts it) and the controller is
    SIGKILLed. The restarted controller asks the unit for a while, then serves without it:
    its rows are lost and reported, unit 0's are served, puts go to unit 0. Once the unit
    answers again it is cleared and takes new rows. (Before, the restarted controller exited
    when a unit did not answer, and was restarted until its restarts ran out: a silent unit
    took the whole service down.)"""
    with (
        transferqueue.serve(num_units=2, state_dir=tmp_path / "state", spread_bytes=0) as svc,
        transferqueue.connect(svc.address, ride_through_s=120.0) as tq,
    ):
        c = tq.client()
        meta = c.put({"x": row_values(0, 200)}, partition="p")
        on1 = meta.indexes[meta.units == 1]
        assert on1.size and on1.size < 200
        unit1 = svc.pids[1]
        os.kill(unit1, signal.SIGSTOP)
        try:
            os.kill(svc.pids[-1], signal.SIGKILL)
            st = _stats(c)["controller"]  # (sent again until the restarted one serves)
            assert svc.controller_restarts[0] == 1
            assert st["units_alive"] == [True, False] and st["rows_lost"] == on1.size
            got = c.get_meta("t", ["x"], 200, partition="p", timeout_s=5)
            assert sorted(got.indexes.tolist()) == sorted(meta.indexes[meta.units == 0].tolist())
            pos = np.searchsorted(meta.indexes, got.indexes)
            assert torch.equal(_x(c, got), row_values(0, 200)[torch.from_numpy(pos)])
            assert set(c.put({"x": row_values(500, 50)}, partition="p").units.tolist()) == {0}
        finally:
            os.kill(unit1, signal.SIGCONT)
        until(lambda: _stats(c)["controller"]["units_alive"] == [True, True], SLACK_S, "back")
        assert svc.controller_restarts[0] == 1 and svc.restarts[1] == 0  # the same processes
        again = c.put({"x": row_values(1000, 200)}, partition="p")
        assert set(again.units.tolist()) == {0, 1}
        assert torch.equal(_x(c, again), row_values(1000, 200))


def _controller_pids(cli_pid: int) -> list[int]:
    try:
        return [p for p, cmd in child_processes(cli_pid) if " controller " in cmd]
    except FileNotFoundError:  # (a child that exited while we looked)
        return []


def test_the_cli_with_a_state_dir_restarts_its_controller(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "transferqueue.deploy.cli", "serve", "--units", "1"]
    cmd += ["--state-dir", str(tmp_path / "state"), "--fsync", "always"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        with transferqueue.connect(address) as tq:
            c = tq.client()
            meta = c.put({"x": row_values(0, 64)})
            (victim,) = _controller_pids(proc.pid)
            os.kill(victim, signal.SIGKILL)
            until(lambda: set(_controller_pids(proc.pid)) - {victim}, SLACK_S, "restart")
            # (a get_meta that failed as gone may still reach the new controller, queued in
            # the socket: the client gives back the batch it leased, or this would be empty)
            got = answered(lambda: c.get_meta("t", ["x"], 64, timeout_s=10), SLACK_S)
            assert got.indexes.tolist() == meta.indexes.tolist()
            assert torch.equal(_x(c, got), row_values(0, 64))
            assert proc.poll() is None  # the service served on
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
    assert os.path.exists(tmp_path / "state" / "snapshot")  # (and a clean stop wrote one)


def test_a_handle_idle_through_a_restart_is_not_failed_by_the_old_drop(tmp_path: Path) -> None:
    """A handle that made no call while its controller was killed and restarted: its next
    call (of any kind, with no ride-through) goes to the restarted controller on the
    connection ZeroMQ made again, and is answered. The drop its connection saw meanwhile
    is old news; it failed that call as "dropped" when the handle's loop read it late."""
    with (
        transferqueue.serve(num_units=1, state_dir=tmp_path / "state") as svc,
        transferqueue.connect(svc.address) as idle,
        transferqueue.connect(svc.address) as probe,
    ):
        c = idle.async_client()
        idle.run(c.put({"x": torch.arange(4).view(4, 1)}, partition="p"))
        _kill_controller(svc)
        answered(lambda: probe.client().stats(), SLACK_S)  # the restarted one serves
        for _ in range(3):  # (calls through the handle's loop, as an async program makes)
            idle.run(c.finish("p"))
            idle.run(c.clear("p"))
