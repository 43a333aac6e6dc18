"""How a peer that died is noticed in seconds: heartbeats on the request sockets.

A ZeroMQ socket to a dead peer does not fail: it queues requests and reconnects, so a call
would only end at its timeout (a minute). Instead every :class:`~transferqueue.wire.rpc.RpcClient`
watches its peer while it waits on it: once the peer has been silent for ``heartbeat_s`` it
sends a ``ping`` (answered inline by every server, never queued behind other work), and once
the peer has been silent for ``dead_after_s`` every call still waiting on it fails with
:class:`~transferqueue.errors.PeerGoneError`. The controller watches its storage units the
same way all the time (``keepalive``), not only while it waits on them, and learns from each
ping's answer the unit's *incarnation* (a token drawn when the unit process started): a unit
that answers with a new one was restarted, and holds none of the rows it held before.

A call is thus failed within ``dead_after_s`` plus one ``heartbeat_s`` (the watch's tick) of
its peer's death, whatever the call's own timeout; a peer that is alive but busy answers the
pings and is never given up on. A watch whose own tick runs more than ``dead_after_s / 2``
late was not running (its process frozen by SIGSTOP or a swapped-out host, its loop blocked):
what the peer said meanwhile is unread, so the peer's silence is counted from then, not from
before. Without that a controller woken from a freeze would declare every live storage unit
lost, and their rows with them (tests/transferqueue/test_frozen.py).

| setting        | default | meaning                                                      |
|----------------|---------|--------------------------------------------------------------|
| heartbeat_s    | 0.5     | silence after which a ping is sent; the watch's tick         |
| dead_after_s   | 4.0     | silence after which the peer is declared gone                |
| holder_dead_after_s | 5.0 | (a controller's) silence of a client holding leases after   |
|                |         | which its rows go back (:mod:`transferqueue.controller.holders`) |
| holder_grace_s | 15.0    | (a restarted controller's) wait for holders to beat again    |

The other direction works the same way with the roles swapped: a client that holds leases
sends the controller a heartbeat (``alive``) every second, and the controller returns the rows
of a client silent for ``holder_dead_after_s``.

Neither grows with the number of clients in a process. The clients of one process that wait
on the same server share what they heard from it (:func:`heard_from`): a reply to any of them
shows the server alive to all, and one ping per ``heartbeat_s`` from the process stands for
all of them. Without that, thousands of clients queued on a saturated controller each pinged
it every ``heartbeat_s``: a storm that took the controller's time from the calls themselves
until they failed as gone (``python -m bench.load``). Likewise the holders of one process beat
together, in one ``alive`` per controller (:mod:`transferqueue.client.beats`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LIVENESS",
    "HOLDER_BEAT_S",
    "Heard",
    "Liveness",
    "heard_from",
    "new_incarnation",
]

HOLDER_BEAT_S = 1.0
"""How often a connected handle holding leases sends its ``alive`` heartbeat (a holder's
``holder_dead_after_s`` must be at least twice it)."""


@dataclass(frozen=True, kw_only=True)
class Liveness:
    """Heartbeat settings of a client, a controller or a service (see the module)."""

    heartbeat_s: float = 0.5
    """Silence of a peer after which it is pinged; also how often the watch looks."""
    dead_after_s: float = 4.0
    """Silence of a peer after which it is declared gone (calls waiting on it fail)."""
    holder_dead_after_s: float = 5.0
    """A controller's: silence of a client holding leases after which they are returned."""
    holder_grace_s: float = 15.0
    """A restarted controller's: how long holders of restored leases have to beat again."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "dead_after_s", "holder_dead_after_s", "holder_grace_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"Liveness.{name} must be a positive number of seconds, got {value!r}"
                )
        if self.holder_dead_after_s < 2 * HOLDER_BEAT_S:
            raise ValueError(
                f"Liveness.holder_dead_after_s={self.holder_dead_after_s} must be at least "
                f"twice the holders' heartbeat ({HOLDER_BEAT_S} s), or live clients would "
                "lose their leases"
            )
        if self.dead_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"Liveness.dead_after_s={self.dead_after_s} must be at least twice "
                f"heartbeat_s={self.heartbeat_s}: a peer gets a ping before it is given up on"
            )

    @property
    def bound_s(self) -> float:
        """The longest a call waits on a dead peer before it fails."""
        return self.dead_after_s + self.heartbeat_s


DEFAULT_LIVENESS = Liveness()


@dataclass
class Heard:
    """When a peer was last heard from and last pinged (monotonic seconds): one client's, or
    shared by the clients of one process that wait on the same address (see the module)."""

    at: float = 0.0
    pinged: float = 0.0


_HEARD: dict[str, Heard] = {}


def heard_from(address: str) -> Heard:
    """What this process heard from the server at ``address``, shared by its clients of it
    (one entry per address this process ever called: a few, not one per client)."""
    return _HEARD.setdefault(address, Heard())


def new_incarnation() -> str:
    """A token naming one run of a server process (it changes when the process restarts)."""
    return secrets.token_hex(8)


RIDE_THROUGH_S = 60.0
"""A ``ride_through_s`` for a controller restarted with its state (3-7 s here) on a loaded
host: what ``start_on_ray(state_dir=...)`` and asyncflow with a ``state_dir`` use."""
