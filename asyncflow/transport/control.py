"""The control channel of the cross-process weight transports: membership, liveness, events.

Weights never travel here (shared memory or a process group moves them); only the typed
messages of :mod:`.messages` do, over TransferQueue's request/reply layer
(:mod:`transferqueue.wire.rpc`): the sender's :class:`ControlServer` is an ``RpcServer`` of the
``weights`` role, each receiver's :class:`ControlClient` an ``RpcClient`` of it. So the
channel has TransferQueue's properties: one ROUTER at the sender and one long-lived DEALER per
receiver, every message decoded into its declared struct and checked before a handler runs,
a handler's error a typed error reply, a sender that dies noticed by the receivers' liveness
watch (:mod:`transferqueue.wire.liveness`) within ``dead_after_s``.

Only the sender binds. A receiver *joins*, then *polls*: the sender holds each poll up to
``heartbeat_s`` and answers it with the events queued for that receiver since its last poll
(a version to map, a link to build, ...), in the order they were sent. A poll is also the
receiver's heartbeat:

| end      | notices the other gone when                          | then                          |
|----------|------------------------------------------------------|-------------------------------|
| sender   | a receiver sent nothing (polls included) for         | ``on_lost(member, reason)``   |
|          | ``dead_after_s``; at once when it ran on this host   |                               |
|          | and its process exited (a SIGKILL sends nothing), or |                               |
|          | it left                                              |                               |
| receiver | the sender's connection dropped, or it was silent    | ``on_message(Rejoin)``, then  |
|          | for ``dead_after_s``, or it answers a poll with      | it joins again by itself      |
|          | ``rejoin`` (it restarted, or dropped this receiver)  | (every ``heartbeat_s``)       |

Receivers may start before the sender binds (their JOIN waits in ZeroMQ's queue, or is sent
again). Each end runs one event loop thread (:class:`transferqueue.loop.LoopThread`) that owns
its socket; callers on any thread hand it messages (:meth:`ControlServer.send`,
:meth:`ControlClient.send`: queued in call order, never blocking), and the owner's callbacks run
on it and must not block. The ends hold their owner's callbacks weakly, so an owner dropped
without ``close`` is collected and its finalizer closes its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from asyncflow.transport import messages as m
from asyncflow.transport.base import TransportError
from transferqueue.errors import BadRequestError, PeerGoneError, TQError
from transferqueue.loop import LoopThread
from transferqueue.sched import zmq_in_batch
from transferqueue.wire import rpc
from transferqueue.wire.liveness import Liveness, new_incarnation
from transferqueue.wire.protocol import Caller, handlers
from transferqueue.wire.rpc import RpcClient, RpcServer

__all__ = [
    "ControlClient",
    "ControlServer",
    "check_address",
    "free_tcp_address",
    "pid_alive",
    "unique_ipc_address",
]

log = logging.getLogger(__name__)

HOST = socket.gethostname()
UNKNOWN = "the sender does not know this receiver (it restarted, or dropped it)"
_LEAVE_S = 1.0  # bound on a closing receiver's LEAVE (a sender that is gone does not answer)
_CLOSE_S = 5.0
_FORGOTTEN = 1024  # dropped members whose reason the next poll is told (the most recent)

Callback = Callable[[], Callable[..., None] | None]  # a weak reference to an owner's method


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host runs (a zombie, killed but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc: trust kill(0)


def _context() -> zmq.asyncio.Context:
    """The process's one ZeroMQ context (never terminated: every end closes its sockets); in a
    process put in ``SCHED_BATCH`` its I/O threads start there too (set before the first
    socket starts them; later calls change nothing)."""
    ctx = zmq.asyncio.Context.instance()
    zmq_in_batch(ctx)
    return ctx


def _weak(fn: Callable[..., None]) -> Callback:
    """A weak reference to a bound method (a strong one to anything else)."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


class _End:
    """What both ends share: the loop thread, the owner's failure, how callbacks run."""

    def __init__(self, name: str) -> None:
        self.io = LoopThread(name)
        self.error: BaseException | None = None

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop, after what was posted before (any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is this end
            self.io.loop.call_soon_threadsafe(fn, *args)

    def call(self, ref: Callback | None, *args: Any) -> None:
        """Run an owner's callback; its error is logged and kept (the owner raises it), never
        the end of the loop."""
        handler = ref() if ref is not None else None
        if handler is None:
            return  # the owner is gone; its finalizer closes this end
        try:
            handler(*args)
        except Exception as e:
            log.exception("weights control: handler %s failed", handler)
            if self.error is None:
                self.error = e

    async def aclose(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Close the socket and end the loop thread; idempotent, from any thread."""
        if self.io.closed:
            return
        if self.io.in_loop():  # (a finalizer the garbage collector ran on this very thread)
            task = self.io.loop.create_task(self.aclose())
            task.add_done_callback(lambda _: self.io.close())
            return
        try:
            self.io.run(self.aclose(), timeout=_CLOSE_S)
        except Exception as e:  # closing goes on: the loop thread ends whatever happened
            log.warning("weights control: closing %s: %r", self.io.thread.name, e)
        self.io.close()


class _Peer:
    """The sender's view of one joined receiver."""

    def __init__(self, pid: int, host: str) -> None:
        self.pid, self.host = pid, host
        self.last_seen = time.monotonic()
        self.events: list[m.Event] = []  # sent, not yet taken by a poll
        self.waiter: asyncio.Future[None] | None = None  # the poll held for it
        self.gone: str | None = None  # why it is no longer a member (its poll says rejoin)
        self.polled = False

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Server(_End):
    """The sender's end on its loop: an ``RpcServer`` whose handlers are the methods named
    after the ``weights`` kinds (``join``, ``poll``, ...), the members, and the tick."""

    def __init__(
        self,
        address: str,
        callbacks: dict[str, Callback | None],
        heartbeat_s: float,
        dead_after_s: float,
        name: str,
    ) -> None:
        super().__init__(name)
        self.on = callbacks
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.lock = threading.Lock()  # guards peers (members() reads it from any thread)
        self.peers: dict[str, _Peer] = {}
        self.forgotten: dict[str, str] = {}
        self.incarnation = new_incarnation()
        self.rpc: RpcServer | None = None
        self.tick: asyncio.TimerHandle | None = None
        try:
            self.io.run(self._bind(address))
        except BaseException as e:
            self.stop()
            if isinstance(e, zmq.ZMQError | TQError):
                raise TransportError(
                    f"the weight sender cannot bind its control socket at {address!r}: {e}; "
                    "pass another address (a free port) to the transport"
                ) from e
            raise

    async def _bind(self, address: str) -> None:
        self.rpc = RpcServer(
            _context(),
            _bind_address(address),
            m.ROLE,
            handlers(m.ROLE, self),
            keyless_beyond_loopback=True,  # (see weights-control in the docs)
        )

    async def _start(self) -> None:
        assert self.rpc is not None
        self.rpc.start()
        self._arm()

    def start(self) -> None:
        self.io.run(self._start())

    async def aclose(self) -> None:
        if self.tick is not None:
            self.tick.cancel()
            self.tick = None
        with self.lock:
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.gone = "the sender closed"
            peer.wake()
        if self.rpc is not None:
            await self.rpc.close()

    # -- what the owner posts (on the loop) ----------------------------------------------------
    def push(self, member: str, event: m.Event) -> None:
        peer = self.peers.get(member)
        if peer is not None:
            peer.events.append(event)
            peer.wake()

    def drop(self, member: str, reason: str) -> None:
        with self.lock:
            peer = self.peers.pop(member, None)
        if peer is not None:
            self._forget(member, peer, reason)

    # -- handlers of the weights kinds (on the loop) ---------------------------------------------
    def join(self, msg: m.Join, caller: Caller) -> None:
        old = self.peers.get(msg.member)
        if old is not None and not old.polled and (old.pid, old.host) == (msg.pid, msg.host):
            # The same receiver's JOIN sent again while its first one waited for this sender
            # to bind (its call ran out): one membership, one link.
            old.last_seen = time.monotonic()
            return
        peer = _Peer(msg.pid, msg.host)
        with self.lock:
            old = self.peers.pop(msg.member, None)
            self.peers[msg.member] = peer
        self.forgotten.pop(msg.member, None)
        if old is not None:
            old.gone = "it joined again"
            old.wake()
        self.call(self.on["join"], msg.member, msg)

    async def poll(self, msg: m.Poll, caller: Caller) -> list[m.Event]:
        peer = self._seen(msg.member)
        if peer is None:
            return [m.Rejoin(reason=self.forgotten.pop(msg.member, UNKNOWN))]
        peer.polled = True
        if not peer.events and peer.gone is None:
            peer.wake()  # (a poll still held for it: the receiver gave up on that one)
            waiter = peer.waiter = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(msg.timeout_s):
                    await waiter
            if peer.waiter is not waiter:
                return []  # a newer poll of this receiver took over
            peer.waiter = None
        if peer.gone is not None:
            return [m.Rejoin(reason=peer.gone)]
        out, peer.events = peer.events[: m.MAX_EVENTS], peer.events[m.MAX_EVENTS :]
        return out

    def have(self, msg: m.Have, caller: Caller) -> None:
        if self._seen(msg.member) is not None:
            self.call(self.on["message"], msg.member, msg)

    def failed(self, msg: m.Failed, caller: Caller) -> None:
        if self._seen(msg.member) is not None:
            self.call(self.on["message"], msg.member, msg)

    def relay(self, msg: m.Relay, caller: Caller) -> None:
        if self._seen(msg.member) is not None:  # (dropped if ``to`` is gone)
            self.push(msg.to, msg.event)

    def leave(self, msg: m.Leave, caller: Caller) -> None:
        with self.lock:
            peer = self.peers.pop(msg.member, None)
        if peer is not None:
            peer.gone = "it left"
            peer.wake()
            self.call(self.on["lost"], msg.member, "it left")

    def ping(self, msg: m.Ping, caller: Caller) -> str:
        return self.incarnation

    # -- membership -------------------------------------------------------------------------
    def _seen(self, member: str) -> _Peer | None:
        peer = self.peers.get(member)
        if peer is not None:
            peer.last_seen = time.monotonic()
        return peer

    def _forget(self, member: str, peer: _Peer, reason: str) -> None:
        peer.gone = reason
        peer.wake()
        self.forgotten[member] = reason
        if len(self.forgotten) > _FORGOTTEN:
            del self.forgotten[next(iter(self.forgotten))]

    def _arm(self) -> None:
        # Twice per heartbeat: a failed catch-up is retried soon after its retry time.
        self.tick = self.io.loop.call_later(self.heartbeat_s / 2, self._tick)

    def _tick(self) -> None:
        self.tick = None
        now = time.monotonic()
        lost: list[tuple[str, _Peer, str]] = []
        with self.lock:
            for member, peer in list(self.peers.items()):
                if peer.host == HOST and peer.pid and not pid_alive(peer.pid):
                    lost.append((member, peer, f"its process {peer.pid} exited"))
                elif now - peer.last_seen > self.dead_after_s:
                    lost.append((member, peer, f"silent for {now - peer.last_seen:.1f} s"))
            for member, _, _ in lost:
                del self.peers[member]
        for member, peer, reason in lost:
            self._forget(member, peer, reason)
            self.call(self.on["lost"], member, reason)
        self.call(self.on["tick"])
        self._arm()


class ControlServer:
    """The sender's end: bound to ``address`` at once, serving once :meth:`start` is called.

    Callbacks run on the end's loop thread and must not block: ``on_join(member, Join)`` when a
    receiver (re)joins, ``on_message(member, Have | Failed)`` for the reports of a known
    member, ``on_lost(member, reason)`` when a member left, went silent or its process exited,
    and ``on_tick()`` twice per ``heartbeat_s``. A known member's ``relay`` is passed on to
    its ``to`` with no callback.
    """

    def __init__(
        self,
        address: str,
        *,
        on_join: Callable[[str, m.Join], None],
        on_message: Callable[[str, m.Have | m.Failed], None],
        on_lost: Callable[[str, str], None],
        on_tick: Callable[[], None] | None = None,
        heartbeat_s: float,
        dead_after_s: float,
        name: str = "weights-control",
    ) -> None:
        callbacks = {
            "join": _weak(on_join),
            "message": _weak(on_message),
            "lost": _weak(on_lost),
            "tick": _weak(on_tick) if on_tick is not None else None,
        }
        self._end = _Server(address, callbacks, heartbeat_s, dead_after_s, name)
        self._finalizer = weakref.finalize(self, self._end.stop)

    def start(self) -> None:
        """Start answering (once the owner can take callbacks)."""
        self._end.start()

    def members(self) -> list[str]:
        """The members joined and not lost, in join order."""
        with self._end.lock:
            return list(self._end.peers)

    def send(self, member: str, event: m.Event) -> None:
        """Queue ``event`` for ``member``'s next poll (dropped if it is gone); any thread."""
        self._end.post(self._end.push, member, event)

    def drop(self, member: str, reason: str) -> None:
        """Forget ``member``; its next poll tells it to join again (if it is alive); any
        thread."""
        self._end.post(self._end.drop, member, reason)

    def check(self) -> None:
        """Raise if a callback failed (the owner's bug, logged where it happened)."""
        if self._end.error is not None:
            raise TransportError(f"the weight sender's control loop failed: {self._end.error}")

    def close(self) -> None:
        self._finalizer()


class _Client(_End):
    """A receiver's end on its loop: an ``RpcClient`` to the sender and the task that joins
    and polls (the end's one background task: its failure is kept in ``error``)."""

    def __init__(
        self,
        address: str,
        member: str,
        on_message: Callback,
        heartbeat_s: float,
        dead_after_s: float,
        name: str,
    ) -> None:
        super().__init__(name)
        self.member = member
        self.on_message = on_message
        self.heartbeat_s = heartbeat_s
        self.liveness = Liveness(heartbeat_s=heartbeat_s, dead_after_s=dead_after_s)
        self.joined = False
        self.task: asyncio.Task[None] | None = None
        try:
            self.rpc = self.io.run(self._connect(address))
        except BaseException as e:
            self.io.close()
            if isinstance(e, TQError):
                raise TransportError(
                    f"a weight receiver cannot connect to the sender's control socket at "
                    f"{address!r}: {e}"
                ) from e
            raise

    async def _connect(self, address: str) -> RpcClient:
        return RpcClient(
            _context(),
            address,
            call_timeout_s=self.liveness.bound_s,
            ping=m.Ping(),
            liveness=self.liveness,
        )

    async def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())
        self.task.add_done_callback(self._ended)

    def start(self) -> None:
        self.io.run(self._start())

    async def _run(self) -> None:
        """Join, then poll until closed; join again when the sender says so or cannot be
        reached (every ``heartbeat_s``)."""
        join = m.Join(member=self.member, pid=os.getpid(), host=HOST)
        poll = m.Poll(member=self.member, timeout_s=self.heartbeat_s)
        while True:
            try:
                await self.rpc.call(join)
                self.joined = True
                while self.joined:
                    events = await self.rpc.call(
                        poll, wait_s=self.heartbeat_s + self.liveness.bound_s
                    )
                    for event in events or ():
                        self.call(self.on_message, event)
                        if isinstance(event, m.Rejoin):
                            self.joined = False
            except TQError as e:  # gone, restarting, not up yet, or a reply refused
                if not isinstance(e, PeerGoneError):
                    log.warning("weights control of %r: %r", self.member, e)
                if self.joined:  # the owner resets what it holds from the sender first
                    self.joined = False
                    self.call(self.on_message, m.Rejoin(reason=f"the sender is unreachable: {e}"))
                await asyncio.sleep(self.heartbeat_s)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self.error is None:
            log.error("weights control of %r ended", self.member, exc_info=task.exception())
            self.error = task.exception()

    def send(self, msg: m.Have | m.Failed | m.Relay) -> None:
        with contextlib.suppress(TQError):  # closed
            asyncio.ensure_future(self.rpc.request(msg)).add_done_callback(self._sent)

    def _sent(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.info(
                "weights control of %r: a report was not delivered: %s",
                self.member,
                fut.exception(),
            )

    async def aclose(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        if self.joined and not self.rpc.silent:
            with contextlib.suppress(TQError):  # the sender drops this receiver at once
                await self.rpc.call(m.Leave(member=self.member), wait_s=_LEAVE_S)
        await self.rpc.close()


class ControlClient:
    """A receiver's end: joins the sender at ``address`` once :meth:`start` is called, and
    passes every event to ``on_message(event)`` (on the end's loop thread; it must not
    block). A :class:`~.messages.Rejoin` is passed before joining again, so the owner resets
    what it holds from the sender first."""

    def __init__(
        self,
        address: str,
        member: str,
        *,
        on_message: Callable[[m.Event], None],
        heartbeat_s: float,
        dead_after_s: float,
        name: str = "weights-control",
    ) -> None:
        self.member = member
        self._end = _Client(address, member, _weak(on_message), heartbeat_s, dead_after_s, name)
        self._finalizer = weakref.finalize(self, self._end.stop)

    def start(self) -> None:
        """Start joining and polling (once the owner can take callbacks)."""
        self._end.start()

    def send(self, msg: m.Have | m.Failed | m.Relay) -> None:
        """Queue a report (or an event for another receiver, which the sender passes on) for
        the sender; any thread."""
        self._end.post(self._end.send, msg)

    @property
    def error(self) -> BaseException | None:
        """A callback's failure, or the control loop's (None: all is well)."""
        return self._end.error

    def close(self) -> None:
        """Leave (the sender drops this receiver at once) and close; idempotent."""
        self._finalizer()


def check_address(address: object) -> str:
    """``address`` if the control channel can use it, else a ValueError showing the forms."""
    try:
        return rpc.check_address(address)
    except BadRequestError:
        raise ValueError(
            "address must be a ZeroMQ endpoint: tcp://HOST:PORT or ipc://PATH (ipc://@NAME: a "
            f"Linux abstract socket), got {address!r}"
        ) from None


def _bind_address(address: str) -> str:
    """Where the sender binds for ``address`` (what receivers connect to): a TCP address on
    a named host binds every interface, so receivers on other nodes can reach it."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        if host not in ("127.0.0.1", "localhost", "[::1]", "*", "0.0.0.0"):
            return f"tcp://*:{port}"
    return address


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """``tcp://host:PORT`` with a port that was free a moment ago (bind to 0, then close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def unique_ipc_address() -> str:
    """A same-host address with no file to leak: a Linux abstract-namespace socket, else TCP
    on the loopback."""
    if os.uname().sysname == "Linux":
        return f"ipc://@asyncflow-weights-{os.getpid()}-{os.urandom(8).hex()}"
    return free_tcp_address()
