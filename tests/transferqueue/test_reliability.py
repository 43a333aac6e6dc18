"""Servers and producers that die: a dead storage unit is noticed within the liveness bound,
its rows are reported lost (never served, never poisoning batches), the other unit keeps
serving, the supervisor restarts the unit and new puts land on it; calls waiting on a dead
server fail with a typed error instead of at their minute-long timeout; a producer killed
mid-put leaves no live rows and no shared memory behind once its allocation's deadline passes.

Every wait here is on an event (a stats counter, a process state) with a generous bound: the
machine may be loaded, so no duration is asserted tighter than several seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from tq_helpers import child_processes, until

import transferqueue
from transferqueue import Liveness, PeerGoneError, Ragged, RowsLostError
from transferqueue.client.unit_link import RemoteUnitLink
from transferqueue.controller.core import Controller
from transferqueue.storage.shm import shm_available
from transferqueue.wire import messages as m

pytestmark = pytest.mark.service

LIVENESS = Liveness()  # the defaults: what users get
SLACK_S = 15.0  # added to every bound: a loaded 2-core machine may stall a process for seconds


def _ctl(client: transferqueue.Client) -> dict[str, Any]:
    return client.stats()["controller"]  # type: ignore[no-any-return]


def _put_over_both(client: transferqueue.Client, start: int, n: int = 1000) -> Any:
    meta = client.put({"x": torch.arange(start, start + n).view(n, 1)})
    assert sorted(np.unique(meta.units).tolist()) == [0, 1]  # (spread_bytes=0)
    return meta


# -- the controller core ---------------------------------------------------------------------
def test_lose_unit_takes_its_rows_out_of_queues_and_leases_and_counts_them() -> None:
    ctl = Controller(2, spread_bytes=0)
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")
    meta = ctl.writes.allocate(8, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    on1 = meta.indexes[meta.units == 1]
    leased, _ = ctl.queues.poll(task="a", partition="p", fields=["x"], batch_size=4, lease_s=60)
    ctl.queues.poll(task="b", partition="p", fields=["x"], batch_size=1, lease_s=60)  # b: queued
    assert leased is not None and leased.lease_id is not None
    ctl.health.lose_unit(1)
    st = ctl.stats()
    assert st["rows_lost"] == on1.size == 4 and st["rows_live"] == 4
    assert st["units_alive"] == [True, False]
    a, b = st["partitions"]["p"]["tasks"]["a"], st["partitions"]["p"]["tasks"]["b"]
    assert a["lost"] == 4 and a["leased"] + a["queued"] == 4 and a["waiting"] == 0
    assert b["lost"] == 4 and b["waiting"] == 0
    # the lease acks what is left of it; lost rows are named as lost, not unknown
    ctl.queues.ack(leased.lease_id, leased.indexes)
    with pytest.raises(RowsLostError, match="lost"):
        ctl.writes.commit(on1, ["x"])
    assert ctl.rows.lost(meta.indexes).tolist() == on1.tolist()
    # new rows go to the live unit only, until the dead one is back
    assert set(ctl.writes.allocate(6, "p").units.tolist()) == {0}
    ctl.health.unit_back(1)
    assert set(ctl.writes.allocate(6, "p").units.tolist()) == {0, 1}
    # every batch handed out from now on holds only rows that exist
    for task in ("a", "b"):
        got, _ = ctl.queues.poll(
            task=task, partition="p", fields=["x"], batch_size=64, lease_s=60, short_ok=True
        )
        assert got is not None and not np.isin(got.indexes, on1).any()


def test_uncommitted_allocations_are_reclaimed_after_their_deadline() -> None:
    now = [0.0]
    ctl = Controller(2, allocation_s=10.0, clock=lambda: now[0])
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")
    dead = ctl.writes.allocate(5, "p")  # a producer that dies before it commits
    ok = ctl.writes.allocate(3, "p")
    ctl.writes.commit(ok.indexes, ["x"])
    assert ctl.health.reclaim().freed == []
    now[0] = 5.0
    late = ctl.writes.allocate(2, "p")  # allocated later: its deadline is later
    assert ctl.health.reclaim().freed == []
    now[0] = 10.5
    changes = ctl.health.reclaim()
    assert np.concatenate(changes.freed).tolist() == dead.indexes.tolist()  # freed on units
    st = ctl.stats()
    assert st["rows_reclaimed"] == 5 and st["rows_live"] == 5
    with pytest.raises(RowsLostError):  # a producer that was only slow learns it
        ctl.writes.commit(dead.indexes, ["x"])
    now[0] = 16.0
    assert np.concatenate(ctl.health.reclaim().freed).tolist() == late.indexes.tolist()
    assert ctl.stats()["rows_live"] == 3


# -- the local service -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_unit_killed_under_serve_loses_only_its_rows_and_is_restarted() -> None:
    with (
        transferqueue.serve(num_units=2, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        meta = _put_over_both(c, 0)
        on1 = meta.indexes[meta.units == 1]
        held = c.get_meta("t", ["x"], 1000, lease_s=600)  # a consumer holds every row
        os.kill(svc.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        until(lambda: _ctl(c)["rows_lost"] == on1.size, LIVENESS.bound_s + SLACK_S, "lost")
        detected_s = time.monotonic() - t0
        assert detected_s < LIVENESS.bound_s + SLACK_S
        with pytest.raises(RowsLostError, match="lost") as err:
            c.get_data(held)
        assert sorted(np.asarray(err.value.indexes).tolist()) == on1.tolist()
        c.ack(held)  # the rest is acknowledged; the lost rows are gone
        task = _ctl(c)["partitions"]["default"]["tasks"]["t"]
        assert (task["done"], task["lost"], task["leased"], task["queued"]) == (500, 500, 0, 0)
        # the supervisor restarts the unit; it registers and takes new rows
        until(
            lambda: svc.restarts[1] == 1 and _ctl(c)["units_alive"] == [True, True],
            LIVENESS.bound_s + SLACK_S + 30,
            "restart",
        )
        new = _put_over_both(c, 5000)
        got = c.get_meta("t", ["x"], 1000, timeout_s=30)
        assert got.indexes.tolist() == new.indexes.tolist()  # no lost row comes back
        assert c.get_data(got)["x"].view(-1).tolist() == list(range(5000, 6000))
        c.ack(got)
        assert svc.alive()


@pytest.mark.slow
@pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host")
def test_a_client_sharing_memory_with_a_unit_goes_on_after_the_unit_restarts() -> None:
    """The restarted unit has none of this client's shared-memory arenas (request, read and
    write arenas): the client's first transfers meet ``UnknownArenaError``, attach new
    arenas and go through; nothing fails and every byte is read back as written."""

    def put_and_read(c: transferqueue.Client, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(64, 8192, generator=g)  # 2 MiB: the request arena
        lengths = torch.randint(2000, 6000, (64,), generator=g)
        values = torch.randint(0, 50_000, (int(lengths.sum()),), generator=g)
        ragged = Ragged.from_lengths(values, lengths)  # > 1 MiB: a write arena
        dmeta = c.put({"dense": dense}, partition="d")
        rmeta = c.put({"ids": ragged}, partition="r")
        assert torch.equal(c.get_data(dmeta)["dense"], dense)  # a read arena
        got = c.get_data(rmeta)["ids"]  # views of the write arena
        assert torch.equal(got.values, values)
        assert torch.equal(got.offsets, ragged.offsets)

    def shared(link: RemoteUnitLink) -> tuple[int, int, int]:
        """Bytes of the request arena, the read arenas and the write arenas."""
        return link.arena_bytes, link._reads.bytes, link._writes.bytes

    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        put_and_read(c, 0)
        (link,) = tq._units
        assert isinstance(link, RemoteUnitLink)
        assert all(shared(link)), shared(link)  # memory is shared every way
        os.kill(svc.pids[0], signal.SIGKILL)

        # Until the controller has heard of the restart, rows it gives the unit may still be
        # counted with the dead incarnation's (a put then raises RowsLostError): wait for it.
        # One snapshot: read from two, "alive" could predate the loss and "lost" follow it.
        def back() -> bool:
            ctl = _ctl(c)
            return ctl["rows_lost"] == 128 and ctl["units_alive"] == [True]

        until(lambda: svc.restarts[0] == 1 and back(), LIVENESS.bound_s + SLACK_S + 30, "restart")
        for seed in (1, 2, 3):
            put_and_read(c, seed)
        assert link.arenas_forgotten >= 1  # the old arenas met the new unit, and were dropped
        assert all(shared(link)), shared(link)  # ... new ones attached: memory is still shared


def test_a_restarted_unit_takes_new_rows_only_once_its_registration_is_answered() -> None:
    """Rows written to a restarted unit before the controller knows of the restart would be
    counted with its dead incarnation's and cleared: the unit refuses them (``PeerGoneError``:
    the client asks the controller, which reports them lost) until its registration has been
    answered. Here the "controller" reads the registration and never answers."""
    import asyncio

    import zmq.asyncio

    from transferqueue.deploy.server import UnitServer
    from transferqueue.wire import messages as m
    from transferqueue.wire.grants import Grants
    from transferqueue.wire.rpc import RpcClient

    key = b"k" * 32
    write = m.Write(
        indexes=np.arange(4, dtype=np.int64),
        columns={"x": torch.arange(4).view(4, 1)},
        specs={"x": transferqueue.FieldSpec.dense(torch.int64, (1,))},
        create=True,
        grant=Grants(key).sign(0, 0, 4),
    )

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        ctx = zmq.asyncio.Context()
        silent = ctx.socket(zmq.ROUTER)  # a controller that has not answered yet
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        outcomes: list[BaseException | None] = []
        for controller in (f"tcp://127.0.0.1:{port}", None):  # restarted; first start
            unit = UnitServer(ctx, 0, grant_key=key, controller=controller)
            unit.start()
            client = RpcClient(ctx, unit.address, call_timeout_s=10)
            try:
                await client.call(write)
                outcomes.append(None)
            except Exception as e:
                outcomes.append(e)
            finally:
                await client.close()
                await unit.close()
        silent.close(linger=0)
        ctx.term()
        return outcomes[0], outcomes[1]

    restarted, first = asyncio.run(scenario())
    assert isinstance(restarted, PeerGoneError) and "registration" in str(restarted)
    assert first is None  # a unit the controller was started with takes rows at once


@pytest.mark.slow
def test_puts_go_on_through_a_unit_restart_and_what_returned_is_never_lost_later() -> None:
    """Puts keep going while a unit is killed and restarted. A put whose write meets the
    dead unit, or the restarted one before the controller answered its registration, is
    undone and put again by the client: every put returns, and its rows stay readable. A
    restarted unit takes new rows only once the controller has answered its registration (it
    lost the old incarnation's rows by then), so rows written to it are never counted with
    those."""
    with (
        transferqueue.serve(num_units=2, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        units_lost0 = _ctl(c)["units_lost"]
        os.kill(svc.pids[1], signal.SIGKILL)
        returned, k = [], 0
        deadline = time.monotonic() + LIVENESS.bound_s + SLACK_S + 60
        while time.monotonic() < deadline:  # until the controller took the unit back
            stats = _ctl(c)
            if stats["units_lost"] > units_lost0 and all(stats["units_alive"]):
                break
            returned.append(c.put({"x": torch.arange(k, k + 8).view(8, 1)}, partition="p"))
            k += 8
        else:
            raise AssertionError("the unit was not taken back")
        returned += [_put_over_both(c, 10**6 + i * 1000) for i in range(3)]  # after: both units
        assert c.async_client.puts_again > 0  # puts met the dead unit, and were put again ...
        for meta in returned:  # ... and every put that returned is whole
            got = c.get_data(meta)["x"].view(-1)
            first = int(got[0])
            assert got.tolist() == list(range(first, first + len(meta)))


@pytest.mark.slow
@pytest.mark.ray
def test_a_unit_actor_killed_on_ray_is_restarted_where_it_listened(ray_cluster: None) -> None:
    """The Ray deployment's supervisor is Ray (max_restarts): the restarted unit binds the
    address it had, so the handle's clients reach it again without reconnecting."""
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-restart-{os.getpid()}"
    with start_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix) as tq:
        c = tq.client()
        unit = ray.get_actor(f"{prefix}-unit1")
        ctl = ray.get_actor(f"{prefix}-controller")
        address, pid = ray.get([unit.address.remote(), unit.pid.remote()], timeout=60)
        meta = _put_over_both(c, 0)
        on1 = meta.indexes[meta.units == 1]
        held = c.get_meta("t", ["x"], 1000, lease_s=600)
        os.kill(pid, signal.SIGKILL)
        until(lambda: _ctl(c)["rows_lost"] == on1.size, LIVENESS.bound_s + SLACK_S, "lost")
        with pytest.raises(RowsLostError, match="lost"):
            c.get_data(held)
        c.ack(held)
        until(lambda: _ctl(c)["units_alive"] == [True, True], 120 + SLACK_S, "restart")
        again, new_pid = ray.get([unit.address.remote(), unit.pid.remote()], timeout=60)
        assert new_pid != pid  # a new process ...
        assert again == address == ray.get(ctl.unit_address.remote(1), timeout=60)  # same place
        new = _put_over_both(c, 5000)
        got = c.get_meta("t", ["x"], 1000, timeout_s=30)
        assert got.indexes.tolist() == new.indexes.tolist()  # no lost row comes back
        assert c.get_data(got)["x"].view(-1).tolist() == list(range(5000, 6000))
        c.ack(got)


@pytest.mark.slow
@pytest.mark.ray
def test_a_unit_restarted_on_a_new_address_is_found_by_connected_clients(
    ray_cluster: None,
) -> None:
    """The old port is taken when Ray restarts the unit: it listens elsewhere and registers
    there; a client connected before learns the new address from the controller at its first
    call that finds the unit gone, and the next call reaches it."""
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-moved-{os.getpid()}"
    with start_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix) as tq:
        c = tq.client()
        unit = ray.get_actor(f"{prefix}-unit1")
        old, pid = ray.get([unit.address.remote(), unit.pid.remote()], timeout=60)
        before = _put_over_both(c, 0, 10)
        squatter = socket.socket()
        try:
            os.kill(pid, signal.SIGKILL)
            host, port = old.removeprefix("tcp://").rsplit(":", 1)
            until(lambda: _bound(squatter, host, int(port)), 30, "old port taken")
            lost = int((before.units == 1).sum())
            until(lambda: _ctl(c)["rows_lost"] == lost, LIVENESS.bound_s + SLACK_S, "lost")
            until(lambda: _ctl(c)["units_alive"] == [True, True], 120 + SLACK_S, "restart")
            new = ray.get(unit.address.remote(), timeout=60)
            assert new != old
            assert ray.get(ray.get_actor(f"{prefix}-controller").unit_address.remote(1)) == new
            failures = 0
            for attempt in range(3):  # the first call may still go to the old address
                first = 100 + attempt * 10
                try:
                    meta = _put_over_both(c, first, 10)
                    break
                except (PeerGoneError, RowsLostError):
                    failures += 1
            else:
                raise AssertionError("the client never reached the unit at its new address")
            assert failures <= 1
            got = c.get_meta("t", ["x"], 100, timeout_s=30)
            values = c.get_data(got)["x"].view(-1).tolist()
            value = dict(zip(got.indexes.tolist(), values, strict=True))
            assert [value[i] for i in meta.indexes.tolist()] == list(range(first, first + 10))
        finally:
            squatter.close()


def _bound(sock: socket.socket, host: str, port: int) -> bool:
    """Take ``host:port`` for ``sock`` (False while something still listens there). Reuse:
    the dead unit's closed connections hold the port in TIME_WAIT (ZeroMQ binds so too)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        return False
    sock.listen(1)
    return True


_SLOW = Liveness(heartbeat_s=60.0, dead_after_s=120.0)  # no heartbeat within these tests


@contextlib.contextmanager
def _unit_1_back_unannounced() -> Iterator[
    tuple[transferqueue.LocalService, transferqueue.Client, Any, np.ndarray]
]:
    """A 2-unit service whose unit 1 was killed and started again, empty, on its address, as a
    supervisor starts it, less the registration that would tell the controller at once (and no
    heartbeat within the test): yields the service, a client, a batch leased of 1000 rows over
    both units and the indexes of those on unit 1."""
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, max_restarts=0, liveness=_SLOW) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        meta = _put_over_both(c, 0)
        on1 = meta.indexes[meta.units == 1]
        held = c.get_meta("t", ["x"], 1000, lease_s=600)
        os.kill(svc.pids[1], signal.SIGKILL)
        until(lambda: svc._procs[1].poll() is not None, SLACK_S, "killed")
        args = ["unit", "--unit-id", "1", "--address", svc.unit_addresses[1]]
        cmd = svc._spawn_args(args)
        twin = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=svc._env)
        try:
            transferqueue.LocalService._wait(twin, SLACK_S + 30)
            assert _ctl(c)["units_alive"] == [True, True]  # nobody noticed
            yield svc, c, held, on1
        finally:
            twin.kill()
            twin.wait(10)


@pytest.mark.slow
def test_a_unit_back_before_any_heartbeat_missed_it_still_reports_its_rows_lost() -> None:
    # A unit restarted between two heartbeats, not registered yet: reads and writes of its
    # old rows meet an empty unit. They must fail as lost rows (the controller asks the
    # unit who it is), not as UnknownRowError, which reads as the caller's mistake.
    with _unit_1_back_unannounced() as (_, c, held, on1):
        with pytest.raises(RowsLostError, match="lost") as err:  # a write ...
            c.put({"y": torch.zeros(1000, 1)}, meta=held)
        assert sorted(np.asarray(err.value.indexes).tolist()) == on1.tolist()
        assert _ctl(c)["rows_lost"] == on1.size
        with pytest.raises(RowsLostError, match="lost") as err:  # ... and a read
            c.get_data(held)
        assert sorted(np.asarray(err.value.indexes).tolist()) == on1.tolist()
        c.ack(held)
        task = _ctl(c)["partitions"]["default"]["tasks"]["t"]
        assert (task["done"], task["lost"]) == (500, 500)


@pytest.mark.slow
def test_a_read_that_meets_a_restarted_unit_while_the_controller_restarts_asks_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Seen in the chaos soak: a unit and the controller killed close together; the reader's
    # question "were these rows lost?" met the controller down, and the unit's
    # UnknownRowError stood, which a consumer takes for its own mistake. The reader asks
    # again until the controller answers.
    with _unit_1_back_unannounced() as (_, c, held, on1):
        ctl = c.async_client._ctl
        call, refused = ctl.call, []

        async def down_at_first(msg: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(msg, m.Lost) and len(refused) < 2:  # (restarting)
                refused.append(msg)
                raise PeerGoneError("the controller dropped the connection (test)")
            return await call(msg, *args, **kwargs)

        monkeypatch.setattr(ctl, "call", down_at_first)
        with pytest.raises(RowsLostError, match="lost") as err:
            c.get_data(held)
        assert len(refused) == 2
        assert sorted(np.asarray(err.value.indexes).tolist()) == on1.tolist()


@pytest.mark.slow
def test_a_read_that_meets_a_restarted_unit_with_the_controller_dead_is_peer_gone() -> None:
    # The controller does not come back: whether the rows were lost cannot be known, which
    # is PeerGoneError (call again later), not the unit's UnknownRowError.
    with _unit_1_back_unannounced() as (svc, c, held, _):
        os.kill(svc.pids[-1], signal.SIGKILL)  # the controller
        until(lambda: svc._procs[-1].poll() is not None, SLACK_S, "killed")
        with pytest.raises(PeerGoneError, match="cannot be known while the controller"):
            c.get_data(held)


@pytest.mark.slow
def test_with_a_unit_dead_the_other_keeps_serving_and_blocked_calls_fail_fast() -> None:
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, max_restarts=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        meta = _put_over_both(c, 0)
        on0 = meta.indexes[meta.units == 0]
        os.kill(svc.pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        # a read of rows on the dead unit fails with a typed error, not at the call timeout
        whole = c.get_meta("t", ["x"], 1000)
        with pytest.raises(RowsLostError):
            c.get_data(whole)
        assert time.monotonic() - t0 < LIVENESS.bound_s + SLACK_S
        c.release(whole)
        # the healthy unit's rows are served, every one, and nothing else
        seen: list[int] = []
        while True:
            b = c.get_meta("t", ["x"], 128, timeout_s=2)
            if not len(b):
                break
            seen += c.get_data(b)["x"].view(-1).tolist()
            c.ack(b)
        assert sorted(seen) == on0.tolist()
        # new puts go to the live unit
        new = c.put({"x": torch.arange(10).view(10, 1)})
        assert set(new.units.tolist()) == {0}
        assert _ctl(c)["units_alive"] == [True, False]
        assert svc.alive()  # one unit still serves


@pytest.mark.slow
def test_a_call_blocked_on_a_killed_controller_fails_within_the_bound() -> None:
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.put({"x": torch.ones(2, 1)})
        os.kill(svc.pids[-1], signal.SIGKILL)  # the controller
        t0 = time.monotonic()
        with pytest.raises(PeerGoneError, match=r"has not answered|dropped"):
            c.get_meta("t", ["x"], 10)  # would wait for ever on a live controller
        assert time.monotonic() - t0 < LIVENESS.bound_s + SLACK_S
        with pytest.raises(PeerGoneError):
            c.put({"x": torch.ones(2, 1)})  # the default timeout waits as long as it lives


def _unit_pid(cli_pid: int, unit: int) -> int:
    found = [p for p, cmd in child_processes(cli_pid) if f" unit --unit-id {unit} " in cmd]
    assert len(found) == 1, child_processes(cli_pid)
    return found[0]


@pytest.mark.slow
def test_a_unit_killed_under_the_cli_leaves_the_service_serving() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transferqueue.deploy.cli",
            "serve",
            "--units",
            "2",
            "--spread-bytes",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        with transferqueue.connect(address) as tq:
            c = tq.client()
            meta = _put_over_both(c, 0)
            on0, on1 = meta.indexes[meta.units == 0], meta.indexes[meta.units == 1]
            victim = _unit_pid(proc.pid, 1)
            os.kill(victim, signal.SIGKILL)
            until(lambda: _ctl(c)["rows_lost"] == on1.size, LIVENESS.bound_s + SLACK_S, "lost")
            seen: list[int] = []
            while True:  # no batch fails: the lost rows left the queue
                b = c.get_meta("t", ["x"], 128, timeout_s=2)
                if not len(b):
                    break
                seen += c.get_data(b)["x"].view(-1).tolist()
                c.ack(b)
            assert sorted(seen) == on0.tolist()
            until(lambda: _ctl(c)["units_alive"] == [True, True], SLACK_S + 30, "restart")
            assert _unit_pid(proc.pid, 1) != victim
            new = _put_over_both(c, 7000)
            got = c.get_meta("t", ["x"], 1000, timeout_s=30)
            assert c.get_data(got)["x"].view(-1).tolist() == list(range(7000, 8000))
            assert got.indexes.tolist() == new.indexes.tolist()
        assert proc.poll() is None  # the CLI still serves
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


PRODUCER = textwrap.dedent(
    """
    import asyncio, sys, torch, transferqueue
    from transferqueue.wire import messages as m
    tq = transferqueue.connect(sys.argv[1])
    link = tq._controller
    call = link.call
    async def stalled(msg):
        if isinstance(msg, m.Commit):  # written to the units: die here, before the commit
            print("WRITTEN", flush=True)
            await asyncio.sleep(3600)
        return await call(msg)
    link.call = stalled
    rows = [torch.full((1 << 18,), float(i)) for i in range(64)]  # 64 MiB ragged
    dense = torch.ones(64, 1 << 18)  # 64 MiB dense
    tq.client().put({"r": rows, "d": dense})
    """
)


def _shm_mapped_bytes(pid: int) -> int:
    """Bytes of TransferQueue arenas process ``pid`` maps."""
    total = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/dev/shm/tq-" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


@pytest.mark.slow
def test_a_producer_killed_mid_put_leaves_no_rows_and_no_shared_memory() -> None:
    with (
        transferqueue.serve(num_units=1, allocation_s=2.0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        unit = svc.pids[0]
        before = _shm_mapped_bytes(unit)
        proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, svc.address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "WRITTEN"
            assert _shm_mapped_bytes(unit) > before + (64 << 20)  # the put's arenas
            assert c.stats()["units"][0]["rows"] == 64  # written, never committed
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        until(lambda: _ctl(c)["rows_reclaimed"] == 64, 2.0 + SLACK_S, "reclaimed")
        st = c.stats()
        assert st["controller"]["rows_live"] == 0 and st["units"][0]["rows"] == 0
        until(lambda: _shm_mapped_bytes(unit) <= before, SLACK_S, "arenas released")
        assert len(c.get_meta("t", ["r"], 1, timeout_s=1)) == 0  # consumers never see them
