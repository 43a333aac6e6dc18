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

__all__ = ["RESENDABLE", "WAIT_SLICE_S", "RemoteControllerLink"]

log = logging.getLogger(__name__)
R = TypeVar("R")

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
        undo: protocol.ControllerRequest[None] | None = None
        if isinstance(msg, m.GetMeta) and isinstance(result, BatchMeta) and result.lease_id:
            undo = m.Release(lease_id=result.lease_id)
        elif isinstance(msg, m.Allocate) and isinstance(result, BatchMeta) and len(result):
            undo = m.Discard(indexes=result.indexes)
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
        deadline = loop.time() + self.ride_through_s
        sent_again = False
        pause = _RESEND_FIRST_S
        while True:
            try:
                return await self._call(msg)
            except PeerGoneError:
                if loop.time() + pause > deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, _RESEND_MAX_S)
                sent_again = True
                self.calls_resent += 1
            except UnknownRowError:
                # a commit of new rows sent again finds them freed: its first sending landed
                # (only committed rows are freed; uncommitted ones are lost: RowsLostError)
                if sent_again and isinstance(msg, m.Commit) and msg.lease_id is None:
                    return None  # type: ignore[return-value]
                raise

    async def _call(self, msg: protocol.ControllerRequest[R]) -> R:
        if not msg.waits:
            return await self.rpc.call(msg)
        loop = asyncio.get_running_loop()
        timeout_s = getattr(msg, "timeout_s", None)
        deadline = None if timeout_s is None else loop.time() + max(0.0, timeout_s)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            last = remaining is not None and remaining <= WAIT_SLICE_S
            wait = remaining if last else WAIT_SLICE_S
            assert wait is not None
            part = msgspec.structs.replace(msg, timeout_s=wait, partial=last)
            result = await self.rpc.call(part, wait_s=wait + self.rpc.call_timeout_s)
            if result is not None:
                return result


def _quiet(fut: asyncio.Future[Any]) -> None:
    """(An undo that fails is only logged: the lease expires, the allocation is reclaimed.)"""
    if not fut.cancelled() and fut.exception() is not None:
        log.info("undoing a late reply failed: %r", fut.exception())
