"""Clients that ride through a controller restart (``connect(ride_through_s=...)``): a call
that finds the controller gone is sent again once the restarted one answers, when sending it
twice leaves the state sending it once does. The controller makes that true of the calls
that change state (a commit or release sent again after its reply was lost is a no-op), and
a service whose controller is SIGKILLed mid-stream loses nothing and delivers nothing twice.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio
from tq_helpers import row_values, until

import transferqueue
from transferqueue.client.controller_link import RESENDABLE, LateLeases, RemoteControllerLink
from transferqueue.controller.core import Controller
from transferqueue.controller.handlers import QueueHandlers
from transferqueue.deploy.server import ControllerServer, UnitServer
from transferqueue.errors import PeerGoneError, UnknownLeaseError, UnknownRowError
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m
from transferqueue.wire.protocol import Caller
from transferqueue.wire.rpc import RpcClient

SLACK_S = 120.0
GRANT_KEY = b"r" * 32


def _leased(ctl: Controller, rows: int = 4) -> tuple[np.ndarray, int]:
    """A controller with ``rows`` committed rows of ``x``, all leased by task ``t``."""
    ctl.rows.register_fields({"x": FieldSpec.dense("int64"), "y": FieldSpec.dense("int64")}, "p")
    ctl.queues.declare_tasks("p", ["t", "u"])
    meta = ctl.writes.allocate(rows, "p", groups=np.arange(rows))
    ctl.writes.commit(meta.indexes, ["x"])
    got, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=rows, lease_s=60.0, short_ok=True
    )
    assert got is not None and got.lease_id is not None
    return got.indexes, got.lease_id


def test_a_commit_sent_again_after_it_acked_its_lease_is_a_no_op() -> None:
    ctl = Controller(1)
    rows, lease = _leased(ctl)
    ctl.writes.commit(rows, ["y"], lease_id=lease)  # lands; its reply is lost
    ctl.writes.commit(rows, ["y"], lease_id=lease)  # the same commit again: nothing changes
    got, _ = ctl.queues.poll(
        task="u", partition="p", fields=["y"], batch_size=8, lease_s=60.0, short_ok=True
    )
    assert got is not None and sorted(got.indexes.tolist()) == sorted(rows.tolist())
    # ... but a commit of a field the first did not write still needs the lease
    ctl.rows.register_fields({"z": FieldSpec.dense("int64")}, "p")
    with pytest.raises(UnknownLeaseError, match="no longer active"):
        ctl.writes.commit(rows, ["z"], lease_id=lease)


def test_a_release_sent_again_is_a_no_op() -> None:
    ctl = Controller(1)
    rows, lease = _leased(ctl)
    ctl.queues.release(lease, rows)
    ctl.queues.release(lease, rows)  # (before, UnknownLeaseError: the lease was closed)
    got, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=8, lease_s=60.0, short_ok=True
    )
    assert got is not None and sorted(got.indexes.tolist()) == sorted(rows.tolist())


class _Rpc:
    """An RpcClient stand-in: answers each call with the next outcome of a script."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes = list(outcomes)
        self.sent: list[Any] = []
        self.call_timeout_s = 1.0

    async def call(self, msg: Any, wait_s: float | None = None) -> Any:
        self.sent.append(msg)
        out = self.outcomes.pop(0)
        if isinstance(out, BaseException):
            raise out
        return out


def _call(link: RemoteControllerLink, msg: Any) -> Any:
    return asyncio.run(link.call(msg))


def test_a_call_is_sent_again_until_the_controller_answers_within_the_bound() -> None:
    gone = PeerGoneError("controller gone")
    ack = m.Ack(lease_id=3, indexes=np.arange(2, dtype=np.int64))
    rpc = _Rpc(gone, gone, None)
    link = RemoteControllerLink(rpc, ride_through_s=30.0)  # type: ignore[arg-type]
    assert _call(link, ack) is None
    assert rpc.sent == [ack, ack, ack] and link.calls_resent == 2
    # without ride_through_s, or past it, the first PeerGoneError stands
    with pytest.raises(PeerGoneError):
        _call(RemoteControllerLink(_Rpc(gone, None), ride_through_s=0.0), ack)  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(PeerGoneError):
        _call(RemoteControllerLink(_Rpc(*[gone] * 100), ride_through_s=0.5), ack)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5.0


def test_only_calls_safe_to_send_twice_are_sent_again() -> None:
    gone = PeerGoneError("controller gone")
    clear = m.Clear(partition="p")
    assert type(clear) not in RESENDABLE
    rpc = _Rpc(gone, None)
    with pytest.raises(PeerGoneError):
        _call(RemoteControllerLink(rpc, ride_through_s=30.0), clear)  # type: ignore[arg-type]
    assert rpc.sent == [clear]


def test_a_commit_of_new_rows_sent_again_that_finds_them_freed_had_landed() -> None:
    """Rows are freed only once committed and acknowledged by every task: the first sending
    landed. Sent once, the same error stands (rows never there)."""
    gone = PeerGoneError("controller gone")
    commit = m.Commit(indexes=np.arange(2, dtype=np.int64), fields=["x"])
    freed = UnknownRowError("rows [0, 1] are not in TransferQueue")
    link = RemoteControllerLink(_Rpc(gone, freed), ride_through_s=30.0)  # type: ignore[arg-type]
    assert _call(link, commit) is None
    with pytest.raises(UnknownRowError):
        _call(RemoteControllerLink(_Rpc(freed), ride_through_s=30.0), commit)  # type: ignore[arg-type]


def test_a_late_lease_is_given_back_unless_its_call_ended_with_it() -> None:
    """Every sending of a get_meta carries its call's request_id, and the controller answers
    each with the same active lease: a late reply (a sending the call gave up on) is given
    back only once the call has ended, and only if it is not the lease the call ended with."""
    late = LateLeases()
    ask = m.GetMeta(task="t", partition="p", fields=None, batch_size=4, request_id=5)

    def reply(lease_id: int) -> BatchMeta:
        one = np.zeros(1, dtype=np.int64)
        return BatchMeta(one, one, one, one, one, partition="p", lease_id=lease_id)

    late.begin(5)
    assert late.undo_of(ask, reply(11)) == []  # (the call goes on: it may end with lease 11)
    assert late.ended(5, 11) == []
    assert late.undo_of(ask, reply(11)) == []  # (after: the lease it ended with, kept)
    assert late.undo_of(ask, reply(12)) == [m.Release(lease_id=12)]
    late.begin(6)
    assert late.undo_of(msgspec.structs.replace(ask, request_id=6), reply(21)) == []
    assert late.ended(6, None) == [m.Release(lease_id=21)]  # (ended without it, or failed)
    # a get_meta without a request_id, as before: its late lease is given back at once
    plain = msgspec.structs.replace(ask, request_id=None)
    assert late.undo_of(plain, reply(31)) == [m.Release(lease_id=31)]


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_get_meta_whose_reply_died_with_its_controller_gets_its_lease_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    """The controller journals a get_meta's lease and dies before its reply leaves (as a
    SIGKILL there would); it restarts with its state on its address. The call, sent again
    by the client riding through, gets that lease's rows at once from the restarted
    controller: before, its rows stayed leased to nobody until the lease's deadline (60 s),
    and the call waited for rows that could not come before then. The servers run on a loop
    thread of the test's process, on real ZeroMQ sockets over tcp (sync client: its direct
    calls; async client: the handle's loop)."""
    io = LoopThread("test-servers")
    ctx = zmq.asyncio.Context()
    address = f"tcp://127.0.0.1:{_free_port()}"
    granted: list[BatchMeta] = []
    servers: list[ControllerServer] = []
    restarts: list[asyncio.Future[None]] = []
    get_meta = QueueHandlers.get_meta

    def get_meta_then_die(self: QueueHandlers, msg: m.GetMeta, caller: Caller) -> Any:
        out = get_meta(self, msg, caller)
        if granted or not isinstance(out, BatchMeta) or out.lease_id is None:
            return out
        granted.append(out)  # (journaled: on disk before any reply)
        restarts.append(asyncio.ensure_future(die_and_restart(servers[-1])))
        return asyncio.get_running_loop().create_future()  # (never answered)

    async def controller(unit: UnitServer) -> ControllerServer:
        for tries in range(100):  # (the port of a server just closed may take a moment)
            try:
                server = ControllerServer(
                    ctx, [unit.address], address, grant_key=GRANT_KEY, state_dir=str(tmp_path)
                )
                break
            except zmq.ZMQError:
                if tries == 99:
                    raise
                await asyncio.sleep(0.05)
        await server.start()
        servers.append(server)
        return server

    async def die_and_restart(server: ControllerServer) -> None:
        await server.close()  # (its socket closes: the client's connection drops)
        await controller(unit)

    async def start() -> UnitServer:
        unit = UnitServer(ctx, 0, grant_key=GRANT_KEY)
        unit.start()
        await controller(unit)
        return unit

    monkeypatch.setattr(QueueHandlers, "get_meta", get_meta_then_die)
    unit = io.run(start())
    try:
        with transferqueue.connect(address, ride_through_s=30.0) as tq:
            c = tq.client()
            c.declare_tasks(["t"], partition="p")
            c.put({"x": row_values(0, 4)}, partition="p")
            t0 = time.monotonic()
            if side == "sync":
                meta = c.get_meta("t", ["x"], 4, partition="p", timeout_s=10)
            else:
                meta = asyncio.run(
                    tq.async_client().get_meta("t", ["x"], 4, partition="p", timeout_s=10)
                )
            took_s = time.monotonic() - t0
            assert len(servers) == 2 and len(granted) == 1  # (it died once, and is back)
            # the lease the dead controller granted, its rows, not an empty batch at timeout_s
            assert meta.lease_id == granted[0].lease_id and len(meta) == 4, meta.reason
            assert took_s < 8.0
            assert torch.equal(c.get_data(meta)["x"], row_values(0, 4))  # type: ignore[arg-type]
            c.ack(meta)
            stats = c.stats()["controller"]
            assert stats["active_leases"] == 0 and stats["expired_leases"] == 0
            assert stats["partitions"]["p"]["tasks"]["t"]["done"] == 4
            assert len(c.get_meta("t", ["x"], 4, partition="p", timeout_s=0)) == 0
    finally:

        async def stop() -> None:
            await servers[-1].close()
            await unit.close()

        io.run(stop())
        io.close()
        ctx.term()


@pytest.mark.slow
@pytest.mark.service
def test_a_stream_rides_through_its_controller_killed_mid_stream(tmp_path: Path) -> None:
    """A producer and a consumer run while the controller is SIGKILLed (twice) and restarted
    with its state: no call of either fails, every row put is delivered once (acked after
    reading it bit-exact), and nothing is left over."""
    rows_per_put, puts = 16, 120
    total = rows_per_put * puts
    with (
        transferqueue.serve(num_units=2, state_dir=tmp_path / "state") as svc,
        transferqueue.connect(svc.address, ride_through_s=SLACK_S) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["t"], partition="p")
        put_done = threading.Event()
        errors: list[BaseException] = []

        def produce() -> None:
            try:
                for k in range(puts):
                    c.put({"x": row_values(k * rows_per_put, rows_per_put)}, partition="p")
                    time.sleep(0.01)
            except BaseException as e:
                errors.append(e)
            finally:
                put_done.set()

        delivered: list[int] = []  # the row number each row's bytes say (row_values)
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        kills = 0
        deadline = time.monotonic() + 4 * SLACK_S
        while time.monotonic() < deadline:
            if kills < 2 and len(delivered) >= (kills + 1) * total // 3:
                old = svc.pids[-1]
                os.kill(old, signal.SIGKILL)
                kills += 1
                until(lambda: svc.pids[-1] != old, SLACK_S, "controller restart")  # noqa: B023
            b = c.get_meta("t", ["x"], 32, partition="p", timeout_s=0.2)
            if len(b):
                got = c.get_data(b)["x"]
                assert isinstance(got, torch.Tensor)
                numbers = got[:, 0].to(torch.int64).tolist()
                assert torch.equal(got, torch.stack([row_values(i, 1)[0] for i in numbers]))
                c.ack(b)
                delivered += numbers
            elif put_done.is_set() and len(delivered) >= total:
                break
        producer.join(timeout=SLACK_S)
        assert not errors, errors
        assert kills == 2 and svc.controller_restarts[0] == 2
        assert sorted(delivered) == list(range(total))  # every row, each once
        # (whether a call had to be sent again depends on where the kill lands: a call made
        # once ZeroMQ has connected to the restarted controller needs none, and a drop read
        # while nothing waited no longer fails it: rpc.RpcClient._send)
        assert len(c.get_meta("t", ["x"], 32, partition="p", timeout_s=0.5)) == 0


@pytest.mark.slow
@pytest.mark.service
def test_a_connect_during_a_controller_restart_waits_for_it_within_ride_through_s(
    tmp_path: Path,
) -> None:
    """``connect(ride_through_s=...)`` made while the controller is down (SIGKILLed, being
    restarted with its state) succeeds once the restarted one answers, and finds the rows."""
    with transferqueue.serve(num_units=2, state_dir=tmp_path / "state") as svc:
        with transferqueue.connect(svc.address) as tq:
            c = tq.client()
            c.put({"x": row_values(0, 8)}, partition="p")
        old = svc.pids[-1]
        os.kill(old, signal.SIGKILL)
        # (before: PeerGoneError, "no TransferQueue controller answered", the restart or not)
        with transferqueue.connect(svc.address, ride_through_s=SLACK_S) as tq:
            assert svc.pids[-1] != old or svc.controller_restarts[0] == 1
            c = tq.client()
            b = c.get_meta("t", ["x"], 8, partition="p", timeout_s=SLACK_S)
            assert torch.equal(c.get_data(b)["x"], row_values(0, 8))  # type: ignore[arg-type]
            c.ack(b)


def test_a_connect_without_ride_through_asks_once_and_with_it_asks_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No controller at the address: a connect asks once and fails after
    ``connect_timeout_s``; with ``ride_through_s`` it asks again until that has passed, and
    its error names both."""
    asks: list[float] = []
    call = RpcClient.call

    async def counted(self: RpcClient, msg: Any, **kw: Any) -> Any:
        if isinstance(msg, m.Hello):
            asks.append(time.monotonic())
        return await call(self, msg, **kw)

    monkeypatch.setattr(RpcClient, "call", counted)
    address = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(
        PeerGoneError, match=r"within 1 s \(connect_timeout_s=1, ride_through_s=0\)"
    ):
        transferqueue.connect(address, connect_timeout_s=1.0)
    assert len(asks) == 1
    asks.clear()
    with pytest.raises(
        PeerGoneError, match=r"within 3 s \(connect_timeout_s=1, ride_through_s=3\)"
    ):
        transferqueue.connect(address, connect_timeout_s=1.0, ride_through_s=3.0)
    assert len(asks) >= 2 and asks[-1] - asks[0] < 3.0  # (asked again, none after the bound)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
