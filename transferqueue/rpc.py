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
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from transferqueue import wire
from transferqueue.errors import ClosedError, PeerGoneError, ProtocolError

__all__ = ["RpcClient", "RpcServer", "bind_address"]

log = logging.getLogger(__name__)

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]

DEFAULT_CALL_TIMEOUT_S = 60.0


def _tune(sock: zmq.asyncio.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    # Unbounded queues: flow control is ours (capacity, leases), never a silent drop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def bind_address(sock: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``address``; ``tcp://host:0`` picks a free port. Returns the bound address."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] in ("0", "*"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(address)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


class RpcServer:
    """A ROUTER socket answering requests of ``kinds`` with ``handler(kind, args)``."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, kinds: frozenset[str], handler: Handler
    ) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        _tune(self._sock)
        self.address = bind_address(self._sock, address)
        self._kinds = kinds
        self._handler = handler
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.requests = 0
        self.bad_messages = 0

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            try:
                msg = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM or self._sock.closed:
                    return
                log.warning("receive failed: %s", e)
                continue
            if len(msg) < 2:
                self.bad_messages += 1  # no identity or no body: nobody to answer
                continue
            task = asyncio.get_running_loop().create_task(self._answer(msg[0], msg[1:]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, identity: Any, frames: list[Any]) -> None:
        req_id: int | None = None
        try:
            kind, req_id, args = wire.decode_request(frames, self._kinds)
            self.requests += 1
            result = await self._handler(kind, args)
            reply = wire.encode_reply(req_id, result)
        except asyncio.CancelledError:
            raise
        except ProtocolError as e:
            self.bad_messages += 1
            req_id = wire.peek_request_id(frames) if req_id is None else req_id
            reply = wire.encode_error(req_id, e)
        except Exception as e:
            if not isinstance(e, ValueError | TypeError) and not hasattr(e, "code"):
                log.exception("handler of a request failed")
            reply = wire.encode_error(req_id, e)
        try:
            await self._sock.send_multipart([identity, *reply], copy=False)
        except zmq.ZMQError as e:
            log.warning("reply not sent: %s", e)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(0)


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
        self._sock = ctx.socket(zmq.DEALER)
        _tune(self._sock)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._recv_task: asyncio.Task[None] | None = None
        self._closed = False

    def _ensure_receiver(self) -> None:
        if self._recv_task is None:
            self._recv_task = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError:
                return
            try:
                req_id, result = wire.decode_reply(frames)
            except wire.ReplyError as e:
                fut = self._pending.pop(e.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(e.error)
                continue
            except ProtocolError as e:
                rid = wire.peek_request_id(frames)
                fut = self._pending.pop(rid, None) if rid is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(e)
                else:
                    log.warning("undecodable reply from %s dropped: %s", self.address, e)
                continue
            fut = self._pending.pop(req_id, None)
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def call(
        self, kind: str, args: dict[str, Any] | None = None, *, wait_s: float | None = None
    ) -> Any:
        """Send one request and wait for its reply (``wait_s`` overrides the call timeout)."""
        if self._closed:
            raise ClosedError(f"the connection to {self.address} is closed")
        self._ensure_receiver()
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            await self._sock.send_multipart(
                wire.encode_request(kind, req_id, args or {}), copy=False
            )
            wait = self.call_timeout_s if wait_s is None else wait_s
            return await asyncio.wait_for(fut, wait)
        except TimeoutError:
            raise PeerGoneError(
                f"{self.address} did not answer {kind!r} within {wait:.0f} s; is the "
                "TransferQueue service running and reachable?"
            ) from None
        finally:
            self._pending.pop(req_id, None)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClosedError(f"the connection to {self.address} was closed"))
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recv_task
        self._sock.close(0)
