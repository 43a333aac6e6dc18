"""The heartbeats of a process's lease holders: one ``alive`` per controller per beat.

Every connected handle that takes leases has a holder (:mod:`transferqueue.client.holder`)
whose heartbeat keeps them. A process holds one handle, or thousands (a load generator, a
server of many sessions): were each to beat on its own, a controller would read one message
per handle per ``HOLDER_BEAT_S`` and a process would run one thread per handle. Instead the
holders of one process that hold leases from the same controller beat together: one daemon
thread per controller address sends, every ``HOLDER_BEAT_S``, one ``alive`` naming all of
them, over the direct sockets of one of their handles (another's when that one fails, e.g.
because its handle is closing). The thread ends when its last holder leaves, and a later
holder starts a new one.

A beat that fails (a controller restarting, or stuck past the call's bound) counts against
every holder of that address (``Holder.beats_failed``); the next beat is sent at its time.
Each address has a thread of its own, so one stuck controller delays no other's beats.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from transferqueue.limits import MAX_HOLDERS_PER_BEAT
from transferqueue.wire import messages as m
from transferqueue.wire.liveness import HOLDER_BEAT_S

__all__ = ["Beats", "beats_for"]

log = logging.getLogger(__name__)

Send = Callable[[Any], Any]
"""Sends one controller request and returns its reply (a direct call, from any thread)."""


class _Member:
    """One holder in a beat: how to send, and what the beats said of it."""

    __slots__ = ("failed", "reachable", "send")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.failed = 0  # beats that failed while it was a member
        self.reachable = True  # the last beat was answered


class Beats:
    """The holders of this process that beat to one controller (see the module)."""

    def __init__(self, address: str, *, interval_s: float = HOLDER_BEAT_S) -> None:
        self.address = address
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._thread: threading.Thread | None = None
        self.sent = 0  # alive messages sent (tests, stats)

    def join(self, holder: str, send: Send) -> None:
        """Beat for ``holder`` from now on (its first beat was answered by the caller)."""
        with self._lock:
            self._members[holder] = _Member(send)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="transferqueue-holders", daemon=True
                )
                self._thread.start()

    def leave(self, holder: str) -> bool:
        """Stop beating for ``holder``; returns whether its last beat was answered."""
        with self._lock:
            member = self._members.pop(holder, None)
        return member is not None and member.reachable

    def failed(self, holder: str) -> int:
        with self._lock:
            member = self._members.get(holder)
        return 0 if member is None else member.failed

    def holders(self) -> list[str]:
        with self._lock:
            return list(self._members)

    def _run(self) -> None:
        while True:  # (ends when no holder is left)
            time.sleep(self.interval_s)
            with self._lock:
                if not self._members:
                    self._thread = None
                    return
                members = list(self._members.items())
            for at in range(0, len(members), MAX_HOLDERS_PER_BEAT):
                self._beat(members[at : at + MAX_HOLDERS_PER_BEAT])

    def _beat(self, members: list[tuple[str, _Member]]) -> None:
        ids = [h for h, _ in members]
        beat = m.Alive(holder=ids[0], holders=ids[1:])
        error: Exception | None = None
        for _, member in members[:3]:  # (a closing handle's send fails: try another's)
            try:
                member.send(beat)
            except Exception as e:
                error = e
                continue
            self.sent += 1
            for _, mb in members:
                mb.reachable = True
            return
        for _, mb in members:  # (a controller restarting: beat again next time)
            mb.failed += 1
            mb.reachable = False
        log.debug("holders' heartbeat to %s failed: %r", self.address, error)


_BEATS: dict[str, Beats] = {}
_BEATS_LOCK = threading.Lock()


def beats_for(address: str) -> Beats:
    """The beats of this process's holders to the controller at ``address``."""
    with _BEATS_LOCK:
        beats = _BEATS.get(address)
        if beats is None:
            beats = _BEATS[address] = Beats(address)
        return beats
