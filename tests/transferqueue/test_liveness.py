"""The liveness watch of many clients in one process: they share what they hear from a
server, so a server they all wait on is pinged once per heartbeat by the process, not once
per client (:mod:`transferqueue.wire.liveness`), and every one of them still learns that it
is alive from the pongs another one got."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq
import zmq.asyncio

from transferqueue.errors import PeerGoneError
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire.liveness import Liveness
from transferqueue.wire.rpc import RpcClient

CLIENTS = 8
WAIT_S = 2.2
LIVENESS = Liveness(heartbeat_s=0.25, dead_after_s=1.0)


def _slow_server(sock: zmq.Socket, stop: threading.Event, pings: list[int]) -> None:
    """A server that answers pings at once and nothing else (every call waits on it)."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        ident, *frames = sock.recv_multipart()
        rid, msg = wire.decode_request(frames, "controller")
        if isinstance(msg, m.Ping):
            pings.append(rid)
            sock.send_multipart([ident, *wire.encode_reply(rid, "incarnation")])


@pytest.mark.service
def test_clients_of_one_process_ping_a_busy_server_once_per_heartbeat() -> None:
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop, pings = threading.Event(), []
    thread = threading.Thread(target=_slow_server, args=(server, stop, pings), daemon=True)
    thread.start()

    async def main() -> list[BaseException]:
        actx = zmq.asyncio.Context()
        clients = [
            RpcClient(actx, f"tcp://127.0.0.1:{port}", ping=m.Ping(), liveness=LIVENESS)
            for _ in range(CLIENTS)
        ]
        try:
            calls = [c.call(m.Stats(), wait_s=WAIT_S) for c in clients]
            return list(await asyncio.gather(*calls, return_exceptions=True))
        finally:
            for c in clients:
                await c.close()
            actx.term()

    try:
        t0 = time.monotonic()
        ended = asyncio.run(main())
        took = time.monotonic() - t0
    finally:
        stop.set()
        thread.join(5)
        server.close(0)
        ctx.term()
    # every call waited its whole bound (the server is alive: the pongs say so to all of
    # them, though each client's own pings were few), and ended at it, not as "silent"
    assert took >= WAIT_S - 0.1
    for e in ended:
        assert isinstance(e, PeerGoneError) and "did not answer" in str(e), e
    heartbeats = WAIT_S / LIVENESS.heartbeat_s
    assert len(pings) <= heartbeats + 2, (
        f"{len(pings)} pings from {CLIENTS} clients in {WAIT_S} s: each pinged on its own"
    )
