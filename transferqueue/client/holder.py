"""``Holder``: the lease holder of one handle, and the heartbeat that keeps its leases.

Every lease a handle's clients take (``get_meta``) names the handle's holder id,
``name/token`` (``name``: ``host:pid`` unless the deployment names it, e.g. a stage host;
``token``: drawn per handle). The controller returns the rows of a holder it learns is gone
(:mod:`transferqueue.controller.holders`), so the handle says it is alive:

- a connected handle, from its first ``get_meta`` on, beats every ``HOLDER_BEAT_S`` from a
  daemon thread over direct sockets (:mod:`transferqueue.client.direct`), never through the
  handle's event loop, which runs only while someone waits on it: a process busy with a batch
  for an hour still beats (liveness, not progress). The holders of one process beat together,
  one ``alive`` per controller for all of them (:mod:`transferqueue.client.beats`). The first
  beat is answered before that ``get_meta`` is sent, so the controller watches the holder
  before it holds anything;
- closing the handle (or dropping it and all its clients) stops the beat and tells the
  controller the holder is gone (``holder_gone``): its rows go back at once;
- :meth:`replace_earlier` says that this handle replaces every earlier handle of its name (a
  stage host restarted by its deployment): their rows go back at once, without waiting for
  their silence.

An embedded handle's holder never beats (the controller lives and dies with it).

It also remembers, for a moment, when each lease its clients took was asked for
(:meth:`Holder.took`): a ``put`` that writes a lease's fields within ``FRESH_LEASE_S`` of that,
as a stage's put of the batch it just processed does, need not renew the lease before writing
(:meth:`Holder.fresh`, :mod:`transferqueue.client.put`). In that time the lease cannot have
ended otherwise than by this handle's own calls: it runs at least ``lease_s`` from the request
(only leases of ``lease_s >= 2 * FRESH_LEASE_S`` count), the controller heard the holder when it
granted it and returns a holder's rows only after ``holder_dead_after_s`` of silence (at least
``2 * HOLDER_BEAT_S``, four times ``FRESH_LEASE_S``), and any ack, release or earlier put of the
lease by this handle's clients forgets it (the next put renews). A handle replaced by a later
one of its name is, by that call's contract, dead. A partition cleared in that moment leaves
the rows gone: the write then fails on the unit (row indexes are never reused).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from transferqueue.client.beats import Beats, beats_for
from transferqueue.wire import messages as m
from transferqueue.wire.liveness import HOLDER_BEAT_S

__all__ = ["FRESH_LEASE_S", "Holder", "default_holder_name"]

log = logging.getLogger(__name__)

Send = Callable[[Any], Any]
"""Sends one controller request and returns its reply (a direct call, from any thread)."""

FRESH_LEASE_S = HOLDER_BEAT_S / 2
"""How long after its ``get_meta`` was sent a lease is written to without renewing it first
(see the module): a quarter of the shortest ``holder_dead_after_s`` a controller accepts."""
_FRESH_KEPT = 256  # leases remembered at most (the oldest are forgotten: they renew)


def default_holder_name() -> str:
    """``host:pid`` (what logs name a holder by unless its deployment names it)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}"


class Holder:
    """One handle's holder id and heartbeat (see the module). ``send``: None for an
    embedded handle (no heartbeat, nothing to tell at close). ``address``: the controller's
    (the holders of a process that beat to it beat together; default: this holder alone)."""

    def __init__(
        self, name: str | None = None, send: Send | None = None, address: str | None = None
    ) -> None:
        name = default_holder_name() if name is None else name
        if not name or "/" in name or len(name) > 96:
            raise ValueError(
                f"holder name must be 1-96 characters without '/', got {name!r}; name a "
                "stage host, e.g. 'rollout-0'"
            )
        self.name = name
        self.id = f"{name}/{secrets.token_hex(6)}"
        self._send = send
        self._lock = threading.Lock()
        self._stopped = False
        self._beats: Beats | None = None  # (once started)
        self._address = address
        self._asked: dict[int, float] = {}  # lease id -> when its get_meta was sent (monotonic)
        self._asked_lock = threading.Lock()

    @property
    def started(self) -> bool:
        """Whether the heartbeat runs (or needs none: embedded)."""
        return self._send is None or self._beats is not None

    @property
    def beats_failed(self) -> int:
        """Heartbeats of this holder that failed (a controller restarting or gone)."""
        return 0 if self._beats is None else self._beats.failed(self.id)

    def start(self) -> None:
        """Before the first ``get_meta``: one beat answered, then a beat every
        ``HOLDER_BEAT_S`` with the process's other holders (idempotent; blocking: call it off
        the loop)."""
        if self.started:
            return
        with self._lock:
            if self._beats is not None or self._stopped:
                return
            assert self._send is not None
            self._send(m.Alive(holder=self.id))  # (a failure here fails the get_meta)
            address = self._address if self._address is not None else f"holder:{self.id}"
            beats = beats_for(address)
            beats.join(self.id, self._send)
            self._beats = beats

    def took(self, lease_id: int, asked: float, lease_s: float) -> None:
        """A ``get_meta`` sent at ``asked`` (``time.monotonic()``) leased rows for
        ``lease_s`` under ``lease_id`` (a lease too short to count is not remembered)."""
        if lease_s < 2 * FRESH_LEASE_S:
            return
        with self._asked_lock:
            if len(self._asked) >= _FRESH_KEPT:
                stale = time.monotonic() - FRESH_LEASE_S
                self._asked = {k: t for k, t in self._asked.items() if t > stale}
                if len(self._asked) >= _FRESH_KEPT:
                    self._asked.pop(next(iter(self._asked)))
            self._asked[lease_id] = asked

    def fresh(self, lease_id: int) -> bool:
        """Whether ``lease_id`` was asked for less than ``FRESH_LEASE_S`` ago and not settled
        since by this handle (see the module); forgets it either way: a second put of the
        same lease renews it."""
        with self._asked_lock:
            asked = self._asked.pop(lease_id, None)
        return asked is not None and time.monotonic() - asked < FRESH_LEASE_S

    def settled(self, lease_id: int | None) -> None:
        """This handle acknowledged or released (some of) the lease's rows: forget it."""
        if lease_id is not None:
            with self._asked_lock:
                self._asked.pop(lease_id, None)

    def replace_earlier(self) -> int:
        """Every earlier holder of this name is gone (this one replaces it): their leases'
        rows go back now. Returns how many rows went back (0 with an embedded handle)."""
        if self._send is None:
            return 0
        return int(self._send(m.HolderGone(name=self.name, keep=self.id)))

    def close(self) -> None:
        """Stop the heartbeat and tell the controller this holder is gone (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            beats = self._beats
        if beats is None:
            return  # (never took a lease: nothing to give back)
        if not beats.leave(self.id):
            return  # (a controller gone or restarting: our silence says it, no wait here)
        assert self._send is not None
        with contextlib.suppress(Exception):
            self._send(m.HolderGone(holder=self.id))
