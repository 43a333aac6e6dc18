"""The client's link to a TransferQueue controller over ZeroMQ (:class:`RemoteControllerLink`):
blocking calls sent in slices, calls answered by a restarted controller after they failed
undone (``undo_late``), and calls sent again while a controller restarts with its state
(``ride_through_s``, :data:`RESENDABLE`).

A ``get_meta`` that may be sent again carries a ``request_id`` drawn once per call
(:class:`Resend`): the controller journals it with the lease it grants, and answers a later
sending of the call with that lease's batch while it is active. So a lease granted by a
controller that died before its reply left is the one the call gets from the restarted
controller, not rows leased to nobody until their deadline. A late reply (``undo_late``) of
a sending is then given back only if it is not the lease the call ended with
(:class:`LateLeases`)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from typing import Any, TypeVar

import msgspec

from transferqueue.errors import PeerGoneError, TQError, UnknownRowError
from transferqueue.meta import BatchMeta
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.ids import random_id63
from transferqueue.wire.rpc import RpcClient

__all__ = [
    "RESENDABLE",
    "WAIT_SLICE_S",
    "LateLeases",
    "RemoteControllerLink",
    "Resend",
    "deadline_of",
    "next_slice",
    "undo_of",
]

log = logging.getLogger(__name__)
R = TypeVar("R")
Q = TypeVar("Q", bound=msgspec.Struct)

# A blocking get_meta waits on the server in slices of this length, so that a controller that
# died is noticed within a slice plus the call timeout, never never.
WAIT_SLICE_S = 20.0
_RESEND_FIRST_S = 0.1  # first pause before a call is sent again to a controller gone
_RESEND_MAX_S = 1.0

RESENDABLE: frozenset[type[protocol.ControllerRequest[Any]]] = frozenset(
    {
        # reads
        m.Ping,
        m.Lost,
        m.GetSpecs,
        m.Stats,
        m.Status,
        m.GetCustomMeta,
        m.GetLostRows,
        m.KvList,
        # the same state whether they apply once or twice
        m.RegisterFields,
        m.DeclareTasks,
        m.Discard,
        m.Ack,
        m.Release,
        m.Renew,
        m.SetCustomMeta,
        m.Commit,  # (a lease it acked already: a no-op; rows it committed and freed: above)
        m.Alive,
        # what the dead controller gave and nobody learned of is the call's again (a lease:
        # its request_id, see the module) or comes back on its own (an allocation is
        # discarded at the restart or its deadline), or is undone by undo_late when a
        # restarted controller answers the first sending
        m.GetMeta,
        m.Allocate,
    }
)
"""Controller requests that :meth:`RemoteControllerLink.call` may send again after the
controller went away (``connect(ride_through_s=...)``): sending one twice leaves the state
it would leave sent once."""


class RemoteControllerLink:
    """ControllerLink over ZeroMQ. A kind that waits (``get_meta``, ``allocate``) is sent in
    slices of at most ``WAIT_SLICE_S``, each answered with None when it runs out, so that a
    controller that died is noticed within a slice plus the call timeout, never never."""

    def __init__(self, rpc: RpcClient, ride_through_s: float = 0.0) -> None:
        self.rpc = rpc
        self.ride_through_s = ride_through_s
        self.calls_resent = 0  # calls sent again after the controller went away (see call)
        self.late = LateLeases()

    def undo_late(self, msg: Any, result: Any) -> None:
        """A call failed as gone, and its request reached a restarted controller all the
        same (it was still queued): give back the batch it leased, discard the rows it
        allocated, as the caller never learned of them (``RpcClient(on_late=...)``); a
        lease the call got all the same, from another sending, is kept
        (:meth:`LateLeases.undo_of`)."""
        self._undo(self.late.undo_of(msg, result))

    def _undo(self, undos: list[protocol.ControllerRequest[None]]) -> None:
        for undo in undos:
            try:
                sent = self.rpc.request(undo)
            except TQError as e:  # (closed: the lease expires, the allocation is reclaimed)
                log.info("undoing a late reply failed: %r", e)
                continue
            asyncio.ensure_future(sent).add_done_callback(_quiet)

    async def call(self, msg: protocol.ControllerRequest[R]) -> R:
        """Send ``msg``; with ``ride_through_s``, a call of a kind safe to send again
        (:data:`RESENDABLE`) that finds the controller gone is sent again until a restarted
        controller answers it, for at most that long (then its PeerGoneError stands)."""
        if self.ride_through_s <= 0 or type(msg) not in RESENDABLE:
            return await self._call(msg)
        loop = asyncio.get_running_loop()
        resend = Resend(self, msg, loop.time())
        msg = resend.msg
        result: Any = None
        try:
            while True:
                try:
                    result = await self._call(msg)
                    return result
                except PeerGoneError:
                    pause = resend.pause(loop.time())
                    if pause is None:
                        raise
                    await asyncio.sleep(pause)
                except UnknownRowError:
                    if resend.landed(msg):
                        return None  # type: ignore[return-value]
                    raise
        finally:
            self._undo(resend.ended(result))

    async def _call(self, msg: protocol.ControllerRequest[R]) -> R:
        if not msg.waits:
            return await self.rpc.call(msg)
        loop = asyncio.get_running_loop()
        deadline = deadline_of(msg, loop.time())
        first = True
        while True:
            part, wait = next_slice(msg, deadline, loop.time(), first)
            result = await self.rpc.call(part, wait_s=wait + self.rpc.call_timeout_s)
            if result is not None:
                return result
            first = False


class Resend:
    """When a call that found the controller gone is sent again (``ride_through_s``): the
    pauses between sendings, and the deadline after which its PeerGoneError stands. Shared
    by the loop's link and the sync client's direct calls
    (:mod:`transferqueue.client.direct`). ``msg``: the request to send, every time (a
    ``get_meta`` with its ``request_id``, see the module); :meth:`ended` once the call
    ends."""

    def __init__(self, link: RemoteControllerLink, msg: Any, now: float) -> None:
        self._link = link
        resendable = type(msg) in RESENDABLE and link.ride_through_s > 0
        self._deadline = now + (link.ride_through_s if resendable else 0.0)
        self._pause = _RESEND_FIRST_S
        self.sent_again = False
        self._request_id: int | None = None
        if resendable and isinstance(msg, m.GetMeta) and msg.request_id is None:
            self._request_id = random_id63()
            msg = msgspec.structs.replace(msg, request_id=self._request_id)
            link.late.begin(self._request_id)
        self.msg = msg

    def ended(self, result: Any) -> list[protocol.ControllerRequest[None]]:
        """The call ended with ``result`` (None: no batch, or it failed): the undos of late
        replies to its sendings that it did not end with (:meth:`LateLeases.ended`)."""
        if self._request_id is None:
            return []
        lease_id = result.lease_id if isinstance(result, BatchMeta) else None
        return self._link.late.ended(self._request_id, lease_id)

    def pause(self, now: float) -> float | None:
        """The pause before sending again, or None: give up (the deadline is near)."""
        pause = self._pause
        if now + pause > self._deadline:
            return None
        self._pause = min(2 * pause, _RESEND_MAX_S)
        self.sent_again = True
        self._link.calls_resent += 1
        return pause

    def landed(self, msg: Any) -> bool:
        """A commit of new rows sent again finds them freed: its first sending landed
        (only committed rows are freed; uncommitted ones are lost: RowsLostError)."""
        return self.sent_again and isinstance(msg, m.Commit) and msg.lease_id is None


def deadline_of(msg: Any, now: float) -> float | None:
    """When a call of a kind that waits must be answered by (None: no bound)."""
    timeout_s = getattr(msg, "timeout_s", None)
    return None if timeout_s is None else now + max(0.0, timeout_s)


def next_slice(msg: Q, deadline: float | None, now: float, first: bool) -> tuple[Q, float]:
    """The next slice of a call that waits until ``deadline``, and its wait: at most
    ``WAIT_SLICE_S``; the last one (``partial=True``) returns a short batch, the others None
    when they run out."""
    timeout_s = getattr(msg, "timeout_s", None)
    if (
        first
        and timeout_s is not None
        and timeout_s <= WAIT_SLICE_S
        and getattr(msg, "partial", False)
    ):
        return msg, timeout_s  # (a call this short is its own only slice: sent as it is)
    remaining = None if deadline is None else max(0.0, deadline - now)
    if remaining is not None and remaining <= WAIT_SLICE_S:
        return msgspec.structs.replace(msg, timeout_s=remaining, partial=True), remaining
    return msgspec.structs.replace(msg, timeout_s=WAIT_SLICE_S, partial=False), WAIT_SLICE_S


class LateLeases:
    """Which late replies to a ``get_meta`` carrying a ``request_id`` to give back.

    A sending of a call may be answered after the call gave up on it (a restarted
    controller served it: ``undo_late``), and since the controller answers every sending of
    a request with the same active lease, that may be the lease the call ends with (from a
    later sending). So a late lease is released only when it is not the call's: while the
    call goes on, it waits for the call's end::

        going   request id -> the late lease ids held until the call ends
        ended   request id -> the lease id the call ended with (None: none)   recent calls

    Thread-safe: the sync client's direct calls end on their callers' threads."""

    def __init__(self, memory: int = 1024) -> None:
        self._lock = threading.Lock()
        self._going: dict[int, list[int]] = {}  # request id -> late lease ids held
        self._ended: OrderedDict[int, int | None] = OrderedDict()
        self._memory = memory

    def begin(self, request_id: int) -> None:
        with self._lock:
            self._going[request_id] = []

    def ended(
        self, request_id: int, lease_id: int | None
    ) -> list[protocol.ControllerRequest[None]]:
        """The call of ``request_id`` ended with ``lease_id``: the releases of the late
        leases held for it that are not that one."""
        with self._lock:
            held = self._going.pop(request_id, [])
            self._ended[request_id] = lease_id
            while len(self._ended) > self._memory:
                self._ended.popitem(last=False)
        return [m.Release(lease_id=lid) for lid in dict.fromkeys(held) if lid != lease_id]

    def undo_of(self, msg: Any, result: Any) -> list[protocol.ControllerRequest[None]]:
        """What undoes the late ``result`` of ``msg`` now (:func:`undo_of`): nothing for a
        lease of a call that goes on (held until it ends) or that it ended with."""
        undo = undo_of(msg, result)
        request_id = getattr(msg, "request_id", None)
        if undo is None or request_id is None or not isinstance(undo, m.Release):
            return [] if undo is None else [undo]
        with self._lock:
            held = self._going.get(request_id)
            if held is not None:
                held.append(undo.lease_id)
                return []
            if request_id in self._ended and self._ended[request_id] == undo.lease_id:
                return []
        return [undo]


def undo_of(msg: Any, result: Any) -> protocol.ControllerRequest[None] | None:
    """What undoes a call's late result, which its caller never learned of: the release of
    the batch it leased, the discard of the rows it allocated (None: nothing to undo)."""
    if isinstance(msg, m.GetMeta) and isinstance(result, BatchMeta) and result.lease_id:
        return m.Release(lease_id=result.lease_id)
    if isinstance(msg, m.Allocate) and isinstance(result, BatchMeta) and len(result):
        return m.Discard(indexes=result.indexes)
    return None


def _quiet(fut: asyncio.Future[Any]) -> None:
    """(An undo that fails is only logged: the lease expires, the allocation is reclaimed.)"""
    if not fut.cancelled() and fut.exception() is not None:
        log.info("undoing a late reply failed: %r", fut.exception())
