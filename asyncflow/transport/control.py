"""The control channel of the cross-process transports: membership, heartbeats, headers.

Weights never travel here (shared memory or a process group moves them); only small msgpack
messages do. The sender binds one ZeroMQ ROUTER (:class:`ControlServer`); every receiver
connects one DEALER (:class:`ControlClient`). Each end has one I/O thread that owns its
socket; other threads hand messages to it through a queue and a wake-up pipe, so callers on
any thread never touch the socket. Receivers may connect before the sender binds (ZeroMQ
queues their JOIN), and join again by themselves when a sender does not know them.

Messages: one msgpack map, ``{"kind": KIND, ...fields}``. All kinds:

| kind      | dir    | fields                                  | meaning                          |
|-----------|--------|-----------------------------------------|----------------------------------|
| join      | r -> s | member, pid, host                       | a receiver (re)joins             |
| heartbeat | both   |                                         | liveness, every ``heartbeat_s``  |
| rejoin    | s -> r | reason                                  | unknown or dropped: join again   |
| leave     | r -> s |                                         | the receiver closes              |
| welcome   | s -> r | ticket (the newest, or None)            | answer to join (shm)             |
| ticket    | s -> r | version, path, layout                   | a version in a file (shm)        |
| link      | s -> r | link, prefix, store_port, timeout_s     | build the pair link (broadcast)  |
| publish   | s -> r | version, link, nbytes, layout, ranges   | receive a version on the link    |
| commit    | s -> r | version, link                           | every range went out: keep it    |
| serve     | s -> r | version, prefix, ranges, to             | send a held version to a newcomer|
| fetch     | s -> r | version, prefix, nbytes, layout, ranges | receive a version from a holder  |
| begin     | s -> r | version, layout, offsets, nbytes        | a version comes in buckets (ipc) |
| bucket    | s -> r | version, bucket, layout, handles        | copy these tensors (ipc)         |
| image     | both   | version, to, layout, handles            | a holder's image for a newcomer  |
| have      | r -> s | version, link / bucket                  | the receiver holds ``version``   |
| failed    | r -> s | version, link / bucket, reason          | it could not get ``version``     |

``ticket``, ``serve`` and ``commit`` also serve ``ipc`` (handles instead of a path; a holder
asked to export its image for ``to``; the last bucket went out).

A sender declares a member lost when it has been silent for ``dead_after_s``, or at once when
it runs on this host and its process has exited (a SIGKILL sends nothing).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from asyncflow.transport.base import TransportError

__all__ = [
    "ControlClient",
    "ControlServer",
    "Message",
    "free_tcp_address",
    "pid_alive",
    "unique_ipc_address",
]

log = logging.getLogger(__name__)

Message = dict[str, Any]
JOIN, HEARTBEAT, REJOIN, LEAVE = "join", "heartbeat", "rejoin", "leave"
WELCOME, TICKET = "welcome", "ticket"
LINK, PUBLISH, COMMIT = "link", "publish", "commit"
SERVE, FETCH, HAVE, FAILED = "serve", "fetch", "have", "failed"
BEGIN, BUCKET, IMAGE = "begin", "bucket", "image"
HOST = socket.gethostname()


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


def _encode(msg: Message) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _decode(frame: bytes) -> Message:
    msg = msgpack.unpackb(frame, raw=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ValueError(f"a control message must be a map with a 'kind', got {msg!r:.80}")
    return msg


class _Loop:
    """One socket, its I/O thread, and the queue other threads send through.

    Shared by the I/O thread and the owner's finalizer, never holding the owner itself.
    """

    def __init__(self, sock_type: int, name: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(sock_type)
        self.sock.setsockopt(zmq.LINGER, 200)  # a LEAVE may still go out on close
        self.outbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.name = name

    def post(self, *item: Any) -> None:
        self.outbox.put(item)
        with contextlib.suppress(OSError):  # closed: the loop is gone anyway
            os.write(self.wake_w, b"x")

    def start(self, target: Callable[[], None]) -> None:
        def run() -> None:
            try:
                target()
            except BaseException as e:  # recorded for the owner, who re-raises it
                log.exception("%s: control I/O thread died", self.name)
                self.error = e

        self.thread = threading.Thread(target=run, name=self.name, daemon=True)
        self.thread.start()

    def poll(self, timeout_s: float) -> bool:
        """Wait for a message or a wake-up; whether the socket has a message."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        events = dict(poller.poll(int(max(0.0, timeout_s) * 1000)))
        if self.wake_r in events:
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
        return self.sock in events

    def stop(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)
        if self.thread is None or not self.thread.is_alive():
            self.sock.close()
            self.ctx.term()
            for fd in (self.wake_r, self.wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)


class _Peer:
    def __init__(self, identity: bytes, pid: int, host: str) -> None:
        self.identity = identity
        self.pid = pid
        self.host = host
        self.last_seen = time.monotonic()


class ControlServer:
    """The sender's end: a ROUTER bound to ``address`` and its I/O thread.

    Callbacks run on the I/O thread and must not block: ``on_join(member, msg)`` when a
    receiver (re)joins, ``on_message(member, msg)`` for every other message of a known member,
    ``on_lost(member, reason)`` when a member left, went silent or its process exited, and
    ``on_tick()`` after every wake-up (at least every ``heartbeat_s``).
    """

    def __init__(
        self,
        address: str,
        *,
        on_join: Callable[[str, Message], None],
        on_message: Callable[[str, Message], None],
        on_lost: Callable[[str, str], None],
        on_tick: Callable[[], None] | None = None,
        heartbeat_s: float,
        dead_after_s: float,
        name: str = "weights-control",
    ) -> None:
        # Weak: the I/O thread must not keep the owner alive (its finalizer closes this server).
        self._on_join, self._on_message = _weak(on_join), _weak(on_message)
        self._on_lost, self._on_tick = _weak(on_lost), _weak(on_tick) if on_tick else None
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._io = _Loop(zmq.ROUTER, name)
        self._finalizer = weakref.finalize(self, self._io.stop)
        try:
            self._io.sock.bind(_bind_address(address))
        except zmq.ZMQError as e:
            self._finalizer()
            raise TransportError(
                f"the weight sender cannot bind its control socket at {address!r}: {e}; "
                "pass another address (a free port) to the transport"
            ) from e

    def start(self) -> None:
        """Start the I/O thread (once the owner can take callbacks)."""
        self._io.start(self._run)

    def members(self) -> list[str]:
        """The members joined and not lost, in join order."""
        with self._lock:
            return list(self._peers)

    def send(self, member: str, msg: Message) -> None:
        """Queue ``msg`` for ``member`` (dropped if it is gone); any thread."""
        self._io.post("send", member, _encode(msg))

    def drop(self, member: str, reason: str) -> None:
        """Forget ``member`` and tell it to join again (if it is alive); any thread."""
        self._io.post("drop", member, reason)

    def check(self) -> None:
        """Raise if the I/O thread died."""
        if self._io.error is not None:
            raise TransportError(f"the weight sender's control thread died: {self._io.error}")

    def close(self) -> None:
        self._finalizer()

    def _run(self) -> None:
        io = self._io
        while not io.stopping.is_set():
            if io.poll(self.heartbeat_s):
                while True:
                    try:
                        identity, frame = io.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue  # not two frames: not one of ours
                    self._receive(identity, frame)
            while True:
                try:
                    item = io.outbox.get_nowait()
                except queue.Empty:
                    break
                self._do(item)
            self._expire()
            if self._on_tick is not None:
                self._call(self._on_tick)

    def _do(self, item: tuple[Any, ...]) -> None:
        if item[0] == "send":
            with self._lock:
                peer = self._peers.get(item[1])
            if peer is not None:
                self._io.sock.send_multipart([peer.identity, item[2]])
        elif item[0] == "drop":
            with self._lock:
                peer = self._peers.pop(item[1], None)
            if peer is not None:
                self._io.sock.send_multipart(
                    [peer.identity, _encode({"kind": REJOIN, "reason": item[2]})]
                )

    def _receive(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = _decode(frame)
        except Exception as e:  # a stranger's bytes never stop the loop
            log.warning("weights control: dropped an undecodable message: %s", e)
            return
        kind = msg["kind"]
        if kind == JOIN:
            member = str(msg.get("member"))
            with self._lock:
                self._peers[member] = _Peer(identity, int(msg.get("pid", 0)), str(msg.get("host")))
            self._call(self._on_join, member, msg)
            return
        with self._lock:
            known = next((m for m, p in self._peers.items() if p.identity == identity), None)
            if known is not None:
                self._peers[known].last_seen = time.monotonic()
        if known is None:
            if kind != LEAVE:
                reason = "the sender does not know this receiver (restarted, or dropped it)"
                self._io.sock.send_multipart(
                    [identity, _encode({"kind": REJOIN, "reason": reason})]
                )
            return
        if kind == HEARTBEAT:
            self._io.sock.send_multipart([identity, _encode({"kind": HEARTBEAT})])
        elif kind == LEAVE:
            with self._lock:
                self._peers.pop(known, None)
            self._call(self._on_lost, known, "it left")
        else:
            self._call(self._on_message, known, msg)

    def _expire(self) -> None:
        now = time.monotonic()
        lost: list[tuple[str, str]] = []
        with self._lock:
            for member, peer in list(self._peers.items()):
                if peer.host == HOST and peer.pid and not pid_alive(peer.pid):
                    lost.append((member, f"its process {peer.pid} exited"))
                elif now - peer.last_seen > self.dead_after_s:
                    lost.append((member, f"silent for {now - peer.last_seen:.1f} s"))
            for member, _ in lost:
                del self._peers[member]
        for member, reason in lost:
            self._call(self._on_lost, member, reason)

    def _call(self, fn: Callable[[], Callable[..., None] | None], *args: Any) -> None:
        handler = fn()
        if handler is None:
            return  # the owner is gone; its finalizer stops this loop
        try:
            handler(*args)
        except Exception as e:  # a handler bug is logged and surfaced, never a dead loop
            log.exception("weights control: handler %s failed", handler)
            if self._io.error is None:
                self._io.error = e


class ControlClient:
    """A receiver's end: a DEALER connected to ``address`` and its I/O thread.

    Joins at once (``join_fields`` added to the JOIN), heartbeats every ``heartbeat_s``,
    joins again when the sender answers ``rejoin`` (after passing that message to
    ``on_message``, so the owner resets first), and sends ``leave`` on close.
    ``on_message(msg)`` runs on the I/O thread and must not block.
    """

    def __init__(
        self,
        address: str,
        member: str,
        *,
        on_message: Callable[[Message], None],
        heartbeat_s: float,
        name: str = "weights-control",
    ) -> None:
        self.member = member
        self.heartbeat_s = heartbeat_s
        self._on_message = _weak(on_message)
        self.last_heard = 0.0
        self._joined_at = 0.0
        self._io = _Loop(zmq.DEALER, name)
        self._finalizer = weakref.finalize(self, self._io.stop)
        self._io.sock.connect(address)

    def start(self) -> None:
        """Start the I/O thread (once the owner can take callbacks): it joins at once."""
        self._io.start(self._run)

    def send(self, msg: Message) -> None:
        """Queue ``msg`` for the sender; any thread."""
        self._io.post(_encode(msg))

    @property
    def error(self) -> BaseException | None:
        return self._io.error

    def close(self) -> None:
        if self._finalizer.alive:
            self.send({"kind": LEAVE})
        self._finalizer()

    def _join(self) -> None:
        self._joined_at = time.monotonic()
        msg = {"kind": JOIN, "member": self.member, "pid": os.getpid(), "host": HOST}
        self._io.sock.send(_encode(msg))

    def _run(self) -> None:
        io = self._io
        self._join()
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            stopping = io.stopping.is_set()
            while True:  # flush the outbox (a LEAVE queued by close goes out before we stop)
                try:
                    (frame,) = io.outbox.get_nowait()
                except queue.Empty:
                    break
                io.sock.send(frame)
            if stopping:
                return
            if io.poll(next_beat - time.monotonic()):
                while True:
                    try:
                        frame = io.sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._receive(frame)
            if time.monotonic() >= next_beat:
                io.sock.send(_encode({"kind": HEARTBEAT}))
                next_beat = time.monotonic() + self.heartbeat_s

    def _receive(self, frame: bytes) -> None:
        try:
            msg = _decode(frame)
        except Exception as e:
            log.warning("weights control: dropped an undecodable message: %s", e)
            return
        self.last_heard = time.monotonic()
        if msg["kind"] == HEARTBEAT:
            return
        handler = self._on_message()
        try:
            if handler is not None:
                handler(msg)
        except Exception as e:
            log.exception("weights control: receiver handler failed")
            if self._io.error is None:
                self._io.error = e
        if msg["kind"] == REJOIN and time.monotonic() - self._joined_at > self.heartbeat_s:
            self._join()  # (heartbeats crossing our JOIN also come back as rejoin: one JOIN)


def _weak(fn: Callable[..., None]) -> Callable[[], Callable[..., None] | None]:
    """A weak reference to a bound method (a strong one to anything else)."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn


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
