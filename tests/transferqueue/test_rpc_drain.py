"""The server socket's drain (wire.rpc): a reply sent while a message is being handled is
followed by the drain under way, not by another loop turn; nothing sent meanwhile is missed
(ZeroMQ's descriptor is edge-triggered: a send may take the edge of a message that arrived)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import zmq
import zmq.asyncio

from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.loopsocket import READ_EVERY
from transferqueue.wire.rpc import RpcClient, RpcServer

BURST = 1300  # (more than a server reads ahead at once: wire.loopsocket.DRAIN_BATCH)


def _ping_handlers() -> dict[Any, Any]:
    class Pong:
        def __getattr__(self, kind: str) -> Any:
            return lambda msg, caller: "pong"

    return protocol.handlers("unit", Pong())


def _burst(address: str, got: list[int]) -> None:
    """A plain DEALER sends BURST pings without waiting, then reads every reply."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(address)
    try:
        for rid in range(1, BURST + 1):
            sock.send_multipart(wire.encode_request(rid, m.UnitPing()))
        for _ in range(BURST):
            frames = sock.recv_multipart()
            assert wire.decode_reply(frames, str) == "pong"
            answered = wire.reply_id(frames)
            assert answered is not None
            got.append(answered)
    finally:
        sock.close(0)
        ctx.term()


def test_a_burst_and_concurrent_callers_are_all_answered_with_fewer_loop_turns() -> None:
    async def scenario() -> tuple[list[int], list[str], int]:
        """(rids the burst got back, answers of the concurrent calls, drains per 100
        calls made one after the other)"""
        ctx = zmq.asyncio.Context()
        server = RpcServer(ctx, "tcp://127.0.0.1:0", "unit", _ping_handlers())
        drains = 0
        io = server._io
        inner = io.drain

        def counted() -> None:
            nonlocal drains
            drains += 1
            inner()

        io.drain = counted  # type: ignore[method-assign]
        server.start()
        clients = [RpcClient(ctx, server.address) for _ in range(3)]
        got: list[int] = []
        try:
            for _ in range(10):
                await clients[0].call(m.UnitPing())
            before = drains
            for _ in range(100):  # one after the other: each finds the server idle
                await clients[0].call(m.UnitPing())
            sequential = drains - before
            burst = threading.Thread(target=_burst, args=(server.address, got))
            burst.start()
            calls = [c.call(m.UnitPing()) for c in clients for _ in range(50)]
            answers = await asyncio.gather(*calls)  # (each call bounded by its timeout)
            while burst.is_alive():
                await asyncio.sleep(0.01)
            burst.join()
            return got, answers, sequential
        finally:
            for c in clients:
                await c.close()
            await server.close()
            ctx.term()

    got, answers, sequential = asyncio.run(scenario())
    assert sorted(got) == list(range(1, BURST + 1))  # every request answered, once
    assert answers == ["pong"] * 150
    # One drain per request (its socket's event): the reply sent from it schedules no other
    # (it did, one more loop turn per request: 200 drains).
    assert sequential <= 130, sequential


BACKLOG = 400


def _busy_handlers() -> dict[Any, Any]:
    """A unit whose ``stats`` takes a millisecond of the loop's time; pings are free."""

    class Busy:
        def __getattr__(self, kind: str) -> Any:
            if kind == "ping":
                return lambda msg, caller: "pong"

            def work(msg: Any, caller: Any) -> dict[str, Any]:
                time.sleep(0.001)
                return {}

            return work

    return protocol.handlers("unit", Busy())


def test_a_ping_behind_a_backlog_is_answered_before_the_backlog() -> None:
    """Hundreds of requests queued at a busy server, then a ping: its answer comes within
    one drain batch, ahead of the work read with it, not after the whole backlog (a server
    that answered it in turn would be taken for dead by clients waiting behind a storm)."""

    async def scenario() -> list[str]:
        ctx = zmq.asyncio.Context()
        server = RpcServer(ctx, "tcp://127.0.0.1:0", "unit", _busy_handlers())
        server.start()
        order: list[str] = []

        def client() -> None:
            sctx = zmq.Context()
            sock = sctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 20_000)
            sock.connect(server.address)
            try:
                for rid in range(1, BACKLOG + 1):
                    sock.send_multipart(wire.encode_request(rid, m.UnitStats()))
                sock.send_multipart(wire.encode_request(BACKLOG + 1, m.UnitPing()))
                for _ in range(BACKLOG + 1):
                    rid = wire.reply_id(sock.recv_multipart())
                    order.append("ping" if rid == BACKLOG + 1 else "work")
            finally:
                sock.close(0)
                sctx.term()

        thread = threading.Thread(target=client)
        thread.start()
        try:
            while thread.is_alive():
                await asyncio.sleep(0.01)
            thread.join()
            return order
        finally:
            await server.close()
            ctx.term()

    order = asyncio.run(scenario())
    assert order.count("work") == BACKLOG and order.count("ping") == 1
    assert order.index("ping") <= 2 * READ_EVERY, (
        f"the ping was answered after {order.index('ping')} requests"
    )
