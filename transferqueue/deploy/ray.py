"""The Ray deployment: the controller and the storage units as Ray actors.

Ray does placement and lifecycle; data never goes through Ray's object store: every actor
runs the same ZeroMQ server as ``transferqueue serve`` and clients (any process, any Ray task
or actor) connect to it with :func:`transferqueue.connect`. The actor classes are plain
classes; ``ray.remote`` is applied here, at deployment time, so nothing else imports Ray.

    import ray, transferqueue.deploy.ray as tqr
    ray.init()
    tq = tqr.start_on_ray(num_units=4)         # units spread over the cluster's nodes
    client = tq.client()                        # in the driver
    address = tq.address                        # pass it to tasks: transferqueue.connect(address)

Across nodes the servers bind to the IP Ray uses for their node and speak CURVE, with the
keys of ``keys=DIR`` (``transferqueue keygen``; or ``TRANSFERQUEUE_KEYS``): the same mechanism
as ``transferqueue serve`` (:mod:`transferqueue.wire.auth`); tasks connect with
``transferqueue.connect(address, keys=DIR)``. Without keys the servers bind to 127.0.0.1, which
only a one-node cluster can use: on several nodes :func:`start_on_ray` asks for keys. ``host``
chooses the interface (beyond loopback it needs keys too). The servers share a fresh grant key
(:mod:`transferqueue.wire.grants`), given to the actors.

A storage unit whose actor dies is restarted by Ray (``unit_max_restarts``, default 5), as
the supervisor of ``transferqueue serve`` restarts a unit process: the dead incarnation's rows
are lost (the controller reports them, :mod:`transferqueue.controller.health`); the new one asks the
controller actor (found by name) where the unit listened, binds there again when it can (so
that connected clients reach it without reconnecting), and registers, after which it takes new
rows.

The controller actor is restarted by Ray too when it has a ``state_dir`` (``start_on_ray(
state_dir=DIR, fsync="batch", controller_max_restarts=5)``), as ``transferqueue serve
--state-dir`` restarts its controller process: the new incarnation recovers the state from
the directory (:mod:`transferqueue.controller.journal`), asks each unit actor (by name) where it
listens now, reconciles with the units (:mod:`transferqueue.controller.recovery`), and binds the
address the dead one had (kept in ``DIR/address``), so clients connected by address reconnect by
themselves. Should that port be taken for ``REBIND_S``, it listens on a free one and says so
in its log; ``ray.get_actor(f"{name_prefix}-controller").address.remote()`` gives the new
address, which clients must then connect to. Ray may restart an actor on another node: the
directory must be reachable there (a shared filesystem) and the old address's host is then
not this node's, so pin the controller to one node (``actor_options`` with a node's custom
resource, or a ``NodeAffinitySchedulingStrategy``) unless clients re-resolve the address.
Without ``state_dir`` the controller is not restarted (a restarted one would start empty and
forget every row): its metadata lives in its process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

import zmq.asyncio

from transferqueue.client.handle import TransferQueue
from transferqueue.controller.core import SPREAD_BYTES
from transferqueue.controller.journal import FSYNC_POLICIES, JournalSettings
from transferqueue.controller.placement import check_replicas
from transferqueue.deploy.connect import connect
from transferqueue.deploy.metrics import check_metrics_port
from transferqueue.deploy.server import ControllerServer, UnitServer
from transferqueue.errors import AuthError
from transferqueue.loop import LoopThread
from transferqueue.sched import batch_process, zmq_in_batch
from transferqueue.storage.malloc import keep_freed_memory
from transferqueue.wire.auth import ClientKeys, ServerKeys, client_keys, server_keys
from transferqueue.wire.grants import new_grant_key
from transferqueue.wire.liveness import RIDE_THROUGH_S
from transferqueue.wire.peers import check_max_connections

__all__ = [
    "ControllerActor",
    "RayStart",
    "UnitActor",
    "controller_address",
    "launch_on_ray",
    "start_on_ray",
]

log = logging.getLogger(__name__)

_LOOKUP_S = 60.0  # a restarted unit's wait for the controller actor's answers
_UNITS_S = 10.0  # a restarted controller's wait for the unit actors' addresses
REBIND_S = 30.0
"""How long a restarted controller actor waits for its old port to be free."""
CONTROLLER_MAX_RESTARTS = 5
"""Default restarts of a controller actor with a ``state_dir``."""
_ADDRESS_FILE = "address"  # in state_dir: where the controller listened last
_UNITS_FILE = "units"  # in state_dir: where the units listened at the first start


class _ServerActor:
    """Runs one server on a private event-loop thread inside the actor process."""

    def __init__(self, batch_sched: bool = False) -> None:
        keep_freed_memory()  # the actor's worker process serves only this server
        if batch_sched:  # (before the loop thread starts: it inherits the class)
            batch_process()
        self._io = LoopThread("transferqueue-actor")
        self._ctx = zmq.asyncio.Context()
        zmq_in_batch(self._ctx)
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
        *,
        batch_sched: bool = False,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(batch_sched)
        bind_host = self._host(host)
        address, controller = f"tcp://{bind_host}:0", None
        if controller_name is not None and _reconstructed():
            found, old = _controller_of_or_exit(controller_name, unit_id)
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
                max_connections=max_connections,
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


def _controller_of(name: str, unit_id: int, bound_s: float = _LOOKUP_S) -> tuple[str, str]:
    """(the controller's address, the address unit ``unit_id`` had), from the controller
    actor called ``name``, asked again while that actor restarts too (Ray answers
    ``ActorUnavailableError`` at once then), for at most ``bound_s``."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + bound_s
    while True:
        try:
            ctl = ray.get_actor(name)
            answers: list[Any] = ray.get(
                [ctl.address.remote(), ctl.unit_address.remote(unit_id)],
                timeout=max(0.1, deadline - time.monotonic()),
            )
            return str(answers[0]), str(answers[1])
        except (ActorUnavailableError, ValueError) as e:  # (restarting, or not named yet)
            if time.monotonic() >= deadline:
                raise GetTimeoutError(
                    f"the controller actor {name!r} did not answer within {bound_s:g} s: {e}"
                ) from e
            time.sleep(0.5)


def _controller_of_or_exit(name: str, unit_id: int) -> tuple[str, str]:
    """:func:`_controller_of`; one that fails ends this process, so that Ray restarts the
    unit again (``unit_max_restarts``): an error raised by an actor's constructor would end
    the actor for good."""
    try:
        return _controller_of(name, unit_id)
    except Exception:
        log.exception("restarted unit %d could not find its controller: its process exits", unit_id)
        logging.shutdown()
        os._exit(1)


class ControllerActor(_ServerActor):
    """The controller server (apply ``ray.remote`` to deploy). With ``state_dir`` its state
    is journaled there and a restart by Ray recovers it (module docstring); ``unit_names``:
    the unit actors' names, which a restarted controller asks where they listen now.
    ``unit_addresses=None``: the controller starts beside its units and asks each unit actor
    (by name) where it listens, waiting at most ``start_timeout_s`` for them to start."""

    def __init__(
        self,
        unit_addresses: list[str] | None,
        capacity_rows: int | None,
        host: str | None,
        spread_bytes: int = SPREAD_BYTES,
        keys: ServerKeys | None = None,
        grant_key: bytes | None = None,
        metrics: dict[str, Any] | None = None,
        replicas: int = 1,
        state_dir: str | None = None,
        fsync: str = "batch",
        unit_names: list[str] | None = None,
        start_timeout_s: float = 300.0,
        *,
        batch_sched: bool = False,
        max_connections: int | None = None,
    ) -> None:
        super().__init__(batch_sched)
        bind_host = self._host(host)
        address = f"tcp://{bind_host}:0"
        extra: dict[str, Any] = {}
        restarted = state_dir is not None and _reconstructed()
        known = None if unit_addresses is None else list(unit_addresses)
        if known is None and restarted:
            assert state_dir is not None
            known = _saved_units(state_dir)
        if known is None:  # first start beside the units: they say where they listen
            known = _units_started(unit_names or [], start_timeout_s)
            if state_dir is not None:
                _save_units(state_dir, known)
        units = known
        if state_dir is not None:
            extra = {"state_dir": state_dir, "journal": JournalSettings(fsync=fsync)}
            if restarted:
                units = _units_now(unit_names or [], units)
                address = _old_address(state_dir, bind_host) or address

        async def make() -> ControllerServer:
            return ControllerServer(
                self._ctx,
                units,
                address,
                capacity_rows=capacity_rows,
                spread_bytes=spread_bytes,
                keys=keys,
                grant_key=grant_key,
                replicas=replicas,
                max_connections=max_connections,
                **(metrics or {}),
                **extra,
            )

        self._server = self._io.run(make())  # (recovered and bound: not yet serving)
        if state_dir is not None:
            _save_address(state_dir, str(self._server.address))
        if restarted:
            # Serve in the background: start() waits for every unit to answer, and a unit
            # actor restarted meanwhile waits in its constructor for this actor's answers
            # (address, unit_address), which Ray gives only once this constructor returns.
            self._starting = self._io.submit(_start_or_exit(self._server))
        else:
            self._io.run(self._server.start())

    def unit_address(self, unit_id: int) -> str:
        """Where storage unit ``unit_id`` listens, as this controller knows it."""
        return str(self._server.unit_addresses[unit_id])


async def _start_or_exit(server: ControllerServer) -> None:
    """Start a restarted controller (a unit that does not answer is served without, see
    ``ControllerServer.start``); one that cannot start ends its process, and Ray restarts it
    again (``controller_max_restarts``)."""
    try:
        await server.start()
    except Exception:
        log.exception("the restarted controller could not start: its process exits")
        logging.shutdown()
        os._exit(1)


def _units_now(names: list[str], known: list[str]) -> list[str]:
    """Where each unit actor listens now (one restarted while the controller was down may
    have moved); ``known`` for those that do not answer within ``_UNITS_S`` (restarting:
    they register with the controller once it serves)."""
    import ray

    if len(names) != len(known):
        return known
    refs: list[Any] = []
    for name in names:
        try:
            refs.append(ray.get_actor(name).address.remote())
        except ValueError:  # (no such actor any more: dead for good)
            refs.append(None)
    asked = [r for r in refs if r is not None]
    if asked:
        ray.wait(asked, num_returns=len(asked), timeout=_UNITS_S)
    out = []
    for ref, old in zip(refs, known, strict=True):
        try:
            out.append(old if ref is None else str(ray.get(ref, timeout=0)))
        except Exception:  # not answered (restarting) or dead: keep what was known
            out.append(old)
    return out


def _units_started(names: list[str], bound_s: float) -> list[str]:
    """Where each unit actor listens, once every one has started (their names may be
    registered a moment after this controller starts); at most ``bound_s``."""
    import ray
    from ray.exceptions import GetTimeoutError

    if not names:
        raise ValueError("a controller started without unit addresses needs the units' names")
    deadline = time.monotonic() + bound_s
    actors: list[Any] = []
    for name in names:
        while True:
            try:
                actors.append(ray.get_actor(name))
                break
            except ValueError as e:  # (not named yet)
                if time.monotonic() >= deadline:
                    raise GetTimeoutError(f"no unit actor {name!r} within {bound_s:g} s") from e
                time.sleep(0.05)
    try:
        got = ray.get(
            [a.address.remote() for a in actors], timeout=max(0.1, deadline - time.monotonic())
        )
    except GetTimeoutError:
        raise GetTimeoutError(
            f"the TransferQueue units {names} did not start within {bound_s:g} s"
        ) from None
    return [str(a) for a in got]


def _save_units(state_dir: str, addresses: list[str]) -> None:
    """Record where the units listened at the first start (a restarted controller started
    without unit addresses begins from these, then asks the units)."""
    os.makedirs(state_dir, exist_ok=True)  # (before the controller's journal makes it)
    tmp = os.path.join(state_dir, _UNITS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(addresses, f)
    os.replace(tmp, os.path.join(state_dir, _UNITS_FILE))


def _saved_units(state_dir: str) -> list[str] | None:
    try:
        with open(os.path.join(state_dir, _UNITS_FILE)) as f:
            return [str(a) for a in json.load(f)]
    except FileNotFoundError:
        return None


def _old_address(state_dir: str, host: str) -> str | None:
    """The address the dead incarnation listened on, once its port can be bound again
    (bounded by ``REBIND_S``); None: none recorded, another host's, or the port stays taken
    (then the restarted controller listens on a free port)."""
    try:
        with open(os.path.join(state_dir, _ADDRESS_FILE)) as f:
            old = f.read().strip()
    except FileNotFoundError:
        return None
    if not old.startswith(f"tcp://{host}:"):
        log.warning("the controller listened on %s, not on this node (%s): new port", old, host)
        return None
    port = int(old.rsplit(":", 1)[1])
    deadline = time.monotonic() + REBIND_S
    while not _port_free(host, port):
        if time.monotonic() > deadline:
            log.warning(
                "the controller's old address %s stayed taken for %s s: it listens on a new "
                "port; clients connected to the old one must connect to the new one "
                "(ControllerActor.address)",
                old,
                REBIND_S,
            )
            return None
        time.sleep(0.2)
    return old


def _port_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` (as ZeroMQ binds: SO_REUSEADDR,
    so the dead incarnation's connections in TIME_WAIT do not count)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def _save_address(state_dir: str, address: str) -> None:
    """Record where the controller listens (a rename: a kill leaves the old or the new)."""
    tmp = os.path.join(state_dir, _ADDRESS_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(address)
    os.replace(tmp, os.path.join(state_dir, _ADDRESS_FILE))


def start_on_ray(num_units: int = 2, **options: Any) -> TransferQueue:
    """Start controller and units as Ray actors and return a connected handle: the servers
    of :func:`launch_on_ray` (every argument is documented there), once they serve."""
    return launch_on_ray(num_units, **options).handle()


class RayStart:
    """TransferQueue servers that :func:`launch_on_ray` started and that may still be
    starting: their actors and the controller's name at once (a process can find the
    controller's address by that name, :func:`controller_address`), the connected handle
    from :meth:`handle`."""

    def __init__(
        self,
        controller_name: str,
        actors: list[Any],
        keys: ClientKeys | None,
        ride_through_s: float,
        start_timeout_s: float,
    ) -> None:
        self.controller_name = controller_name
        self.actors = actors
        self._keys = keys
        self._ride_through_s = ride_through_s
        self._start_timeout_s = start_timeout_s

    def handle(self) -> TransferQueue:
        """Wait for the servers (at most ``start_timeout_s``) and connect; ``close()`` on the
        handle kills the actors. A server that fails to start kills them all and raises."""
        import ray

        try:
            ctl = self.actors[-1]
            address = _started(ray, [ctl.address.remote()], self._start_timeout_s, "servers")
            handle = connect(str(address[0]), keys=self._keys, ride_through_s=self._ride_through_s)
        except BaseException:
            self.kill()
            raise
        handle.mode = "ray"
        handle.add_closer(self.kill)
        return handle

    def kill(self) -> None:
        """End the servers' actors (their rows are lost)."""
        _kill(self.actors)


def controller_address(name: str, bound_s: float) -> str:
    """Where the controller actor called ``name`` listens, once it serves (it may still be
    starting, or not yet be named); at most ``bound_s``."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError

    deadline = time.monotonic() + bound_s
    while True:
        try:
            ctl = ray.get_actor(name)
            return str(ray.get(ctl.address.remote(), timeout=max(0.1, deadline - time.monotonic())))
        except (ActorUnavailableError, ValueError, GetTimeoutError) as e:  # (restarting, unnamed)
            if time.monotonic() >= deadline:
                raise GetTimeoutError(
                    f"the TransferQueue controller {name!r} did not answer within {bound_s:g} s"
                ) from e
            time.sleep(0.05)


def launch_on_ray(
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
    state_dir: str | os.PathLike[str] | None = None,
    fsync: str = "batch",
    controller_max_restarts: int | None = None,
    ride_through_s: float | None = None,
    batch_sched: bool = False,
    max_connections: int | None = None,
    controller_options: dict[str, Any] | None = None,
) -> RayStart:
    """Start controller and units as Ray actors, without waiting for them: the returned
    :class:`RayStart` gives the connected handle once they serve (:func:`start_on_ray` is
    both at once). The controller starts beside the units and asks them where they listen.

    Needs ``ray.init()`` first. Actors take no CPU slot (``num_cpus=0``: they are I/O bound)
    and are spread over nodes (``spread=False`` packs them). ``handle.close()`` kills them.
    ``spread_bytes``: a put spreads over one unit per that many bytes (0: over all units).
    ``actor_options``: Ray actor options for every server actor, over the defaults (e.g.
    ``{"resources": {"tq_node": 0.01}}`` to keep them on the nodes declaring ``tq_node``, or
    a ``scheduling_strategy``); ``controller_options`` replace them for the controller (e.g.
    a ``NodeAffinitySchedulingStrategy`` to the driver's node, whose loss ends the job anyway:
    then no other node's loss takes the controller). ``start_timeout_s`` bounds the wait for
    the actors to start (a cluster without the resources they ask for never starts them).
    ``keys``: a key directory or :class:`ServerKeys` (default ``TRANSFERQUEUE_KEYS``), needed
    on a cluster of several nodes (see the module docstring). ``unit_max_restarts``: how
    many times Ray restarts each storage unit actor that dies (0: never).
    ``metrics_port``: Prometheus endpoints (:mod:`transferqueue.deploy.metrics`; None: none), as
    :class:`~transferqueue.deploy.service.LocalService` has them (0: free ports; P: the controller
    on P, unit i on P+1+i), on ``metrics_host`` of each actor's node (default loopback: scrape
    from that node, or widen it); their URLs are in ``stats()`` (``metrics_address``).
    ``replicas=2``: each row is written to two unit actors, on two nodes where the units
    spread over several (:mod:`transferqueue.controller.placement`): an actor that dies loses no row
    whose other copy lives, and Ray restarts it empty (:mod:`transferqueue.client.replicas`).
    ``state_dir``: the controller keeps its state there (``fsync``: ``never``, ``batch``,
    ``always``, see :mod:`transferqueue.controller.journal`) and Ray restarts its actor when it
    dies, at most ``controller_max_restarts`` times (default 5 with ``state_dir``, 0 without: a
    controller restarted without its state would forget every row), on the same address, with
    its rows, tasks and leases (module docstring: the directory must be reachable from the
    node Ray restarts it on). ``ride_through_s``: the handle's (see
    :func:`~transferqueue.deploy.connect.connect`; None: ``RIDE_THROUGH_S``, 60 s, with
    ``state_dir``, else 0). ``batch_sched``: every thread of the server actors in Linux's
    ``SCHED_BATCH`` (:mod:`transferqueue.sched`): their wake-ups do not preempt the compute
    of other processes on the node (a deployment whose stage hosts share the servers' cores).
    ``max_connections``: client connections each server actor admits (default: its process's
    open-file limit less a reserve; :mod:`transferqueue.wire.peers`).
    """
    if not isinstance(unit_max_restarts, int) or unit_max_restarts < 0:
        raise ValueError(f"unit_max_restarts must be an integer >= 0, got {unit_max_restarts!r}")
    if fsync not in FSYNC_POLICIES:
        raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
    if controller_max_restarts is None:
        controller_max_restarts = 0 if state_dir is None else CONTROLLER_MAX_RESTARTS
    if not isinstance(controller_max_restarts, int) or controller_max_restarts < 0:
        raise ValueError(
            f"controller_max_restarts must be an integer >= 0, got {controller_max_restarts!r}"
        )
    if controller_max_restarts > 0 and state_dir is None:
        raise ValueError(
            f"controller_max_restarts={controller_max_restarts} needs state_dir: a controller "
            "restarted without its state would start empty and forget every row; pass "
            "state_dir=DIR (a directory the controller's node can reach) or "
            "controller_max_restarts=0"
        )
    ctl_state = None if state_dir is None else os.path.abspath(state_dir)
    try:
        import ray
    except ImportError:
        raise ImportError('the Ray deployment needs ray: pip install "asyncflow[ray]"') from None
    if not ray.is_initialized():
        raise RuntimeError("call ray.init() before transferqueue.deploy.ray.start_on_ray()")
    check_metrics_port(metrics_port)
    check_max_connections(max_connections)
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
        given = controller_options if role == "controller" and controller_options else None
        return {
            "scheduling_strategy": strategy,
            "name": f"{prefix}-{role}",
            **(given if given is not None else actor_options or {}),
        }

    def metrics(unit: int | None) -> dict[str, Any] | None:
        if metrics_port is None:
            return None
        port = 0 if metrics_port == 0 else metrics_port + (0 if unit is None else 1 + unit)
        return {"metrics_port": port, "metrics_host": metrics_host}

    units = [
        unit_cls.options(max_restarts=unit_max_restarts, **opts(f"unit{i}")).remote(
            i,
            unit_capacity_bytes,
            host,
            loaded,
            grant_key,
            f"{prefix}-controller",
            metrics(i),
            batch_sched=batch_sched,
            max_connections=max_connections,
        )
        for i in range(num_units)
    ]
    actors: list[Any] = list(units)
    try:
        ctl = ctl_cls.options(max_restarts=controller_max_restarts, **opts("controller")).remote(
            None,  # it asks the units, by name: it starts beside them
            capacity_rows,
            host,
            spread_bytes,
            loaded,
            grant_key,
            metrics(None),
            replicas,
            ctl_state,
            fsync,
            [f"{prefix}-unit{i}" for i in range(num_units)],
            start_timeout_s,
            batch_sched=batch_sched,
            max_connections=max_connections,
        )
        actors.append(ctl)  # (the last: RayStart asks it)
    except BaseException:
        _kill(actors)
        raise
    if ride_through_s is None:  # (the handle's calls wait for a restarted controller)
        ride_through_s = RIDE_THROUGH_S if state_dir is not None else 0.0
    return RayStart(f"{prefix}-controller", actors, own, ride_through_s, start_timeout_s)


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

    if not ray.is_initialized():
        # This driver left Ray already (its exit hook ran first, a handle closed at exit):
        # Ray ends the actors it owned, and a call here would connect again mid-teardown.
        return
    for a in actors:
        with contextlib.suppress(Exception):  # the actor may be gone already
            ray.get(a.shutdown.remote(), timeout=10)
        with contextlib.suppress(Exception):
            ray.kill(a)
