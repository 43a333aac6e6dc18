"""The Ray deployment's controller with a ``state_dir`` survives the SIGKILL of its actor's
process: Ray restarts the actor, which recovers its rows, tasks and leases, binds the address
it had, and the client connected before goes on (a real local Ray cluster, loopback)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tq_helpers import answered, row_values, until

import transferqueue
from transferqueue.errors import PeerGoneError, RowsLostError
from transferqueue.meta import BatchMeta

SLACK_S = 180.0  # a Ray restart on a loaded 2-core machine: a new worker, recovery, units


def _x(client: transferqueue.Client, meta: BatchMeta) -> torch.Tensor:
    x = client.get_data(meta)["x"]
    assert isinstance(x, torch.Tensor)
    return x


def _expected(value_of: dict[int, torch.Tensor], meta: BatchMeta) -> torch.Tensor:
    return torch.stack([value_of[i] for i in meta.indexes.tolist()])


@pytest.mark.slow
@pytest.mark.ray
def test_a_controller_actor_killed_on_ray_comes_back_with_its_state(
    ray_cluster: None, tmp_path: Path
) -> None:
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-ctlstate-{os.getpid()}"
    state = tmp_path / "state"
    with start_on_ray(num_units=2, spread_bytes=0, name_prefix=prefix, state_dir=state) as tq:
        c = tq.client()
        ctl = ray.get_actor(f"{prefix}-controller")
        address, pid = ray.get([ctl.address.remote(), ctl.pid.remote()], timeout=60)
        assert address == tq.address
        c.declare_tasks(["t"], partition="p")
        value_of: dict[int, torch.Tensor] = {}
        for k in range(5):
            meta = c.put({"x": row_values(100 * k, 100)}, partition="p")
            assert set(meta.units.tolist()) == {0, 1}  # rows on both unit actors
            for pos, index in enumerate(meta.indexes.tolist()):
                value_of[index] = row_values(100 * k + pos, 1)[0]
        acked: list[int] = []
        for _ in range(2):
            b = c.get_meta("t", ["x"], 100, partition="p", timeout_s=30)
            assert torch.equal(_x(c, b), _expected(value_of, b))
            c.ack(b)
            acked += b.indexes.tolist()
        held = c.get_meta("t", ["x"], 100, partition="p", timeout_s=30, lease_s=600)
        assert len(held) == 100
        before = c.stats()["controller"]

        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        # the first successful call after the kill: the same client, connected all along
        first = answered(lambda: c.get_meta("t", ["x"], 100, partition="p", timeout_s=10), SLACK_S)
        restart_s = time.monotonic() - t0
        print(f"\nRay controller restart: kill -> first get_meta {restart_s:.2f} s")
        new_address, new_pid = ray.get([ctl.address.remote(), ctl.pid.remote()], timeout=60)
        assert new_pid != pid and new_address == address  # a new process, the same place
        assert len(first) == 100
        assert not set(first.indexes.tolist()) & (set(acked) | set(held.indexes.tolist()))

        # ``held`` and ``first``: a get_meta the client sent again during the restart may have
        # been granted too (its first sending was queued, then answered late), and the client
        # gives that lease back (undo_late) while this test goes on; far sooner than the 60 s
        # lease of ``first`` would expire, so the wait cannot pass by ``first`` expiring
        def leases_settled() -> dict[str, Any] | None:
            now: dict[str, Any] = c.stats()["controller"]
            return now if now["active_leases"] == before["active_leases"] + 1 else None

        after = until(leases_settled, 30.0, "the leases after the restart: held and first")
        for key in ("next_index", "fields", "rows_lost", "rows_reclaimed", "units_alive"):
            assert after[key] == before[key], key
        assert after["partitions"]["p"]["rows_live"] == before["partitions"]["p"]["rows_live"]
        assert after["partitions"]["p"]["tasks"]["t"]["done"] == 200

        assert torch.equal(_x(c, first), _expected(value_of, first))
        c.ack(held)  # the lease taken before the kill
        c.ack(first)
        new = c.put({"x": row_values(5000, 50)}, partition="p")  # fresh indexes, no overwrite
        assert int(new.indexes.min()) > max(value_of)
        for pos, index in enumerate(new.indexes.tolist()):
            value_of[index] = row_values(5000 + pos, 1)[0]
        seen = first.indexes.tolist()
        while True:
            b = c.get_meta("t", ["x"], 128, partition="p", timeout_s=5)
            if not len(b):
                break
            assert torch.equal(_x(c, b), _expected(value_of, b))
            c.ack(b)
            seen += b.indexes.tolist()
        consumed = set(acked) | set(held.indexes.tolist())
        assert not set(seen) & consumed  # nothing acked (or acked late) comes back
        assert len(seen) == len(set(seen)) == 250  # every other committed row, once
        assert sorted(set(seen) | consumed) == sorted(value_of)
        final = c.stats()["controller"]["partitions"]["p"]
        assert final["tasks"]["t"]["done"] == 550 and final["rows_live"] == 0
        assert final["rows_lost"] == 0
        until(lambda: (state / "address").read_text() == address, 10, "address kept")


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("moves", [False, True], ids=["same-port", "unit-moves"])
def test_the_controller_and_a_unit_killed_together_on_ray_both_come_back(
    ray_cluster: None, tmp_path: Path, moves: bool
) -> None:
    """Each restarted actor waits for the other's answers (the unit asks the controller
    where it listened, the controller pings every unit before serving): neither may wait in
    its constructor for the other. The dead unit's rows are lost, the others are served.
    ``moves``: the unit's old port is taken, so the restarted controller pings nobody there
    and serves without it for a while; the unit registers from its new port however long
    the controller takes to serve."""
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-ctlunit-{os.getpid()}"
    with start_on_ray(
        num_units=2, spread_bytes=0, name_prefix=prefix, state_dir=tmp_path / "state"
    ) as tq:
        c = tq.client()
        ctl = ray.get_actor(f"{prefix}-controller")
        unit = ray.get_actor(f"{prefix}-unit1")
        pids = ray.get([ctl.pid.remote(), unit.pid.remote()], timeout=60)
        old = ray.get(unit.address.remote(), timeout=60)
        meta = c.put({"x": row_values(0, 200)}, partition="p")
        on1 = meta.indexes[meta.units == 1]
        assert 0 < on1.size < 200
        squatter = socket.socket()
        try:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            if moves:
                host, port = old.removeprefix("tcp://").rsplit(":", 1)
                until(lambda: _bound(squatter, host, int(port)), 30, "old port taken")
            answered(lambda: c.stats(), SLACK_S)
            until(lambda: c.stats()["controller"]["rows_lost"] == on1.size, SLACK_S, "lost")
            until(lambda: c.stats()["controller"]["units_alive"] == [True, True], SLACK_S, "alive")
        finally:
            squatter.close()
        assert ray.get([ctl.pid.remote(), unit.pid.remote()], timeout=60) != pids
        assert (ray.get(unit.address.remote(), timeout=60) != old) == moves
        got = c.get_meta("t", ["x"], 200, partition="p", timeout_s=5)
        on0 = meta.indexes[meta.units == 0]
        assert sorted(got.indexes.tolist()) == sorted(on0.tolist())
        value_of = {i: row_values(pos, 1)[0] for pos, i in enumerate(meta.indexes.tolist())}
        assert torch.equal(_x(c, got), _expected(value_of, got))
        new = answered(lambda: c.put({"x": row_values(1000, 100)}, partition="p"), SLACK_S)
        assert set(new.units.tolist()) == {0, 1}  # the restarted unit takes rows again
        assert int(new.indexes.min()) > int(meta.indexes.max())


def _bound(sock: socket.socket, host: str, port: int) -> bool:
    """Take ``host:port`` for ``sock`` (False while something still listens there)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        return False
    sock.listen(1)
    return True


def _put_on_both(c: transferqueue.Client, start: int, n: int) -> BatchMeta:
    """A put over both units, once the client reaches each (a call may meet a unit that
    moved, once: the client then learns its new address)."""
    for _ in range(3):
        try:
            meta = c.put({"x": row_values(start, n)}, partition="p")
        except (PeerGoneError, RowsLostError):
            continue
        assert set(meta.units.tolist()) == {0, 1}
        return meta
    raise AssertionError("the client never reached both units")


@pytest.mark.slow
@pytest.mark.ray
def test_a_controller_restarted_on_ray_finds_a_unit_that_moved(
    ray_cluster: None, tmp_path: Path
) -> None:
    """A unit actor restarted on a new port (its old one taken) before the controller dies:
    the restarted controller asks the unit actor where it listens instead of pinging the
    address it was started with (a stranger's socket there would never answer)."""
    import ray

    from transferqueue.deploy.ray import start_on_ray

    prefix = f"tq-ctlmoved-{os.getpid()}"
    with start_on_ray(
        num_units=2, spread_bytes=0, name_prefix=prefix, state_dir=tmp_path / "state"
    ) as tq:
        c = tq.client()
        ctl = ray.get_actor(f"{prefix}-controller")
        unit = ray.get_actor(f"{prefix}-unit1")
        old, pid = ray.get([unit.address.remote(), unit.pid.remote()], timeout=60)
        squatter = socket.socket()
        try:
            os.kill(pid, signal.SIGKILL)
            host, port = old.removeprefix("tcp://").rsplit(":", 1)
            until(lambda: _bound(squatter, host, int(port)), 30, "old port taken")

            def moved() -> bool:
                return bool(ray.get(ctl.unit_address.remote(1), timeout=60) != old)

            until(moved, SLACK_S, "the unit registered from its new port")
            meta = _put_on_both(c, 0, 100)
            os.kill(ray.get(ctl.pid.remote(), timeout=60), signal.SIGKILL)
            got = answered(
                lambda: c.get_meta("t", ["x"], 100, partition="p", timeout_s=10), SLACK_S
            )
            assert sorted(got.indexes.tolist()) == meta.indexes.tolist()
            value_of = {i: row_values(pos, 1)[0] for pos, i in enumerate(meta.indexes.tolist())}
            assert torch.equal(_x(c, got), _expected(value_of, got))
            assert ray.get(ctl.unit_address.remote(1), timeout=60) != old
        finally:
            squatter.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"controller_max_restarts": 3}, "controller_max_restarts=3 needs state_dir"),
        ({"controller_max_restarts": -1, "state_dir": "s"}, "controller_max_restarts must be"),
        ({"state_dir": "s", "fsync": "sometimes"}, "fsync must be one of"),
    ],
)
def test_bad_controller_restart_options_are_refused(options: dict[str, Any], match: str) -> None:
    from transferqueue.deploy.ray import start_on_ray

    with pytest.raises(ValueError, match=match):
        start_on_ray(num_units=1, **options)


def test_a_restarted_controller_rebinds_its_old_port_or_takes_a_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a restarted controller actor binds (no Ray needed): its old address when the
    port is free, else (taken past REBIND_S, or recorded on another node) a new port."""
    from transferqueue.deploy import ray as ray_deploy

    monkeypatch.setattr(ray_deploy, "REBIND_S", 0.5)
    assert ray_deploy._old_address(str(tmp_path), "127.0.0.1") is None  # nothing recorded
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        ray_deploy._save_address(str(tmp_path), f"tcp://127.0.0.1:{port}")
        assert ray_deploy._old_address(str(tmp_path), "127.0.0.1") is None  # taken
        assert ray_deploy._old_address(str(tmp_path), "10.1.2.3") is None  # another node's
    old = f"tcp://127.0.0.1:{port}"
    assert ray_deploy._old_address(str(tmp_path), "127.0.0.1") == old  # free again


def _fake_controller() -> type:
    """A class answering what a restarted unit asks its controller actor, whose
    reconstruction takes ``restart_s`` (a controller restarting: Ray answers
    ActorUnavailableError meanwhile). Made in a function: Ray workers cannot import test
    modules, and cloudpickle sends such a class by value."""

    class FakeController:
        def __init__(self, restart_s: float) -> None:
            import ray

            if ray.get_runtime_context().was_current_actor_reconstructed:
                time.sleep(restart_s)

        def pid(self) -> int:
            return os.getpid()

        def address(self) -> str:
            return "tcp://127.0.0.1:1"

        def unit_address(self, unit_id: int) -> str:
            return f"tcp://127.0.0.1:{100 + unit_id}"

    return FakeController


@pytest.mark.slow
@pytest.mark.ray
def test_a_restarted_unit_finds_its_controller_even_while_that_restarts(
    ray_cluster: None,
) -> None:
    """The lookup a restarted unit actor makes in its constructor asks again while the
    controller actor is restarting (Ray fails such a call at once: the unit's constructor
    raised, which ends an actor for good) and gives up, naming the actor, after its bound."""
    import ray
    from ray.exceptions import GetTimeoutError

    from transferqueue.deploy.ray import _controller_of

    name = f"tq-fakectl-{os.getpid()}"
    actor = ray.remote(_fake_controller()).options(name=name, max_restarts=1, num_cpus=0)
    ctl = actor.remote(3.0)
    pid = ray.get(ctl.pid.remote(), timeout=60)
    try:
        os.kill(pid, signal.SIGKILL)
        until(lambda: _restarting(ctl), 30, "the actor restarting")
        t0 = time.monotonic()
        assert _controller_of(name, 2) == ("tcp://127.0.0.1:1", "tcp://127.0.0.1:102")
        assert time.monotonic() - t0 > 0.5  # (it did wait for the restart)
    finally:
        ray.kill(ctl, no_restart=True)
    with pytest.raises(GetTimeoutError, match=f"{name}-none"):
        _controller_of(f"{name}-none", 0, bound_s=1.0)


def _restarting(ctl: Any) -> bool:
    import ray
    from ray.exceptions import ActorUnavailableError

    try:
        ray.get(ctl.pid.remote(), timeout=5)
    except ActorUnavailableError:
        return True
    except Exception:  # (the death not yet noticed: the call failed otherwise)
        return False
    return False


def test_a_restarted_unit_that_cannot_find_its_controller_exits_for_ray_to_restart_it() -> None:
    """When the lookup gives up, the unit's process exits with status 1 and says why, rather
    than raising from the actor's constructor (which would end the actor for good)."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("ray")
    code = textwrap.dedent(
        """
        import atexit
        import logging
        from ray.exceptions import GetTimeoutError
        import transferqueue.deploy.ray as rd

        def gone(name, unit_id, bound_s=0.0):
            raise GetTimeoutError(f"the controller actor {name!r} did not answer")

        logging.basicConfig(level=logging.WARNING)
        atexit.register(print, "atexit ran")  # (os._exit skips it; an exception would not)
        rd._controller_of = gone
        rd._controller_of_or_exit("tq-ctl", 3)
        print("returned")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "returned" not in done.stdout and "atexit ran" not in done.stdout
    assert "restarted unit 3 could not find its controller" in done.stderr
    assert "'tq-ctl' did not answer" in done.stderr
