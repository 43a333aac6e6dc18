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

Across nodes the servers bind to the IP Ray uses for their node and speak CURVE, with the
keys of ``keys=DIR`` (``transferqueue keygen``; or ``TRANSFERQUEUE_KEYS``): the same mechanism
as ``transferqueue serve`` (:mod:`transferqueue.auth`); tasks connect with
``transferqueue.connect(address, keys=DIR)``. Without keys the servers bind to 127.0.0.1, which
only a one-node cluster can use: on several nodes :func:`start_on_ray` asks for keys. ``host``
chooses the interface (beyond loopback it needs keys too). The servers share a fresh grant key
(:mod:`transferqueue.grants`), given to the actors.

A storage unit whose actor dies is restarted by Ray (``unit_max_restarts``, default 5), as
the supervisor of ``transferqueue serve`` restarts a unit process: the dead incarnation's rows
are lost (the controller reports them, :mod:`transferqueue.health`); the new one asks the
controller actor (found by name) where the unit listened, binds there again when it can (so
that connected clients reach it without reconnecting), and registers, after which it takes new
rows. The controller is not restarted: its metadata lives in its process.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from typing import Any

import zmq.asyncio

from transferqueue.auth import ClientKeys, ServerKeys, client_keys, server_keys
from transferqueue.controller import SPREAD_BYTES
from transferqueue.errors import AuthError
from transferqueue.grants import new_grant_key
from transferqueue.handle import TransferQueue
from transferqueue.loop import LoopThread
from transferqueue.malloc import keep_freed_memory
from transferqueue.metrics import check_metrics_port
from transferqueue.placement import check_replicas
from transferqueue.remote import connect
from transferqueue.server import ControllerServer, UnitServer

__all__ = ["ControllerActor", "UnitActor", "start_on_ray"]

_LOOKUP_S = 60.0  # a restarted unit's wait for the controller actor's answers


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

    def metrics_address(self) -> str | None:
        """The URL of this server's Prometheus endpoint (None: off)."""
        url = self._server.metrics_address
        return None if url is None else str(url)

    def ping(self) -> bool:
        return True

    def pid(self) -> int:
        """The actor's process id (fault tests kill it)."""
        return os.getpid()

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
    """A storage unit server (apply ``ray.remote`` to deploy). ``controller_name``: the
    controller actor's name, which a restarted unit looks up to come back (module docstring)."""

    def __init__(
        self,
        unit_id: int,
        capacity_bytes: int | None,
        host: str | None,
        keys: ServerKeys | None = None,
        grant_key: bytes | None = None,
        controller_name: str | None = None,
        metrics: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        bind_host = self._host(host)
        address, controller = f"tcp://{bind_host}:0", None
        if controller_name is not None and _reconstructed():
            found, old = _controller_of(controller_name, unit_id)
            controller = found
            if old.startswith(f"tcp://{bind_host}:"):
                address = old

        async def make(at: str) -> UnitServer:
            server = UnitServer(
                self._ctx,
                unit_id,
                at,
                capacity_bytes=capacity_bytes,
                keys=keys,
                grant_key=grant_key,
                controller=controller,
                **(metrics or {}),
            )
            server.start()
            return server

        try:
            self._server = self._io.run(make(address))
        except zmq.ZMQError:  # the old port was taken meanwhile: anywhere, then register
            self._server = self._io.run(make(f"tcp://{bind_host}:0"))


def _reconstructed() -> bool:
    """Whether this actor is a restart of one that died (Ray re-ran its constructor)."""
    import ray

    return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _controller_of(name: str, unit_id: int) -> tuple[str, str]:
    """(the controller's address, the address unit ``unit_id`` had), from the controller
    actor called ``name`` (bounded: a restart that cannot find it fails, and Ray retries)."""
    import ray

    ctl = ray.get_actor(name)
    answers: list[Any] = ray.get(
        [ctl.address.remote(), ctl.unit_address.remote(unit_id)], timeout=_LOOKUP_S
    )
    return str(answers[0]), str(answers[1])


class ControllerActor(_ServerActor):
    """The controller server (apply ``ray.remote`` to deploy)."""

    def __init__(
        self,
        unit_addresses: list[str],
        capacity_rows: int | None,
        host: str | None,
        spread_bytes: int = SPREAD_BYTES,
        keys: ServerKeys | None = None,
        grant_key: bytes | None = None,
        metrics: dict[str, Any] | None = None,
        replicas: int = 1,
    ) -> None:
        super().__init__()

        async def make() -> ControllerServer:
            server = ControllerServer(
                self._ctx,
                unit_addresses,
                f"tcp://{self._host(host)}:0",
                capacity_rows=capacity_rows,
                spread_bytes=spread_bytes,
                keys=keys,
                grant_key=grant_key,
                replicas=replicas,
                **(metrics or {}),
            )
            await server.start()
            return server

        self._server = self._io.run(make())

    def unit_address(self, unit_id: int) -> str:
        """Where storage unit ``unit_id`` listens, as this controller knows it."""
        return str(self._server.unit_addresses[unit_id])


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
    keys: ServerKeys | str | os.PathLike[str] | None = None,
    unit_max_restarts: int = 5,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    replicas: int = 1,
) -> TransferQueue:
    """Start controller and units as Ray actors and return a connected handle.

    Needs ``ray.init()`` first. Actors take no CPU slot (``num_cpus=0``: they are I/O bound)
    and are spread over nodes (``spread=False`` packs them). ``handle.close()`` kills them.
    ``spread_bytes``: a put spreads over one unit per that many bytes (0: over all units).
    ``actor_options``: Ray actor options for every server actor, over the defaults (e.g.
    ``{"resources": {"tq_node": 0.01}}`` to keep them on the nodes declaring ``tq_node``, or
    a ``scheduling_strategy``). ``start_timeout_s`` bounds the wait for the actors to start
    (a cluster without the resources they ask for never starts them).
    ``keys``: a key directory or :class:`ServerKeys` (default ``TRANSFERQUEUE_KEYS``), needed
    on a cluster of several nodes (see the module docstring). ``unit_max_restarts``: how
    many times Ray restarts each storage unit actor that dies (0: never).
    ``metrics_port``: Prometheus endpoints (:mod:`transferqueue.metrics`; None: none), as
    :class:`~transferqueue.service.LocalService` has them (0: free ports; P: the controller on
    P, unit i on P+1+i), on ``metrics_host`` of each actor's node (default loopback: scrape
    from that node, or widen it); their URLs are in ``stats()`` (``metrics_address``).
    ``replicas=2``: each row is written to two unit actors, on two nodes where the units
    spread over several (:mod:`transferqueue.placement`): an actor that dies loses no row
    whose other copy lives, and Ray restarts it empty (:mod:`transferqueue.replicas`).
    """
    if not isinstance(unit_max_restarts, int) or unit_max_restarts < 0:
        raise ValueError(f"unit_max_restarts must be an integer >= 0, got {unit_max_restarts!r}")
    try:
        import ray
    except ImportError:
        raise ImportError('the Ray deployment needs ray: pip install "asyncflow[ray]"') from None
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() before transferqueue.ray_deploy.start_on_ray()")
    check_metrics_port(metrics_port)
    check_replicas(replicas)
    if replicas > num_units:
        raise ValueError(f"replicas={replicas} needs at least as many units, got {num_units}")
    loaded = server_keys(keys)
    if host is None and loaded is None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) > 1:
            raise AuthError(
                f"this Ray cluster has {len(nodes)} nodes: TransferQueue's servers must listen "
                "beyond loopback, which needs keys. Run `transferqueue keygen DIR` and pass "
                "keys=DIR (give DIR, or TRANSFERQUEUE_KEYS=DIR, to the processes that connect)"
            )
        host = "127.0.0.1"  # one node: loopback, no keys needed
    own: ClientKeys | None = keys.as_client() if isinstance(keys, ServerKeys) else client_keys(keys)
    grant_key = new_grant_key()
    strategy = "SPREAD" if spread else "DEFAULT"
    # Any: Ray's actor-handle typing does not model .options(...).remote(...) chains.
    unit_cls: Any = ray.remote(num_cpus=0)(UnitActor)
    ctl_cls: Any = ray.remote(num_cpus=0)(ControllerActor)

    # named always: a restarted unit finds the controller by its name
    prefix = name_prefix or f"transferqueue-{uuid.uuid4().hex[:12]}"

    def opts(role: str) -> dict[str, Any]:
        return {
            "scheduling_strategy": strategy,
            "name": f"{prefix}-{role}",
            **(actor_options or {}),
        }

    def metrics(unit: int | None) -> dict[str, Any] | None:
        if metrics_port is None:
            return None
        port = 0 if metrics_port == 0 else metrics_port + (0 if unit is None else 1 + unit)
        return {"metrics_port": port, "metrics_host": metrics_host}

    units = [
        unit_cls.options(max_restarts=unit_max_restarts, **opts(f"unit{i}")).remote(
            i, unit_capacity_bytes, host, loaded, grant_key, f"{prefix}-controller", metrics(i)
        )
        for i in range(num_units)
    ]
    actors: list[Any] = list(units)
    try:
        unit_addrs = _started(ray, [u.address.remote() for u in units], start_timeout_s, "units")
        ctl = ctl_cls.options(**opts("controller")).remote(
            unit_addrs,
            capacity_rows,
            host,
            spread_bytes,
            loaded,
            grant_key,
            metrics(None),
            replicas,
        )
        actors.append(ctl)
        address = str(_started(ray, [ctl.address.remote()], start_timeout_s, "controller")[0])
        handle = connect(address, keys=own)
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
