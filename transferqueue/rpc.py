"""Request/reply over ZeroMQ on asyncio: one server socket, one client socket per peer.

``RpcServer`` binds a ROUTER socket and answers each request on its own task, so a request
that waits (a blocking ``get_meta``) never holds up the others. The request loop never sleeps
and never dies: a message that cannot be decoded gets an error reply when its request id can
be read (and is dropped otherwise), and a handler that raises becomes a typed error reply.

``RpcClient`` holds one long-lived DEALER socket to one server; requests carry ids, one
receiver task matches replies to waiting callers, and every call has a deadline after which
the peer is reported gone (:class:`PeerGoneError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from transferqueue import wire
from transferqueue.errors import ClosedError, PeerGoneError, ProtocolError

__all__ = ["RpcClient", "RpcServer", "SendThenRelease", "bind_address"]

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


@dataclass
class SendThenRelease:
    """A reply that references memory the handler must not reuse before ZeroMQ has sent it
    (zero-copy frames); ``release`` runs once it has.

    With ``place``, buffers go into the requester's shared-memory arena where they fit (see
    :mod:`transferqueue.shm`); ``offload`` encodes (and so copies) on a worker thread.
    """

    value: Any
    release: Callable[[], Awaitable[None]] | None = None
    place: wire.Placer | None = None
    offload: bool = False


async def _encode(fn: Callable[..., list[Any]], *args: Any, offload: bool = False) -> list[Any]:
    if offload:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
    return fn(*args)


DEFAULT_CALL_TIMEOUT_S = 60.0


def _tune(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: flow control is ours (capacity, leases), never a silent drop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def bind_address(sock: zmq.Socket[Any], address: str) -> str:
    """Bind ``address``; ``tcp://host:0`` picks a free port. Returns the bound address."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] in ("0", "*"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(address)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class _LoopSocket:
    """A plain (sync) ZeroMQ socket driven by the running event loop.

    ``zmq.asyncio`` wraps every send and receive in futures; a request then costs a few
    hundred microseconds of Python on each side. Here the loop watches the socket's file
    descriptor and drains every message that is ready in one go, and sends never block (the
    queues are unbounded), which roughly halves a round trip. ZeroMQ's descriptor is
    edge-triggered, so the socket is drained again after every send.
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, kind: int, on_message: Callable[[list[Any]], None]
    ) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.shadow(ctx.underlying).socket(kind)
        _tune(self.sock)
        self._on_message = on_message
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    def attach(self) -> None:
        """Start watching the socket on the running loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(int(self.sock.getsockopt(zmq.FD)), self.drain)
        self._loop.call_soon(self.drain)

    def drain(self) -> None:
        while not self.closed:
            try:
                msg = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("receive failed: %s", e)
                return
            self._on_message(msg)

    def send(self, frames: list[Any], *, track: bool = False) -> zmq.MessageTracker | None:
        tracker = self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
        if self._loop is not None:
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


class RpcServer:
    """A ROUTER socket answering requests of ``kinds`` with ``handler(kind, args)``."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        kinds: frozenset[str],
        handler: Handler,
        *,
        join: bool = True,
        resolve: wire.Resolver | None = None,
    ) -> None:
        self._io = _LoopSocket(ctx, zmq.ROUTER, self._on_message)
        self._resolve = resolve
        self.address = bind_address(self._io.sock, address)
        self._kinds = kinds
        self._handler = handler
        self._join = join  # False: large tensors reach the handler as ChunkedTensor
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.bad_messages = 0

    def start(self) -> None:
        self._io.attach()

    def _on_message(self, msg: list[Any]) -> None:
        """Answer inline when the handler can; requests that must wait get a task."""
        if len(msg) < 2:
            self.bad_messages += 1  # no identity or no body: nobody to answer
            return
        identity, frames = msg[0], msg[1:]
        req_id: int | None = None
        try:
            kind, req_id, args = wire.decode_request(
                frames, self._kinds, join=self._join, resolve=self._resolve
            )
            self.requests += 1
            result = self._handler(kind, args)
        except Exception as e:  # every handler error is a typed reply
            self._reply_error(identity, frames, req_id, e)
            return
        if inspect.isawaitable(result) or isinstance(result, SendThenRelease):
            self._spawn(self._answer(identity, frames, req_id, result))
        else:
            self._reply(identity, req_id, result)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reply(self, identity: Any, req_id: int, result: Any) -> None:
        try:
            reply = wire.encode_reply(req_id, result)
        except Exception as e:  # an unencodable result is a typed reply too
            reply = wire.encode_error(req_id, e)
        self._send(identity, reply)

    def _reply_error(
        self, identity: Any, frames: list[Any], req_id: int | None, e: BaseException
    ) -> None:
        if isinstance(e, ProtocolError):
            self.bad_messages += 1
            req_id = wire.peek_request_id(frames) if req_id is None else req_id
        elif not isinstance(e, ValueError | TypeError) and not hasattr(e, "code"):
            log.error("handler of a request failed", exc_info=e)
        self._send(identity, wire.encode_error(req_id, e))

    def _send(self, identity: Any, reply: list[Any]) -> None:
        try:
            self._io.send([identity, *reply])
        except (zmq.ZMQError, ValueError, TypeError) as e:
            log.warning("reply not sent: %s", e)

    async def _answer(self, identity: Any, frames: list[Any], req_id: int, pending: Any) -> None:
        try:
            result = await pending if inspect.isawaitable(pending) else pending
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every handler error is a typed reply
            self._reply_error(identity, frames, req_id, e)
            return
        if not isinstance(result, SendThenRelease):
            self._reply(identity, req_id, result)
            return
        try:
            reply = await _encode(
                wire.encode_reply, req_id, result.value, result.place, offload=result.offload
            )
            if len(reply) == 1:  # every buffer went into shared memory: no frame to wait for
                self._io.send([identity, *reply])
                return
            # (a received frame cannot be tracked: the identity goes back as bytes)
            tracker = self._io.send([bytes(identity.bytes), *reply], track=True)
            wait = 0.001
            while tracker is not None and not tracker.done:  # ZeroMQ still owns the frames
                await asyncio.sleep(wait)
                wait = min(wait * 2, 0.05)
        except Exception as e:  # an unencodable result is a typed reply too
            if isinstance(e, zmq.ZMQError):
                log.warning("reply not sent: %s", e)
            else:
                self._reply_error(identity, frames, req_id, e)
        finally:
            if result.release is not None:
                await result.release()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._io.close()


class RpcClient:
    """One DEALER socket to one server; concurrent calls are matched to replies by id."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.call_timeout_s = call_timeout_s
        # Finds shared-memory buffers in replies (set by the unit link that owns the arena).
        self.resolve: wire.Resolver | None = None
        self._io = _LoopSocket(ctx, zmq.DEALER, self._on_message)
        self._io.sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._attached = False
        self._closed = False

    def _on_message(self, frames: list[Any]) -> None:
        try:
            req_id, result = wire.decode_reply(frames, self.resolve)
        except wire.ReplyError as e:
            fut = self._pending.pop(e.req_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(e.error)
            return
        except ProtocolError as e:
            rid = wire.peek_request_id(frames)
            fut = self._pending.pop(rid, None) if rid is not None else None
            if fut is not None and not fut.done():
                fut.set_exception(e)
            else:
                log.warning("undecodable reply from %s dropped: %s", self.address, e)
            return
        fut = self._pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def call(
        self,
        kind: str,
        args: dict[str, Any] | None = None,
        *,
        wait_s: float | None = None,
        place: wire.Placer | None = None,
        offload: bool = False,
    ) -> Any:
        """Send one request and wait for its reply (``wait_s`` overrides the call timeout).

        ``place`` puts the request's buffers into a shared-memory arena where they fit;
        ``offload`` encodes (and so copies) on a worker thread."""
        if self._closed:
            raise ClosedError(f"the connection to {self.address} is closed")
        if not self._attached:
            self._io.attach()
            self._attached = True
        req_id = next(self._ids)
        frames = await _encode(
            wire.encode_request, kind, req_id, args or {}, place, offload=offload
        )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending[req_id] = fut
        wait = self.call_timeout_s if wait_s is None else wait_s
        # A timer handle, not asyncio.wait_for: that wraps every call in another task.
        timer = loop.call_later(wait, self._expire, fut, kind, wait)
        try:
            self._io.send(frames)
            return await fut
        finally:
            timer.cancel()
            self._pending.pop(req_id, None)

    def _expire(self, fut: asyncio.Future[Any], kind: str, wait: float) -> None:
        if not fut.done():
            fut.set_exception(
                PeerGoneError(
                    f"{self.address} did not answer {kind!r} within {wait:.0f} s; is the "
                    "TransferQueue service running and reachable?"
                )
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClosedError(f"the connection to {self.address} was closed"))
        self._io.close()
