"""The Ray deployment: the controller and the storage units as Ray actors.

Ray does placement and lifecycle; data never goes through Ray's object store: every actor
runs the same ZeroMQ server as ``transferqueue serve`` and clients (any process, any Ray task
or actor) connect to it with :func:`transferqueue.connect`. The actor classes are plain
classes; ``ray.remote`` is applied here, at deployment time, so nothing else imports Ray.

    import ray, transferqueue.ray_deploy as tqr
    ray.init()
    tq = tqr.start_on_ray(num_units=4)         # units spread over the cluster's nodes
    client = tq.client()                        # in the driver
    address = tq.address                        # pass it to tasks: transferqueue.connect(address)

Servers bind to the IP Ray uses for their node (loopback on a local cluster); pass ``host``
to choose another interface.
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq.asyncio

from transferqueue.controller import SPREAD_BYTES
from transferqueue.handle import TransferQueue
from transferqueue.loop import LoopThread
from transferqueue.malloc import keep_freed_memory
from transferqueue.remote import connect
from transferqueue.server import ControllerServer, UnitServer

__all__ = ["ControllerActor", "UnitActor", "start_on_ray"]


class _ServerActor:
    """Runs one server on a private event-loop thread inside the actor process."""

    def __init__(self) -> None:
        keep_freed_memory()  # the actor's worker process serves only this server
        self._io = LoopThread("transferqueue-actor")
        self._ctx = zmq.asyncio.Context()
        self._server: Any = None

    @staticmethod
    def _host(host: str | None) -> str:
        if host:
            return host
        import ray

        return str(ray.util.get_node_ip_address())

    def address(self) -> str:
        return str(self._server.address)

    def ping(self) -> bool:
        return True

    def node_id(self) -> str:
        """The Ray node this server runs on (hex id)."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def shutdown(self) -> None:
        if self._server is not None and not self._io.closed:
            self._io.run(self._server.close(), timeout=10)
            self._server = None
        self._io.close()
        self._ctx.term()


class UnitActor(_ServerActor):
    """A storage unit server (apply ``ray.remote`` to deploy)."""

    def __init__(self, unit_id: int, capacity_bytes: int | None, host: str | None) -> None:
        super().__init__()

        async def make() -> UnitServer:
            server = UnitServer(
                self._ctx, unit_id, f"tcp://{self._host(host)}:0", capacity_bytes=capacity_bytes
            )
            server.start()
            return server

        self._server = self._io.run(make())


class ControllerActor(_ServerActor):
    """The controller server (apply ``ray.remote`` to deploy)."""

    def __init__(
        self,
        unit_addresses: list[str],
        capacity_rows: int | None,
        host: str | None,
        spread_bytes: int = SPREAD_BYTES,
    ) -> None:
        super().__init__()

        async def make() -> ControllerServer:
            server = ControllerServer(
                self._ctx,
                unit_addresses,
                f"tcp://{self._host(host)}:0",
                capacity_rows=capacity_rows,
                spread_bytes=spread_bytes,
            )
            await server.start()
            return server

        self._server = self._io.run(make())


def start_on_ray(
    num_units: int = 2,
    *,
    capacity_rows: int | None = None,
    unit_capacity_bytes: int | None = None,
    host: str | None = None,
    spread: bool = True,
    spread_bytes: int = SPREAD_BYTES,
    name_prefix: str | None = None,
    actor_options: dict[str, Any] | None = None,
    start_timeout_s: float = 300.0,
) -> TransferQueue:
    """Start controller and units as Ray actors and return a connected handle.

    Needs ``ray.init()`` first. Actors take no CPU slot (``num_cpus=0``: they are I/O bound)
    and are spread over nodes (``spread=False`` packs them). ``handle.close()`` kills them.
    ``spread_bytes``: a put spreads over one unit per that many bytes (0: over all units).
    ``actor_options``: Ray actor options for every server actor, over the defaults (e.g.
    ``{"resources": {"tq_node": 0.01}}`` to keep them on the nodes declaring ``tq_node``, or
    a ``scheduling_strategy``). ``start_timeout_s`` bounds the wait for the actors to start
    (a cluster without the resources they ask for never starts them).
    """
    try:
        import ray
    except ImportError:
        raise ImportError('the Ray deployment needs ray: pip install "asyncflow[ray]"') from None
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() before transferqueue.ray_deploy.start_on_ray()")
    strategy = "SPREAD" if spread else "DEFAULT"
    # Any: Ray's actor-handle typing does not model .options(...).remote(...) chains.
    unit_cls: Any = ray.remote(num_cpus=0)(UnitActor)
    ctl_cls: Any = ray.remote(num_cpus=0)(ControllerActor)

    def opts(role: str) -> dict[str, Any]:
        o: dict[str, Any] = {"scheduling_strategy": strategy, **(actor_options or {})}
        if name_prefix:
            o["name"] = f"{name_prefix}-{role}"
        return o

    units = [
        unit_cls.options(**opts(f"unit{i}")).remote(i, unit_capacity_bytes, host)
        for i in range(num_units)
    ]
    actors: list[Any] = list(units)
    try:
        unit_addrs = _started(ray, [u.address.remote() for u in units], start_timeout_s, "units")
        ctl = ctl_cls.options(**opts("controller")).remote(
            unit_addrs, capacity_rows, host, spread_bytes
        )
        actors.append(ctl)
        address = str(_started(ray, [ctl.address.remote()], start_timeout_s, "controller")[0])
        handle = connect(address)
    except BaseException:
        _kill(actors)
        raise

    handle.mode = "ray"
    handle.add_closer(lambda: _kill(actors))
    return handle


def _started(ray: Any, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"the TransferQueue {what} did not start within {timeout_s} s: the cluster may lack "
            f"the resources they ask for ({ray.available_resources()} available)"
        ) from None


def _kill(actors: list[Any]) -> None:
    import ray

    for a in actors:
        with contextlib.suppress(Exception):  # the actor may be gone already
            ray.get(a.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(a)
