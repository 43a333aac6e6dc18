"""Who is connected to a server, and how many client connections it admits.

Every connection to a server holds one of its file descriptors and some of its memory, so a
server admits at most ``max_connections`` client connections; the next one gets
:class:`~transferqueue.errors.TooManyConnectionsError` (naming the limit, its setting and the
fix) as the answer to every request, while the connections already admitted are served as
before. A slot frees when its connection closes, and a refused connection is admitted at its
next request once one has.

What a connection is, and what it counts as, is decided here::

    event                       connection (by file descriptor)   counted as
    accepted (monitor)          connected                          connections
    first request               internal: a request of the         internal (never refused)
                                service's own servers
                                else a client while clients        clients (peak: clients_peak)
                                < max_connections
                                else refused                       refused; each request
                                                                   answered: refusals
    disconnected (monitor)      gone: its slot is free             -

A connection is told by its file descriptor: the ROUTER socket's monitor reports each
accepted and each dropped connection by descriptor, and each request says the descriptor it
came by (``ZMQ_SRCFD``). (ZeroMQ's ``ROUTER_NOTIFY``, which would report them by routing id,
is a draft option that the libzmq in pyzmq's wheels lacks.) A descriptor the system reuses
for a new connection before the monitor's report of the old one's drop was read keeps the old
one's class until it is read: one turn of the loop.

The service's own connections (the controller's to its units and their liveness watches, a
restarted unit registering with the controller, a unit copying rows to another) are never
refused: their request ids carry bit 63 (:data:`INTERNAL_RID`), and on a service with keys
their key must also be the service's own (a client cannot claim it). A connection that sends
nothing takes no slot (it holds a descriptor all the same: ``connections``). Inproc
connections have no descriptor and are not counted.

One client handle (``transferqueue.connect``) holds one connection to the controller and one
to each storage unit; a sync client's blocking calls from several threads at once open one
more to the controller per thread.

The default of ``max_connections`` follows the process's open-file limit (``ulimit -n``):
that limit less :data:`~transferqueue.limits.CONNECTION_FD_RESERVE` descriptors kept for the
server's own files and sockets, at least half the limit (:func:`default_max_connections`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from transferqueue.errors import TooManyConnectionsError
from transferqueue.limits import CONNECTION_FD_RESERVE
from transferqueue.wire.protocol import Caller

__all__ = [
    "INTERNAL_RID",
    "Peers",
    "check_max_connections",
    "default_max_connections",
    "max_connections_for",
    "raise_open_file_limit",
]

log = logging.getLogger(__name__)

INTERNAL_RID = 1 << 63
"""Bit 63 of a request id: a request of the service's own servers (never refused)."""

_INTERNAL, _CLIENT, _REFUSED = 0, 1, 2
_FALLBACK_FDS = 1024  # an open-file limit the system does not state (unlimited)


def default_max_connections() -> int:
    """The open-file limit of this process less ``CONNECTION_FD_RESERVE``, at least half of
    it (an unlimited one counts as 1,024 less the reserve: the limit of most systems)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fds = _FALLBACK_FDS if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)
    return max(fds - CONNECTION_FD_RESERVE, fds // 2, 1)


def raise_open_file_limit(at_most: int = 1 << 16) -> int:
    """Raise this process's open-file limit to its hard limit (at most ``at_most``), as a
    server process started by TransferQueue does before it serves: a soft limit of 1,024 is
    common and would cap its clients. Returns the limit now (unchanged if it cannot be)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = at_most if hard == resource.RLIM_INFINITY else min(int(hard), at_most)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.info("open-file limit stays at %d: %s", soft, e)
    return int(soft)


def check_max_connections(value: Any) -> int | None:
    """``value`` if it is a valid ``max_connections`` (an int >= 1, or None: the default)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(
        f"max_connections must be an integer >= 1 (or None: the process's open-file limit "
        f"less {CONNECTION_FD_RESERVE}), got {value!r}"
    )


def max_connections_for(value: Any) -> int:
    """``max_connections`` of a TransferQueue server: ``value`` (checked), else the default."""
    checked = check_max_connections(value)
    return default_max_connections() if checked is None else checked


class Peers:
    """The connections of one ROUTER socket and their admission (see the module docstring).

    :meth:`start` on the server's loop before it reads requests (the monitor sees what
    connects from then on), :meth:`admit` for every request, on that loop; :meth:`close`
    once (idempotent)."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        server: str,
        max_connections: int | None,
        *,
        keyed: bool = False,
        setting: str = "max_connections",
    ) -> None:
        """``server``: what the refusal calls the server (``unit at tcp://...``).
        ``max_connections``: None admits every client (counted all the same). ``keyed``:
        the server checks keys, so an internal request must also come with the service's key.
        ``setting``: how the operator sets the limit, named in the refusal."""
        self.server = server
        self.max_connections = check_max_connections(max_connections)
        self._keyed = keyed
        self._setting = setting
        self._class: dict[int, int] = {}  # descriptor -> _INTERNAL | _CLIENT | _REFUSED
        self._connected: set[int] = set()
        self.clients = 0
        self.clients_peak = 0
        self.refusals = 0
        self._mon: zmq.Socket[Any] | None = None
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Read the monitor's reports on the running loop."""
        self._mon = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(int(self._mon.getsockopt(zmq.FD)), self._drain)
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        mon = self._mon
        while mon is not None:
            try:  # (ZeroMQ's descriptor is edge-triggered: read until nothing is left)
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("%s: reading its connection monitor failed: %s", self.server, e)
                return
            event = parse_monitor_message(frames)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._connected.add(fd)
            else:
                self._connected.discard(fd)
                if self._class.pop(fd, None) == _CLIENT:
                    self.clients -= 1

    def admit(self, frame: Any, rid: int, caller: Caller) -> None:
        """Raise :class:`TooManyConnectionsError` if the connection ``frame`` came by is
        refused (``rid``, ``caller``: its request's id and caller)."""
        fd = frame.get(zmq.SRCFD) if isinstance(frame, zmq.Frame) else -1
        cls = self._class.get(fd)
        if cls is None or cls == _REFUSED:
            if fd < 0:
                return  # (inproc: no descriptor to count)
            cls = self._classify(fd, rid, caller)
        if cls == _REFUSED:
            self.refusals += 1
            raise self._refusal()

    def _classify(self, fd: int, rid: int, caller: Caller) -> int:
        if rid & INTERNAL_RID and (not self._keyed or caller.role == "service"):
            cls = _INTERNAL
        elif self.max_connections is None or self.clients < self.max_connections:
            cls = _CLIENT
            self.clients += 1
            self.clients_peak = max(self.clients_peak, self.clients)
        else:
            cls = _REFUSED
        self._class[fd] = cls
        return cls

    def _refusal(self) -> TooManyConnectionsError:
        limit, setting = self.max_connections, self._setting
        return TooManyConnectionsError(
            f"the {self.server} serves at most {limit} client connections ({setting}={limit}) "
            f"and all are taken: raise {setting} (its default follows the server's open-file "
            f"limit, `ulimit -n`, less {CONNECTION_FD_RESERVE}), or connect fewer clients (one "
            "handle per process); this connection is admitted at its next request once "
            "another has closed"
        )

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers for ``stats`` and metrics: ``connections`` (every open one),
        ``clients`` (admitted) and ``clients_peak``, ``internal``, ``refused`` (refused
        connections still open), ``refusals`` (requests refused), ``max_connections``."""
        classes = list(self._class.values())
        return {
            "connections": len(self._connected),
            "clients": self.clients,
            "clients_peak": self.clients_peak,
            "internal": classes.count(_INTERNAL),
            "refused": classes.count(_REFUSED),
            "refusals": self.refusals,
            "max_connections": self.max_connections,
        }

    def close(self) -> None:
        mon, self._mon = self._mon, None
        if mon is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(int(mon.getsockopt(zmq.FD)))
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        mon.close(0)
