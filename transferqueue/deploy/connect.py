"""Connecting to a running TransferQueue service over ZeroMQ.

``connect(address)`` asks the controller for its storage units, opens one long-lived socket
per server, and returns the same :class:`TransferQueue` handle as the embedded deployment:
client code does not change with the deployment.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os

from transferqueue.client.controller_link import RemoteControllerLink
from transferqueue.client.direct import DirectCalls
from transferqueue.client.handle import TransferQueue
from transferqueue.client.unit_link import SHM_MAX_BYTES, RemoteUnitLink
from transferqueue.errors import PeerGoneError, ProtocolError
from transferqueue.loop import LoopThread
from transferqueue.loop import shared_loop as _shared_loop
from transferqueue.wire import messages as m
from transferqueue.wire.auth import ClientKeys, client_keys
from transferqueue.wire.codec import PROTOCOL_VERSION
from transferqueue.wire.contexts import process_async_context
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Liveness
from transferqueue.wire.rpc import DEFAULT_CALL_TIMEOUT_S, RpcClient, check_address

__all__ = ["connect"]

_RELOCATE_WAIT_S = 4.0  # a unit gone: how long a client waits for the controller to say where
_HELLO_AGAIN_S = (0.1, 1.0)  # pauses before asking a controller gone again: first, longest
_HELLO_MIN_S = 1.0  # the shortest wait of a hello asked again near the ride-through deadline


def connect(
    address: str,
    *,
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    connect_timeout_s: float = 10.0,
    shm_max_bytes: int = SHM_MAX_BYTES,
    keys: ClientKeys | str | os.PathLike[str] | None = None,
    liveness: Liveness = DEFAULT_LIVENESS,
    ride_through_s: float = 0.0,
    holder: str | None = None,
    shared_loop: bool = False,
) -> TransferQueue:
    """Connect to a TransferQueue service (``transferqueue serve`` prints its address,
    ``tcp://HOST:PORT``; anything else fails at once, saying so).

    ``keys``: a service with keys (any service listening beyond loopback) answers only
    clients holding one of its keys: a directory made by ``transferqueue keygen`` (or
    ``TRANSFERQUEUE_KEYS``), see :mod:`transferqueue.wire.auth`.

    Storage units on this host exchange column data with this client through shared memory
    (``/dev/shm``): per unit, a request arena of up to ``shm_max_bytes`` (default 1 GiB; 0:
    frames only) and as much again in arenas lent to reads, whose results are views of them
    until dropped. Units elsewhere, and larger transfers, use ZeroMQ frames. See
    :mod:`transferqueue.storage.shm`.

    ``liveness``: a call waiting on a server that died fails with :class:`PeerGoneError`
    within ``liveness.bound_s`` (default 4.5 s; see :mod:`transferqueue.wire.liveness`), whatever
    ``call_timeout_s`` says.

    ``ride_through_s``: for a service whose controller is restarted with its state
    (``state_dir``): a call that finds the controller gone is sent again until the restarted
    one answers, for at most this long, when sending it twice is safe (puts, ``get_meta``,
    acks, reads: :data:`RESENDABLE`); a put whose commit may have landed is then neither lost
    nor stored twice. ``connect`` itself waits so: a controller that does not answer is asked
    again until this long has passed (a connect that meets a restart succeeds once the
    restarted controller answers). 0 (default): such calls, and a connect, fail with
    :class:`PeerGoneError` (a connect after ``connect_timeout_s``).

    ``holder``: the name this handle's leases are held under (default ``host:pid``): the
    handle sends the controller a heartbeat from its first ``get_meta`` on, and the rows it
    holds go back to their queues within ``holder_dead_after_s`` (default 5 s) of its death,
    at once when it is closed or when a later handle of the same name calls
    ``replace_earlier_holders()`` (see :mod:`transferqueue.client.holder`).

    ``shared_loop``: run this handle's I/O on one event loop thread shared with the other
    handles of this process that ask for it, instead of a thread of its own (a process of
    thousands of handles: a load generator, a server of many sessions; see
    :func:`transferqueue.loop.shared_loop`). Each handle keeps its own connections, holder
    and leases; what one handle's calls do on the loop delays the others'. Every handle
    shares the process's ZeroMQ context, its liveness watch of each server and its holders'
    heartbeat in any case (:mod:`transferqueue.wire.contexts`,
    :mod:`transferqueue.wire.liveness`, :mod:`transferqueue.client.beats`).
    """
    if ride_through_s < 0:
        raise ValueError(f"ride_through_s must be >= 0, got {ride_through_s}")
    check_address(address)  # before any thread or socket exists
    ckeys = client_keys(keys)
    if shared_loop:
        io, release_io = _shared_loop("transferqueue-clients")
    else:
        io, release_io = LoopThread("transferqueue-client", always=False), None
    ctx = process_async_context()  # (shared by the process's handles: wire.contexts)
    rpcs: list[RpcClient] = []
    units: list[RemoteUnitLink] = []

    async def setup() -> tuple[RemoteControllerLink, list[RemoteUnitLink]]:
        ctl = RpcClient(
            ctx,
            address,
            call_timeout_s=call_timeout_s,
            keys=ckeys,
            ping=m.Ping(),
            liveness=liveness,
            on_late=lambda msg, result: link.undo_late(msg, result),
        )
        link = RemoteControllerLink(ctl, ride_through_s)
        rpcs.append(ctl)
        try:
            hello = await _hello(ctl, connect_timeout_s, ride_through_s)
        except PeerGoneError:
            hint = (
                "; a service beyond loopback answers only clients with its keys (keys=DIR, "
                "see transferqueue keygen)"
                if ckeys is None
                else "; or these keys are not the service's"
            )
            waited = max(connect_timeout_s, ride_through_s)
            raise PeerGoneError(
                f"no TransferQueue controller answered at {address} within {waited:g} s "
                f"(connect_timeout_s={connect_timeout_s:g}, ride_through_s={ride_through_s:g}); "
                f"start one with `transferqueue serve`{hint}"
            ) from None
        if hello.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{address} speaks protocol {hello.protocol}, expected {PROTOCOL_VERSION}"
            )

        async def unit_address(uid: int) -> str:
            """Where unit ``uid`` listens as the controller knows it now (a restarted unit
            that could not bind its old address registers its new one)."""
            return (await ctl.call(m.Hello(), wait_s=_RELOCATE_WAIT_S)).units[uid]

        for uid, addr in enumerate(hello.units):
            rpc = RpcClient(
                ctx,
                addr,
                call_timeout_s=call_timeout_s,
                keys=ckeys,
                ping=m.UnitPing(),
                liveness=liveness,
                relocate=functools.partial(unit_address, uid),
            )
            rpcs.append(rpc)
            units.append(RemoteUnitLink(uid, rpc, shm_max_bytes=shm_max_bytes))
        return link, units

    async def teardown() -> None:
        for unit in units:
            with contextlib.suppress(Exception):
                await unit.close()
        for rpc in rpcs:
            await rpc.close()

    direct: list[DirectCalls] = []

    def close_sockets() -> None:
        for calls in direct:
            calls.close()
        if not io.closed:
            io.run(teardown(), timeout=10)

    try:
        ctl_link, unit_links = io.run(setup())
        direct.append(DirectCalls(ctl_link, keys=ckeys, liveness=liveness))
    except BaseException:
        close_sockets()
        (io.close if release_io is None else release_io)()
        raise
    return TransferQueue(
        io,
        ctl_link,
        unit_links,
        closers=[close_sockets],
        address=address,
        mode="remote",
        direct=direct[0],
        holder=holder,
        release_io=release_io,
    )


async def _hello(ctl: RpcClient, connect_timeout_s: float, ride_through_s: float) -> m.HelloReply:
    """The controller's first answer: asked once for up to ``connect_timeout_s``; with
    ``ride_through_s``, asked again (a controller restarting with its state comes back on
    its address) until that long has passed since the first ask."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ride_through_s
    wait_s = connect_timeout_s
    pause, longest = _HELLO_AGAIN_S
    while True:
        try:
            return await ctl.call(m.Hello(), wait_s=wait_s)
        except PeerGoneError:
            left = deadline - loop.time() - pause
            if left <= 0:
                raise
        await asyncio.sleep(pause)
        pause = min(2 * pause, longest)
        wait_s = min(connect_timeout_s, max(left, _HELLO_MIN_S))
