"""``LoopSocket``: a plain (sync) ZeroMQ socket driven by the running event loop, for the
RPC layer (:mod:`transferqueue.wire.rpc`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["DRAIN_BATCH", "READ_EVERY", "LoopSocket", "tune"]

log = logging.getLogger(__name__)

DRAIN_BATCH = 1024
"""Messages a server's socket reads ahead of handling them, at most (see :class:`LoopSocket`)."""
READ_EVERY = 16
"""Messages handled between two reads of a server's socket (its pings are answered then)."""


def tune(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: flow control is ours (capacity, leases), never a silent drop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


class LoopSocket:
    """A plain (sync) ZeroMQ socket driven by the running event loop.

    ``zmq.asyncio`` wraps every send and receive in futures; a request then costs a few
    hundred microseconds of Python on each side. Here the loop watches the socket's file
    descriptor and drains every message that is ready in one go, and sends never block (the
    queues are unbounded), which roughly halves a round trip. ZeroMQ's descriptor is
    edge-triggered, so the socket is drained again after every send: at once where the send
    came from a message being handled (the drain under way reads the socket's events again
    before it returns), on the next loop turn otherwise.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        kind: int,
        on_message: Callable[[list[Any]], None],
        *,
        urgent: Callable[[list[Any]], bool] | None = None,
    ) -> None:
        """``urgent``: which messages are handled ahead of the others read with them (a
        server's liveness pings)."""
        self.sock: zmq.Socket[Any] = zmq.Context.shadow(ctx.underlying).socket(kind)
        tune(self.sock)
        self._on_message = on_message
        self._urgent = urgent
        self._pending: collections.deque[list[Any]] = collections.deque()  # (read, not handled)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.closed = False

    def attach(self) -> None:
        """Start watching the socket on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(int(self.sock.getsockopt(zmq.FD)), self.drain)
        self._loop.call_soon(self.drain)

    def drain(self) -> None:
        """Handle every message that is ready. With ``urgent``, messages are read ahead (up
        to :data:`DRAIN_BATCH` waiting) and the urgent ones handled as soon as they are
        read, the others in their order, reading again after every :data:`READ_EVERY`: a
        ping that arrives behind a backlog of thousands of requests (a storm of clients) is
        answered within a few requests' time, not the whole backlog's, so that clients
        waiting behind the backlog do not take a busy server for a dead one."""
        self._draining = True
        try:
            if self._urgent is None:
                while not self.closed:
                    one = self._read(1)
                    if not one:
                        return
                    self._on_message(one[0])
                return
            urgent, pending = self._urgent, self._pending
            while not self.closed:
                got = 0
                if len(pending) < DRAIN_BATCH:
                    for msg in self._read(DRAIN_BATCH - len(pending)):
                        got += 1
                        if urgent(msg):
                            self._on_message(msg)
                        else:
                            pending.append(msg)
                if not pending:
                    if got:
                        continue  # (a batch of urgent ones only: the socket may hold more)
                    return
                for _ in range(min(READ_EVERY, len(pending))):
                    if self.closed:
                        return
                    self._on_message(pending.popleft())
        finally:
            self._draining = False

    def _read(self, most: int) -> list[list[Any]]:
        out: list[list[Any]] = []
        while len(out) < most:
            try:  # (asking first: a receive that finds nothing raises, which costs more)
                if not int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    break
                out.append(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
            except zmq.ZMQError as e:
                log.warning("receive failed: %s", e)
                break
        return out

    def send(self, frames: list[Any], *, track: bool = False) -> zmq.MessageTracker | None:
        tracker = self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
        if self._loop is not None and not self._draining:  # (see the class docstring)
            self._loop.call_soon(self.drain)
        return tracker

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(int(self.sock.getsockopt(zmq.FD)))
        self.sock.close(0)
