"""A bare ZeroMQ round trip: the floor a small controller call is measured against.

A DEALER in the calling process sends a msgpack request shaped like a ``GetMeta`` (the
fields our client sends); a ROUTER in a process of its own, over loopback tcp (the transport
our client uses with a local service), answers with a msgpack reply holding ``batch`` int64
indexes and a lease id. No event loop, no validation, no bookkeeping: what is left of a
``get_meta`` of ``batch`` rows once everything of ours is taken away. ``bench.controller``
(case ``wire``) and ``bench.peer`` (its ``meta`` case) time it beside our call in the same
run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from typing import Any

import msgspec
import numpy as np
import zmq

__all__ = ["BareRoundTrip"]

_START_S = 120.0  # the ROUTER process starting (a spawn imports numpy, msgspec and zmq)


def _router(address_q: Any) -> None:
    """The bare server: answers each msgpack request with ``batch_size`` int64 indexes."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_q.put(f"tcp://127.0.0.1:{port}")
    indexes = np.arange(1 << 16, dtype=np.int64)  # (batches up to 32k)
    lease = 0
    while True:
        ident, body = sock.recv_multipart(copy=False)
        req = msgspec.msgpack.decode(body.buffer)
        if req is None:
            break
        lease += 1
        start = lease % 4096 * 8
        rows = indexes[start : start + req["batch_size"]]
        reply = {"lease_id": lease, "indexes": rows.tobytes()}
        sock.send_multipart([ident, msgspec.msgpack.encode(reply)], copy=False)
    sock.close(0)
    ctx.term()


class BareRoundTrip:
    """The DEALER side of the bare round trip, its ROUTER in a process of its own."""

    def __init__(self) -> None:
        ctx_mp = mp.get_context("spawn")
        q = ctx_mp.Queue()
        self.proc = ctx_mp.Process(target=_router, args=(q,), daemon=True)
        self.proc.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(q.get(timeout=_START_S))
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)  # (a hung ROUTER fails the bench, not hangs it)

    def call(self, batch: int) -> np.ndarray:
        request = {  # a GetMeta's fields, as our client sends them
            "task": "bench",
            "partition": "meta1000",
            "fields": ["x"],
            "batch_size": batch,
            "lease_s": 60.0,
            "sampler": "fifo",
            "sampler_options": {},
            "min_version": None,
            "max_group": None,
            "timeout_s": 10.0,
            "partial": True,
            "holder": 1 << 40,
            "consume": False,
        }
        self.sock.send(msgspec.msgpack.encode(request), copy=False)
        reply = msgspec.msgpack.decode(self.sock.recv(copy=False).buffer)
        return np.frombuffer(reply["indexes"], dtype=np.int64)

    def seconds_per_call(self, batch: int, seconds: float) -> float:
        """Calls back to back for about ``seconds``: the mean seconds per round trip."""
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if len(self.call(batch)) != batch:
                raise AssertionError(f"the bare server sent back a batch other than {batch}")
            n += 1
        return (time.perf_counter() - t0) / n

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # (never blocks: a ROUTER gone is killed)
            self.sock.send(msgspec.msgpack.encode(None), zmq.NOBLOCK)
        self.sock.close(0)
        self.ctx.term()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
