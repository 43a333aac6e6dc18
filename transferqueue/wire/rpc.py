"""Request/reply over ZeroMQ on asyncio: one server socket, one client socket per peer.

``RpcServer`` binds a ROUTER socket, decodes each request into its declared message struct
(:mod:`transferqueue.wire.messages`) and calls the handler of its kind; a handler that must wait
(a blocking ``get_meta``) returns an awaitable, which gets a task of its own, so it never
holds up the others. The request loop never sleeps and never dies: a request refused by its
schema gets an error reply (a message whose header cannot be read is dropped), and a handler
that raises becomes a typed error reply.

``RpcClient`` holds one long-lived DEALER socket to one server; requests carry ids, replies
are matched to waiting callers and decoded into the kind's declared reply type, and every
call has a deadline after which the peer is reported gone (:class:`PeerGoneError`). While
calls wait, the client pings a silent peer and fails them once it has been silent for the
liveness bound (:mod:`transferqueue.wire.liveness`), long before their deadline.

With keys (:mod:`transferqueue.wire.auth`) both sides speak CURVE: the server answers only
trusted keys and hands each handler its key; without keys a server binds only to loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from transferqueue.errors import (
    BadRequestError,
    ClosedError,
    DeniedError,
    PeerGoneError,
    ProtocolError,
    TQError,
)
from transferqueue.limits import MAX_FRAME_BYTES
from transferqueue.wire import codec as wire
from transferqueue.wire.address import bind_address, check_address
from transferqueue.wire.auth import ClientKeys, ServerKeys, require_keys
from transferqueue.wire.counters import KindCounters, RequestCounters, frames_nbytes
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Heard, Liveness, heard_from
from transferqueue.wire.loopsocket import LoopSocket
from transferqueue.wire.peers import INTERNAL_RID, Peers
from transferqueue.wire.protocol import TRUSTED, Caller, Handler, Request

__all__ = ["RpcClient", "RpcServer", "SendThenRelease", "bind_address", "check_address"]

log = logging.getLogger(__name__)

R = TypeVar("R")


@dataclass
class SendThenRelease:
    """A reply that references memory the handler must not reuse before ZeroMQ has sent it
    (zero-copy frames); ``release`` runs once it has.

    With ``place``, buffers go into the requester's shared-memory arena where they fit (see
    :mod:`transferqueue.storage.shm`); ``offload`` encodes (and so copies) on a worker thread.
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
_LATE_MEMORY = 1024  # failed calls whose late replies are still undone (see on_late)
# Connections the kernel queues before they are accepted: with ZeroMQ's 100, thousands of
# clients connecting at once lose SYNs and retry for up to 31 s (the kernel caps it: somaxconn).
_BACKLOG = 4096
_RELOCATE_S = 5.0  # bound on asking the controller where a unit that went away listens now


_URGENT_KINDS = frozenset(k.encode() for k in ("ping", "alive"))


def _is_ping(msg: list[Any]) -> bool:
    """Whether a request (identity, header, ...) is a liveness ping or a holders' heartbeat:
    handled as soon as it is read, ahead of the requests read with it (wire.loopsocket)."""
    return len(msg) >= 2 and wire.kind_of(msg[1]) in _URGENT_KINDS


class RpcServer:
    """A ROUTER socket answering the message kinds of the role ``server`` with ``handlers``
    (see :func:`transferqueue.wire.protocol.handlers`).

    Without ``keys`` it binds only to loopback, unless ``keyless_beyond_loopback``: for a
    caller whose requests carry no rows (asyncflow's weight-transport control channel, whose
    peers sit on the cluster's own network), never for a TransferQueue server.
    ``max_connections``: client connections admitted (None: all; see wire.peers)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        server: str,
        handlers: dict[type[Request[Any]], Handler],
        *,
        join: bool = True,
        resolve: wire.Resolver | None = None,
        keys: ServerKeys | None = None,
        keyless_beyond_loopback: bool = False,
        max_connections: int | None = None,
    ) -> None:
        check_address(address, bind=True)
        if not keyless_beyond_loopback:
            require_keys(address, keys)
        self._io = LoopSocket(ctx, zmq.ROUTER, self._on_message, urgent=_is_ping)
        self._authenticator: Any = None
        try:
            # One frame above this disconnects its sender (no unbounded allocation).
            self._io.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self._io.sock.setsockopt(zmq.BACKLOG, _BACKLOG)
            if keys is not None:
                self._authenticator = keys.authenticator(ctx)
                keys.apply(self._io.sock)
            self.address = bind_address(self._io.sock, address)
        except BaseException:
            self._io.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            raise
        at = f"{server} at {self.address}"
        self.peers = Peers(self._io.sock, at, max_connections, keyed=keys is not None)
        self._keys = keys
        self._resolve = resolve
        self._server = server
        # Every request is counted by kind (see transferqueue.wire.counters): the handler and
        # the counters of a kind come from one lookup.
        self.counters = RequestCounters(cls.kind for cls in handlers)
        self._handlers: dict[type[Request[Any]], tuple[Handler, KindCounters]] = {
            cls: (h, self.counters.by_kind[cls.kind]) for cls, h in handlers.items()
        }
        self._join = join  # False: large tensors reach the handler as ChunkedTensor
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0

    @property
    def bad_messages(self) -> int:
        """Messages dropped or refused by their schema (never reached a handler)."""
        return self.counters.bad_messages

    def start(self) -> None:
        self._io.attach()
        self.peers.start()

    def _caller(self, head: Any) -> Caller:
        if self._keys is None:
            return TRUSTED
        return self._keys.caller(str(head.get("User-Id")))

    def _on_message(self, msg: list[Any]) -> None:
        """Answer inline when the handler can; requests that must wait get a task."""
        t0 = time.perf_counter()
        if len(msg) < 2:
            self.counters.bad_messages += 1  # no identity or no header: nobody to answer
            return
        identity, frames = msg[0], msg[1:]
        try:
            rid, m = wire.decode_request(
                frames, self._server, join=self._join, resolve=self._resolve
            )
        except wire.RequestError as e:  # refused by its schema: a typed reply
            self.counters.bad_messages += 1
            self._send(identity, wire.encode_error(e.rid, e.error))
            return
        except ProtocolError:
            self.counters.bad_messages += 1
            return
        self.requests += 1
        handler, counts = self._handlers[type(m)]
        counts.requests += 1
        nbytes = 0
        for f in frames:
            nbytes += len(f)
        counts.bytes_in += nbytes
        try:
            caller = self._caller(frames[0])
            self.peers.admit(frames[0], rid, caller)  # (past max_connections: refused)
            if not caller.may(m.needs):
                raise DeniedError(
                    f"{m.kind!r} needs the {m.needs} key of this service; this client's key "
                    "is not one (see transferqueue keygen --admin)"
                )
            result = handler(m, caller)
        except Exception as e:  # every handler error is a typed reply
            counts.errors += 1
            counts.bytes_out += self._reply_error(identity, rid, e)
            counts.observe(time.perf_counter() - t0)
            return
        if inspect.isawaitable(result) or isinstance(result, SendThenRelease):
            self._spawn(self._answer(identity, rid, result, counts, t0))
        else:
            counts.bytes_out += self._reply(identity, rid, result)
            counts.observe(time.perf_counter() - t0)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reply(self, identity: Any, rid: int, result: Any) -> int:
        """Send ``result``; returns the bytes sent (0: not sent)."""
        try:
            reply = wire.encode_reply(rid, result)
        except Exception as e:  # an unencodable result is a typed reply too
            reply = wire.encode_error(rid, e)
        return self._send(identity, reply)

    def _reply_error(self, identity: Any, rid: int, e: BaseException) -> int:
        if not isinstance(e, TQError | ValueError | TypeError):
            log.error("handler of a request failed", exc_info=e)
        return self._send(identity, wire.encode_error(rid, e))

    def _send(self, identity: Any, reply: list[Any]) -> int:
        try:
            self._io.send([identity, *reply])
        except (zmq.ZMQError, ValueError, TypeError) as e:
            log.warning("reply not sent: %s", e)
            return 0
        return frames_nbytes(reply)

    async def _answer(
        self, identity: Any, rid: int, pending: Any, counts: KindCounters, t0: float
    ) -> None:
        try:
            await self._answer_counted(identity, rid, pending, counts)
        finally:  # (a request cancelled at close is counted too: it got no reply)
            counts.observe(time.perf_counter() - t0)

    async def _answer_counted(
        self, identity: Any, rid: int, pending: Any, counts: KindCounters
    ) -> None:
        try:
            result = await pending if inspect.isawaitable(pending) else pending
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every handler error is a typed reply
            counts.errors += 1
            counts.bytes_out += self._reply_error(identity, rid, e)
            return
        if not isinstance(result, SendThenRelease):
            counts.bytes_out += self._reply(identity, rid, result)
            return
        try:
            reply = await _encode(
                wire.encode_reply, rid, result.value, result.place, offload=result.offload
            )
            counts.bytes_out += frames_nbytes(reply)
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
                counts.errors += 1
                counts.bytes_out += self._reply_error(identity, rid, e)
        finally:
            if result.release is not None:
                await result.release()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.peers.close()
        self._io.close()
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


class RpcClient:
    """One DEALER socket to one server; concurrent calls are matched to replies by id."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        keys: ClientKeys | None = None,
        ping: Request[str] | None = None,
        liveness: Liveness = DEFAULT_LIVENESS,
        keepalive: bool = False,
        on_pong: Callable[[str], None] | None = None,
        on_silent: Callable[[], None] | None = None,
        relocate: Callable[[], Awaitable[str]] | None = None,
        on_late: Callable[[Request[Any], Any], None] | None = None,
        internal: bool = False,
    ) -> None:
        """``ping``: the peer's ping kind (None: the peer is not watched). ``keepalive``:
        watch it all the time, not only while calls wait; ``on_pong`` gets each ping's answer
        (the peer's incarnation), ``on_silent`` is called once when the peer falls silent
        (again after it was heard from). ``relocate``: where the peer listens now, asked after
        a call found it gone (a storage unit restarted on a new address: see
        :meth:`repoint`). ``on_late`` gets the request and reply of a call that had failed
        with PeerGoneError when its reply came all the same (a restarted server served a
        request still queued to it): the caller may undo what it did. ``internal``: a
        connection of the service's own servers (never refused, see wire.peers)."""
        self.address = check_address(address)
        self._on_late = on_late
        self._late: dict[int, Request[Any]] = {}  # (failed calls, most recent _LATE_MEMORY)
        self._relocate = relocate
        self.call_timeout_s = call_timeout_s
        self._ping = ping
        self._liveness = liveness
        self._keepalive = keepalive
        self._on_pong = on_pong
        self._on_silent = on_silent
        self._pings: set[int] = set()
        # when the peer was last heard from and pinged: shared with this process's other
        # clients of it, except for a keepalive watch (it reads each answer: wire.liveness)
        self._heard = Heard() if keepalive else heard_from(self.address)
        self._since = 0.0  # when the current wait on the peer began
        self._tick_due = 0.0  # when the watch's armed tick should run (monotonic)
        self._tick: asyncio.TimerHandle | None = None
        self.silent = False  # the peer was declared gone and has not been heard from since
        self._mon: zmq.Socket[Any] | None = None
        # Finds shared-memory buffers in replies (set by the unit link that owns the arena).
        self.resolve: wire.Resolver | None = None
        self._io = LoopSocket(ctx, zmq.DEALER, self._on_message)
        try:
            if keys is not None:
                keys.apply(self._io.sock)
            self._io.sock.connect(address)
        except BaseException as e:
            self._io.close()  # (a socket left open would hold up the context's term)
            if isinstance(e, zmq.ZMQError):
                raise BadRequestError(f"cannot connect to {address!r}: {e}") from None
            raise
        self._ids = itertools.count(INTERNAL_RID + 1 if internal else 1)
        self._pending: dict[int, tuple[asyncio.Future[Any], Request[Any]]] = {}
        self._attached = False
        self._closed = False

    def _on_message(self, frames: list[Any]) -> None:
        self._heard.at = time.monotonic()
        self.silent = False
        rid = wire.reply_id(frames)
        if rid in self._pings:
            self._pings.discard(rid)
            self._pong(frames)
            return
        entry = self._pending.pop(rid, None) if rid is not None else None
        if entry is None and rid in self._late:
            self._late_reply(self._late.pop(rid), frames)
            return
        if entry is None:
            log.warning("a reply from %s that answers no pending request was dropped", self.address)
            return
        fut, msg = entry
        try:
            result = wire.decode_reply(frames, msg.wire_reply, self.resolve)
        except TQError as e:
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(result)

    async def call(
        self,
        msg: Request[R],
        *,
        wait_s: float | None = None,
        place: wire.Placer | None = None,
        offload: bool = False,
    ) -> R:
        """Send one request and wait for its reply (``wait_s`` overrides the call timeout);
        ``place`` puts its buffers into a shared-memory arena where they fit, ``offload``
        encodes (and so copies) on a worker thread."""
        self._check_open()
        rid = next(self._ids)
        frames = await _encode(wire.encode_request, rid, msg, place, offload=offload)
        try:
            return await self._send(rid, msg, frames, wait_s)
        except PeerGoneError:
            await self._relocated()
            raise  # this call's request went to the old peer; the next one goes to the new

    async def _relocated(self) -> None:
        """After a call found the peer gone: ask where it listens now (bounded) and repoint
        there if it moved. A failed lookup is only logged: the call's error is what counts."""
        if self._relocate is None or self._closed:
            return
        try:
            async with asyncio.timeout(_RELOCATE_S):
                address = await self._relocate()
        except Exception as e:
            log.info("could not look up where %s listens now: %r", self.address, e)
            return
        if address != self.address:
            self.repoint(address)

    def repoint(self, address: str) -> None:
        """Send to the peer at ``address`` from now on (it moved); calls waiting on the old
        one fail as they would have (the liveness watch)."""
        self._check_open()
        address = check_address(address)
        log.info("%s moved to %s", self.address, address)
        with contextlib.suppress(zmq.ZMQError):
            self._io.sock.disconnect(self.address)
        self._io.sock.connect(address)
        self.address = address
        if not self._keepalive:
            self._heard = heard_from(address)
        self.silent = False

    def request(self, msg: Request[R], *, wait_s: float | None = None) -> Awaitable[R]:
        """Send ``msg`` now, before this returns (on the loop's thread); await the result for
        the reply. (The controller frees rows on units this way: the free leaves before the
        reply to the ack that caused it.)"""
        self._check_open()
        rid = next(self._ids)
        return self._send(rid, msg, wire.encode_request(rid, msg), wait_s)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the connection to {self.address} is closed")
        if not self._attached:
            self._io.attach()
            self._attached = True
            self._monitor()
            if self._keepalive:
                self._since = time.monotonic()
                self._watch()

    def _send(
        self, rid: int, msg: Request[R], frames: list[Any], wait_s: float | None
    ) -> asyncio.Future[R]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self._pending:
            # a drop the monitor saw while nothing waited (an idle handle's loop does not
            # run) is read now, before this call waits: it must not fail this call, sent on
            # the connection ZeroMQ made again since (a controller restarted with its state)
            self._on_monitor()
            if not self._keepalive:
                self._since = time.monotonic()  # a wait on the peer begins
                self._watch()
        self._pending[rid] = (fut, msg)
        wait = self.call_timeout_s if wait_s is None else wait_s
        # A timer handle, not asyncio.wait_for: that wraps every call in another task.
        timer = loop.call_later(wait, self._expire, fut, msg.kind, wait)

        def done(_: asyncio.Future[Any]) -> None:
            timer.cancel()
            self._pending.pop(rid, None)
            gone = not fut.cancelled() and isinstance(fut.exception(), PeerGoneError)
            if self._on_late is not None and gone:
                self._late[rid] = msg
                if len(self._late) > _LATE_MEMORY:
                    del self._late[next(iter(self._late))]

        fut.add_done_callback(done)
        try:
            self._io.send(frames)
        except zmq.Again:  # no connection to queue it on (refused, or gone): as gone
            self._expire(fut, msg.kind, 0)
        except BaseException:
            fut.cancel()
            raise
        return fut

    def _late_reply(self, msg: Request[Any], frames: list[Any]) -> None:
        """The reply to a call that failed as gone: tell ``on_late`` (a reply that is an
        error needs nothing undone)."""
        try:
            result = wire.decode_reply(frames, msg.wire_reply, self.resolve)
        except TQError:
            return
        assert self._on_late is not None
        try:
            self._on_late(msg, result)
        except Exception:  # (the socket's reader goes on whatever the callback does)
            log.exception("undoing a late %r reply from %s failed", msg.kind, self.address)

    def _expire(self, fut: asyncio.Future[Any], kind: str, wait: float) -> None:
        if not fut.done():
            what = f"did not answer {kind!r} within {wait:.0f} s" if wait else "is not connected"
            fut.set_exception(
                PeerGoneError(
                    f"{self.address} {what}; is the TransferQueue service running and "
                    "reachable (and, if it uses keys, does this client have them)?"
                )
            )

    # -- liveness (see transferqueue.wire.liveness) ------------------------------------------------
    def _monitor(self) -> None:
        """Watch the connection: when it drops (the server process died or restarted), no
        request sent on it can be answered any more (a ROUTER answers on the connection a
        request came by), so the calls waiting fail at once."""
        if self._ping is None:
            return
        self._mon = self._io.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        loop = asyncio.get_running_loop()
        loop.add_reader(int(self._mon.getsockopt(zmq.FD)), self._on_monitor)
        loop.call_soon(self._on_monitor)

    def _on_monitor(self) -> None:
        mon = self._mon
        if mon is None:
            return
        dropped = False
        while True:
            try:
                mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                return
            dropped = True
        for fut, msg in list(self._pending.values()) if dropped else []:
            if not fut.done():
                gone = f"the connection to {self.address} dropped while {msg.kind!r} waited"
                fut.set_exception(PeerGoneError(f"{gone} on it: the server died or restarted"))

    def _close_monitor(self) -> None:
        mon, self._mon = self._mon, None
        if mon is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(int(mon.getsockopt(zmq.FD)))
        with contextlib.suppress(zmq.ZMQError):
            self._io.sock.disable_monitor()
        mon.close(0)

    def start_watch(self) -> None:
        """Start watching the peer now (``keepalive``; on the running loop)."""
        self._check_open()

    def _watch(self) -> None:
        """Arm the watch's next tick (a timer, not a task: a client's loop that has nothing
        left to do stops, see :class:`~transferqueue.loop.LoopThread`; a late tick: liveness)."""
        if self._ping is None or self._tick is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._tick_due = time.monotonic() + self._liveness.heartbeat_s
        self._tick = loop.call_later(self._liveness.heartbeat_s, self._check)

    def _check(self) -> None:
        self._tick = None
        if self._closed or not (self._pending or self._keepalive):
            return  # nothing waits on the peer: the next call arms the watch again
        lv = self._liveness
        now = time.monotonic()
        if now - self._tick_due > lv.dead_after_s / 2:  # we were frozen (wire.liveness)
            self._since = now
        silent_s = now - max(self._heard.at, self._since)
        if silent_s >= lv.dead_after_s:
            self._io.drain()  # (answers a busy loop has not read yet count)
            silent_s = now - max(self._heard.at, self._since)
        if silent_s >= lv.dead_after_s:
            self._gone(silent_s)
        elif silent_s >= lv.heartbeat_s and now - self._heard.pinged >= lv.heartbeat_s:
            self._send_ping(now)
        if self.silent and self._keepalive:
            self._send_ping(now)  # a restarted peer answers one, whenever it is back
        self._watch()

    def _send_ping(self, now: float) -> None:
        assert self._ping is not None
        if len(self._pings) > 64:  # a peer that answers none: do not pile them up
            self._pings.clear()
        rid = next(self._ids)
        self._heard.pinged = now
        try:
            self._io.send(wire.encode_request(rid, self._ping))
        except (zmq.ZMQError, ValueError) as e:
            log.warning("ping to %s not sent: %s", self.address, e)
            return
        self._pings.add(rid)

    def _pong(self, frames: list[Any]) -> None:
        if self._on_pong is None:
            return
        try:
            incarnation = wire.decode_reply(frames, str)
        except TQError as e:  # a peer that does not know the kind is alive all the same
            log.debug("ping to %s answered %r", self.address, e)
            return
        self._on_pong(incarnation)

    def _gone(self, silent_s: float) -> None:
        """The peer has been silent too long: fail every call waiting on it (and tell
        ``on_silent``, once per silence)."""
        first, self.silent = not self.silent, True
        lv = self._liveness
        for fut, msg in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(
                    PeerGoneError(
                        f"{self.address} has not answered for {silent_s:.1f} s (pings "
                        f"included; dead_after_s={lv.dead_after_s:g}) while {msg.kind!r} "
                        "waited on it: the server died or is stuck"
                    )
                )
        if first and self._on_silent is not None:
            try:
                self._on_silent()
            except Exception:  # the watch keeps running whatever the callback does
                log.exception("on_silent of %s failed", self.address)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._close_monitor()
        for fut, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(ClosedError(f"the connection to {self.address} was closed"))
        self._io.close()
