"""The sync client's consumer calls sent straight from the calling thread
(:mod:`transferqueue.client.direct`): the guarantees of a call through the event loop, checked
against a controller played by a bare ROUTER socket (late replies, liveness, drops, close) and
against a real service (several threads, exactly once)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq

import transferqueue
from transferqueue.client.controller_link import RemoteControllerLink
from transferqueue.client.direct import DirectCalls
from transferqueue.errors import ClosedError, PeerGoneError
from transferqueue.meta import BatchMeta
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire.liveness import Liveness

SLOW_LIVENESS = Liveness(heartbeat_s=5.0, dead_after_s=10.0)


class _FakeController:
    """A ROUTER socket on loopback that answers what the test tells it to."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"

    def receive(self, wait_s: float = 5.0) -> tuple[bytes, int, Any]:
        """(sender, request id, message) of the next request."""
        assert self.sock.poll(int(wait_s * 1000)), "no request came"
        sender, *frames = self.sock.recv_multipart()
        rid, msg = wire.decode_request(frames, "controller")
        return sender, rid, msg

    def answer(self, sender: bytes, rid: int, result: Any) -> None:
        self.sock.send_multipart([sender, *wire.encode_reply(rid, result)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def fake() -> Iterator[_FakeController]:
    f = _FakeController()
    try:
        yield f
    finally:
        if not f.sock.closed:
            f.close()


def _calls(
    address: str, *, call_timeout_s: float = 30.0, liveness: Liveness = SLOW_LIVENESS
) -> DirectCalls:
    rpc = SimpleNamespace(address=address, call_timeout_s=call_timeout_s)
    return DirectCalls(RemoteControllerLink(rpc), keys=None, liveness=liveness)  # type: ignore[arg-type]


def _get_meta(timeout_s: float = 0.0) -> m.GetMeta:
    return m.GetMeta(task="t", partition="p", fields=["x"], batch_size=2, timeout_s=timeout_s)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_reply_is_matched_to_its_call_and_an_error_reply_raises(fake: _FakeController) -> None:
    calls = _calls(fake.address)
    try:
        t, out = _in_thread(lambda: calls.call(m.Stats()))
        sender, rid, msg = fake.receive()
        assert isinstance(msg, m.Stats)
        fake.answer(sender, rid - 1, {"stale": True})  # (answers no call in flight: dropped)
        fake.answer(sender, rid, {"rows": 3})
        t.join(5)
        assert out == [{"rows": 3}]
        t, out = _in_thread(lambda: calls.call(m.Stats()))
        sender, rid, _ = fake.receive()
        fake.sock.send_multipart([sender, *wire.encode_error(rid, PeerGoneError("x"))])
        t.join(5)
        assert isinstance(out[0], PeerGoneError)
    finally:
        calls.close()


def test_a_lease_whose_reply_came_after_its_call_failed_is_released(
    fake: _FakeController,
) -> None:
    """The controller answered a get_meta after the call had given up on it (as gone): the
    caller never learned of the lease, so the next call on that socket gives it back."""
    calls = _calls(fake.address, call_timeout_s=0.3)
    try:
        with pytest.raises(PeerGoneError, match="did not answer 'get_meta'"):
            calls.call(_get_meta())
        sender, rid, msg = fake.receive()
        assert isinstance(msg, m.GetMeta)
        late = BatchMeta.empty("p", lease_id=7, reason="full", task="t")
        fake.answer(sender, rid, late)
        t, out = _in_thread(lambda: calls.call(m.Stats()))
        sender, rid, msg = fake.receive()
        assert isinstance(msg, m.Stats)
        fake.answer(sender, rid, {})
        sender, _, undo = fake.receive()
        assert isinstance(undo, m.Release) and undo.lease_id == 7
        t.join(5)
        assert out == [{}]
    finally:
        calls.close()


def test_a_silent_controller_is_pinged_then_given_up_on_within_the_liveness_bound(
    fake: _FakeController,
) -> None:
    calls = _calls(fake.address, liveness=Liveness(heartbeat_s=0.1, dead_after_s=0.5))
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerGoneError, match="has not answered for"):
            calls.call(_get_meta(timeout_s=30.0))
        assert time.monotonic() - t0 < 5.0  # (the call's own bound: 30 s + 30 s)
        kinds = []
        while fake.sock.poll(0):
            kinds.append(type(fake.receive()[2]))
        assert kinds[0] is m.GetMeta and m.Ping in kinds
    finally:
        calls.close()


def test_a_dropped_connection_fails_the_call_waiting_on_it(fake: _FakeController) -> None:
    calls = _calls(fake.address)
    try:
        t, out = _in_thread(lambda: calls.call(_get_meta(timeout_s=30.0)))
        fake.receive()
        t0 = time.monotonic()
        fake.close()  # the controller process died
        t.join(5)
        assert isinstance(out[0], PeerGoneError) and "dropped" in str(out[0])
        assert time.monotonic() - t0 < 5.0
    finally:
        calls.close()


def test_close_wakes_a_waiting_call_and_later_calls_fail(fake: _FakeController) -> None:
    calls = _calls(fake.address)
    t, out = _in_thread(lambda: calls.call(_get_meta(timeout_s=30.0)))
    fake.receive()
    t0 = time.monotonic()
    calls.close()
    t.join(5)
    assert isinstance(out[0], ClosedError) and time.monotonic() - t0 < 5.0
    with pytest.raises(ClosedError):
        calls.call(m.Stats())
    calls.close()  # (idempotent)


@pytest.mark.service
def test_threads_sharing_a_sync_client_get_every_row_once() -> None:
    """Four threads consume one partition through one Client (each call on a socket of its
    own from the pool): every row is delivered once, and the stream ends for each."""
    rows = 400
    with transferqueue.serve(num_units=1) as svc, transferqueue.connect(svc.address) as tq:
        c = tq.client()
        assert c._direct is not None  # (a connected handle sends these calls directly)
        c.declare_tasks(["t"], partition="p")
        c.put({"x": torch.arange(rows).view(rows, 1)}, partition="p")
        c.finish("p")
        got: list[list[int]] = [[] for _ in range(4)]

        def consume(k: int) -> None:
            while True:
                meta = c.get_meta("t", ["x"], 8, partition="p", timeout_s=10)
                got[k] += c.get_data(meta)["x"][:, 0].tolist()  # type: ignore[index]
                if len(meta):
                    c.ack(meta)
                if meta.reason == "end":
                    return

        threads = [threading.Thread(target=consume, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(v for part in got for v in part) == list(range(rows))
        assert c.stats()["controller"]["rows_live"] == 0  # (acked by the one declared task: freed)
        meta = c.get_meta("t", ["x"], 8, partition="p", timeout_s=0)
        assert meta.reason == "end" and len(meta) == 0
        with pytest.raises(ValueError, match="holds no lease"):
            c.ack(c.put({"x": torch.zeros(1, 1, dtype=torch.int64)}, partition="q"))
