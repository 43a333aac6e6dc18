"""Blocking controller calls of the sync client straight on ZeroMQ (:class:`DirectCalls`).

A blocking ``get_meta``, ``ack`` or ``release`` of :class:`~transferqueue.client.sync_client.Client`
on a connected handle is one request and its reply. Run through the handle's event loop it
costs a task, futures, timers and several loop turns on each side of the round trip (about
0.2 ms of a 0.5 ms call on the reference machine); here the calling thread sends the request
on a DEALER socket of its own and waits for the reply in ``zmq.poll``. Everything else a call
through the loop's :class:`~transferqueue.client.controller_link.RemoteControllerLink`
guarantees holds, with the same settings (that link's):

- a call waits at most its timeout (``call_timeout_s``, plus ``timeout_s`` of a waiting
  ``get_meta``, sent in slices of ``WAIT_SLICE_S``), and a controller silent for
  ``liveness.dead_after_s`` (pings included), or whose connection drops, fails it with
  :class:`PeerGoneError`;
- with ``ride_through_s``, a call that finds the controller gone is sent again until a
  restarted one answers (:class:`~transferqueue.client.controller_link.Resend`);
- a reply that comes after its call failed as gone (a restarted controller served the
  queued request) is undone: the batch it leased is released;
- CURVE keys, when the handle has them;
- threads: sockets come from a pool, one per call in flight, so several threads may call
  at once; ``close`` wakes every waiting call (:class:`ClosedError`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any, TypeVar

import zmq

from transferqueue.client.controller_link import (
    RemoteControllerLink,
    Resend,
    deadline_of,
    next_slice,
)
from transferqueue.errors import ClosedError, PeerGoneError, TQError, UnknownRowError
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.auth import ClientKeys
from transferqueue.wire.contexts import process_context
from transferqueue.wire.liveness import Liveness, heard_from

__all__ = ["DirectCalls"]

log = logging.getLogger(__name__)
R = TypeVar("R")

_LATE_MEMORY = 64  # calls failed as gone whose late replies are still undone, per socket
_CLOSE_WAIT_S = 5.0  # how long close waits for calls in flight to see it


class _Socket:
    """One DEALER to the controller, used by one call at a time (see :class:`DirectCalls`)."""

    def __init__(self, ctx: zmq.Context[Any], address: str, keys: ClientKeys | None, wake: int):
        self.sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
        for option in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):  # (as the loop's sockets: no
            self.sock.setsockopt(option, 0)  # linger at close, no silent drop when full)
        self.mon: zmq.Socket[Any] | None = None
        try:
            if keys is not None:
                keys.apply(self.sock)
            self.sock.connect(address)
            # (a dropped connection fails the call waiting on it at once, as on the loop)
            self.mon = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        except BaseException:
            self.close()
            raise
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.mon, zmq.POLLIN)
        self.poller.register(wake, zmq.POLLIN)
        self.ids = itertools.count(1)
        self.late: dict[int, protocol.ControllerRequest[Any]] = {}
        # when the controller was last heard from and pinged, by any client of this process
        # (wire.liveness: a process's clients ping a server once per heartbeat, not each)
        self.heard = heard_from(address)

    def close(self) -> None:
        if self.mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.mon.close(0)
        self.sock.close(0)


class DirectCalls:
    """Controller calls from any thread that runs no event loop of ours, each on a pooled
    DEALER socket of its own (see the module docstring)."""

    def __init__(
        self, link: RemoteControllerLink, *, keys: ClientKeys | None, liveness: Liveness
    ) -> None:
        self._link = link  # (its address, timeout, ride-through and resend count)
        self._keys = keys
        self._liveness = liveness
        self._ctx = process_context()  # (shared by the process's handles: wire.contexts)
        self._wake_r, self._wake_w = os.pipe()  # readable once closed: wakes every wait
        self._lock = threading.Condition()
        self._idle: list[_Socket] = []
        self._busy = 0
        self.closed = False

    def call(self, msg: protocol.ControllerRequest[R]) -> R:
        """Send ``msg`` and wait for its reply, as ``RemoteControllerLink.call`` does."""
        sock = self._take()
        resend = Resend(self._link, msg, time.monotonic())
        msg = resend.msg  # (a get_meta: with its request_id)
        result: Any = None
        try:
            while True:
                try:
                    result = self._sliced(sock, msg)
                    return result
                except PeerGoneError:
                    pause = resend.pause(time.monotonic())
                    if pause is None:
                        raise
                    self._sleep(pause)
                except UnknownRowError:
                    if resend.landed(msg):
                        return None  # type: ignore[return-value]
                    raise
        finally:
            try:
                self._send_undos(sock, resend.ended(result))
            finally:
                self._give_back(sock)

    def close(self) -> None:
        """Fail calls in flight with :class:`ClosedError`, close every socket (idempotent)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            os.write(self._wake_w, b"x")
            idle, self._idle = self._idle, []
            for sock in idle:
                sock.close()
            done = self._lock.wait_for(lambda: self._busy == 0, _CLOSE_WAIT_S)
        if not done:  # (a call that never came back: it still polls the wake pipe)
            log.warning("a direct controller call did not end within %g s of close", _CLOSE_WAIT_S)
            return
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the pool ----------------------------------------------------------------------------
    def _take(self) -> _Socket:
        with self._lock:
            if self.closed:
                raise ClosedError("the TransferQueue handle is closed")
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Socket(self._ctx, self._link.rpc.address, self._keys, self._wake_r)
        except BaseException:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()
            raise

    def _give_back(self, sock: _Socket) -> None:
        with self._lock:
            self._busy -= 1
            if self.closed:
                sock.close()
                self._lock.notify_all()
            else:
                self._idle.append(sock)

    def _sleep(self, seconds: float) -> None:
        """Pause (between sendings of a call riding through), woken by close."""
        zmq.select([self._wake_r], [], [], seconds)
        if self.closed:
            raise ClosedError("the TransferQueue handle was closed")

    # -- one call ----------------------------------------------------------------------------
    def _sliced(self, sock: _Socket, msg: protocol.ControllerRequest[R]) -> R:
        timeout_s = self._link.rpc.call_timeout_s
        if not msg.waits:
            result: R = self._request(sock, msg, timeout_s)
            return result
        deadline = deadline_of(msg, time.monotonic())
        first = True
        while True:
            part, wait = next_slice(msg, deadline, time.monotonic(), first)
            result = self._request(sock, part, wait + timeout_s)
            if result is not None:
                return result
            first = False

    def _request(self, sock: _Socket, msg: protocol.ControllerRequest[Any], wait_s: float) -> Any:
        """One request and its reply, within ``wait_s`` and the liveness bound."""
        self._drain_monitor(sock)  # (a drop before this request does not concern it)
        rid = next(sock.ids)
        sock.sock.send_multipart(wire.encode_request(rid, msg), zmq.NOBLOCK, copy=False)
        try:
            return self._reply(sock, rid, msg, wait_s)
        except PeerGoneError:
            sock.late[rid] = msg  # (its reply may come yet: see _undo)
            if len(sock.late) > _LATE_MEMORY:
                del sock.late[next(iter(sock.late))]
            raise

    def _reply(
        self, sock: _Socket, rid: int, msg: protocol.ControllerRequest[Any], wait_s: float
    ) -> Any:
        lv = self._liveness
        since = time.monotonic()  # the wait on the controller begins
        deadline = since + wait_s
        while True:
            now = time.monotonic()
            step = min(deadline - now, lv.heartbeat_s)
            events = dict(sock.poller.poll(max(0, int(step * 1000) + 1)))
            if events.get(sock.sock):
                found, result = self._read(sock, rid, msg)
                if found:
                    return result
            if events.get(self._wake_r) or self.closed:
                raise ClosedError("the TransferQueue handle was closed while a call waited")
            if events.get(sock.mon) and self._drain_monitor(sock):
                raise PeerGoneError(
                    f"the connection to {self._link.rpc.address} dropped while {msg.kind!r} "
                    "waited on it: the server died or restarted"
                )
            now = time.monotonic()
            if now >= deadline:
                raise PeerGoneError(
                    f"{self._link.rpc.address} did not answer {msg.kind!r} within "
                    f"{wait_s:.0f} s; is the TransferQueue service running and reachable "
                    "(and, if it uses keys, does this client have them)?"
                )
            silent_s = now - max(sock.heard.at, since)
            if silent_s >= lv.dead_after_s:
                raise PeerGoneError(
                    f"{self._link.rpc.address} has not answered for {silent_s:.1f} s (pings "
                    f"included; dead_after_s={lv.dead_after_s:g}) while {msg.kind!r} "
                    "waited on it: the server died or is stuck"
                )
            if silent_s >= lv.heartbeat_s and now - sock.heard.pinged >= lv.heartbeat_s:
                sock.heard.pinged = now
                with contextlib.suppress(zmq.ZMQError):
                    frames = wire.encode_request(next(sock.ids), m.Ping())
                    sock.sock.send_multipart(frames, zmq.NOBLOCK)

    def _read(
        self, sock: _Socket, rid: int, msg: protocol.ControllerRequest[Any]
    ) -> tuple[bool, Any]:
        """Read what the controller sent: (True, result) once the reply to ``rid`` came
        (an error reply raises its TQError); pongs only count as heard, late replies are
        undone."""
        while True:
            try:
                frames = sock.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False, None
            sock.heard.at = time.monotonic()
            got = wire.reply_id(frames)
            if got == rid:
                return True, wire.decode_reply(frames, msg.wire_reply)
            late = sock.late.pop(got, None) if got is not None else None
            if late is not None:
                self._undo(sock, late, frames)

    def _undo(self, sock: _Socket, msg: protocol.ControllerRequest[Any], frames: list[Any]) -> None:
        """The reply to a call that failed as gone: give back what it leased, unless the
        call got that lease all the same (``LateLeases``)."""
        try:
            result = wire.decode_reply(frames, msg.wire_reply)
        except TQError as e:
            log.info("undoing a late %r reply failed: %r", msg.kind, e)
            return
        self._send_undos(sock, self._link.late.undo_of(msg, result))

    @staticmethod
    def _send_undos(sock: _Socket, undos: list[protocol.ControllerRequest[None]]) -> None:
        """Send ``undos`` (their replies are not waited for; an undo that fails leaves the
        lease to expire, the allocation to be reclaimed)."""
        for undo in undos:
            try:
                sock.sock.send_multipart(wire.encode_request(next(sock.ids), undo), zmq.NOBLOCK)
            except (TQError, zmq.ZMQError) as e:
                log.info("undoing a late %r reply failed: %r", undo.kind, e)

    @staticmethod
    def _drain_monitor(sock: _Socket) -> bool:
        """Read the monitor's events; whether the connection dropped meanwhile."""
        mon = sock.mon
        assert mon is not None
        dropped = False
        while int(mon.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            mon.recv_multipart(zmq.NOBLOCK)
            dropped = True
        return dropped
