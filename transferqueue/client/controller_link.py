"""The client's link to a TransferQueue controller over ZeroMQ (:class:`RemoteControllerLink`):
blocking calls sent in slices, calls answered by a restarted controller after they failed
undone (``undo_late``), and calls sent again while a controller restarts with its state
(``ride_through_s``, :data:`RESENDABLE`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

import msgspec

from transferqueue.errors import PeerGoneError, UnknownRowError
from transferqueue.meta import BatchMeta
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.rpc import RpcClient

__all__ = [
    "RESENDABLE",
    "WAIT_SLICE_S",
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
        # what the dead controller gave and nobody learned of comes back on its own (a lease
        # expires, an allocation is discarded at the restart or its deadline), or is undone
        # by undo_late when a restarted controller answers the first sending
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

    def undo_late(self, msg: Any, result: Any) -> None:
        """A call failed as gone, and its request reached a restarted controller all the
        same (it was still queued): give back the batch it leased, discard the rows it
        allocated, as the caller never learned of them (``RpcClient(on_late=...)``)."""
        undo = undo_of(msg, result)
        if undo is not None:
            sent = self.rpc.request(undo)
            asyncio.ensure_future(sent).add_done_callback(_quiet)

    async def call(self, msg: protocol.ControllerRequest[R]) -> R:
        """Send ``msg``; with ``ride_through_s``, a call of a kind safe to send again
        (:data:`RESENDABLE`) that finds the controller gone is sent again until a restarted
        controller answers it, for at most that long (then its PeerGoneError stands)."""
        if self.ride_through_s <= 0 or type(msg) not in RESENDABLE:
            return await self._call(msg)
        loop = asyncio.get_running_loop()
        resend = Resend(self, msg, loop.time())
        while True:
            try:
                return await self._call(msg)
            except PeerGoneError:
                pause = resend.pause(loop.time())
                if pause is None:
                    raise
                await asyncio.sleep(pause)
            except UnknownRowError:
                if resend.landed(msg):
                    return None  # type: ignore[return-value]
                raise

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
    (:mod:`transferqueue.client.direct`)."""

    def __init__(self, link: RemoteControllerLink, msg: Any, now: float) -> None:
        self._link = link
        self._deadline = now + (link.ride_through_s if type(msg) in RESENDABLE else 0.0)
        self._pause = _RESEND_FIRST_S
        self.sent_again = False

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
