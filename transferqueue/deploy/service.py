"""The local-service deployment: a controller and N storage units as processes on one host.

``serve()`` (or ``transferqueue serve``) starts them, waits until each has bound its socket,
and returns the controller's address; any process connects with
``transferqueue.connect(address)``. Servers bind to loopback unless told otherwise; binding
other interfaces is an explicit choice (``host="0.0.0.0"``) that needs keys (``keys=DIR``,
see :mod:`transferqueue.wire.auth`; without them the service refuses to start), and the address
handed to clients is then ``advertise_host`` (default: the address this host reaches others
from). The servers share a fresh grant key (:mod:`transferqueue.wire.grants`), handed to them in
their environment.

Children stop on SIGTERM/SIGINT, and on their own when the parent that started them is gone.

A supervisor thread restarts a storage unit process that exits (at most ``max_restarts``
times per unit), on the address it had; the new process registers with the controller, which
places new rows on it again (the rows the old one held are lost: see
:mod:`transferqueue.controller.health`). Meanwhile the controller and the other units keep serving.
With ``state_dir`` it restarts the controller too, on its address: the new process recovers
the controller's state from the directory (:mod:`transferqueue.controller.journal`) and reconciles
it with the units (:mod:`transferqueue.controller.recovery`); clients reconnect by themselves.
Without it a dead controller ends the service.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from types import TracebackType
from typing import Any

from transferqueue.controller.health import ALLOCATION_S
from transferqueue.controller.journal import FSYNC_POLICIES
from transferqueue.controller.placement import check_replicas
from transferqueue.deploy.metrics import check_metrics_port
from transferqueue.errors import PeerGoneError
from transferqueue.wire.auth import ENV_GRANT_KEY, advertised_host, require_keys, server_keys
from transferqueue.wire.grants import new_grant_key
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Liveness
from transferqueue.wire.peers import check_max_connections

__all__ = ["READY", "LocalService", "serve"]

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
"""Default restarts of each storage unit process over a service's life."""
_SUPERVISE_S = 0.2  # how often the supervisor looks at its processes

# A server process prints this, then its bound address (and its metrics URL, if any).
READY = "TRANSFERQUEUE-READY "


def _advertised(address: str, host: str | None) -> str:
    """``address`` with its host replaced by ``host`` (the one clients use), if any."""
    if host is None or not address.startswith("tcp://"):
        return address
    port = address.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


class LocalService:
    """Controller and storage-unit processes; ``address`` is what clients connect to.

    ``capacity_rows`` and ``unit_capacity_bytes`` bound what is held (see
    :func:`transferqueue.start`); ``spread_bytes`` is the payload per unit a put spreads over
    (default 16 MiB; 0: every put over all units); ``transport`` is ``tcp`` or ``ipc``.
    ``keys``: a key directory (``transferqueue keygen``; default ``TRANSFERQUEUE_KEYS``),
    needed to listen beyond loopback. ``max_lease_s`` bounds the leases consumers may take.
    ``liveness``: heartbeats of the controller to its units (a dead unit's rows are lost
    within ``liveness.bound_s``); ``allocation_s``: the deadline of a put's allocation (rows
    not committed by then are reclaimed); ``max_restarts``: restarts of each unit process.
    ``metrics_port``: Prometheus endpoints (:mod:`transferqueue.deploy.metrics`; None: none): 0 puts
    each server on a free port, a port P the controller on P and unit i on P+1+i; they listen
    on ``metrics_host`` (default loopback). Their URLs: ``metrics_address`` (controller) and
    ``unit_metrics_addresses``, also in ``stats()`` (a restarted unit's on a free port may
    have moved: stats says where). ``replicas=2``: each row is written to two units, and a
    unit that dies loses no row that has its other copy alive (see
    :mod:`transferqueue.client.replicas`; needs two units). ``state_dir``: the controller keeps
    its state there and is restarted (at most ``max_restarts`` times) when it dies, on its
    address, with its rows, tasks and leases; ``fsync`` (``never``, ``batch``, ``always``)
    says what of it a host crash keeps (see :mod:`transferqueue.controller.journal`).
    ``max_connections``: client connections each server admits (a client handle holds one to
    each server); the next are refused with :class:`~transferqueue.errors.TooManyConnectionsError`
    until one closes. Default: each server's open-file limit (raised to its hard limit) less
    a reserve (:mod:`transferqueue.wire.peers`).
    """

    def __init__(
        self,
        num_units: int = 2,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transport: str = "tcp",
        capacity_rows: int | None = None,
        unit_capacity_bytes: int | None = None,
        spread_bytes: int | None = None,
        advertise_host: str | None = None,
        start_timeout_s: float = 120.0,
        keys: str | os.PathLike[str] | None = None,
        max_lease_s: float | None = None,
        liveness: Liveness = DEFAULT_LIVENESS,
        allocation_s: float = ALLOCATION_S,
        max_restarts: int = MAX_RESTARTS,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        replicas: int = 1,
        state_dir: str | os.PathLike[str] | None = None,
        fsync: str = "batch",
        max_connections: int | None = None,
    ) -> None:
        check_metrics_port(metrics_port)
        check_max_connections(max_connections)
        limit = [] if max_connections is None else ["--max-connections", str(max_connections)]
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        check_replicas(replicas)
        if replicas > num_units:
            raise ValueError(
                f"replicas={replicas} needs at least as many storage units, got "
                f"num_units={num_units}"
            )
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {max_restarts!r}")
        self._max_restarts = max_restarts
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        if transport not in ("tcp", "ipc"):
            raise ValueError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
        loaded = server_keys(keys)  # (checks the files now, not in every child)
        if transport == "tcp":
            require_keys(host, loaded)
        public = advertised_host(host, advertise_host) if transport == "tcp" else None
        self._env = dict(os.environ, **{ENV_GRANT_KEY: new_grant_key().hex()})
        self._keys = None if keys is None else os.fspath(keys)
        self._procs: list[subprocess.Popen[str]] = []
        self._rundir = tempfile.mkdtemp(prefix="transferqueue-") if transport == "ipc" else None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._finalizer = weakref.finalize(
            self, _stop, self._procs, self._rundir, self._stopping, self._threads
        )
        self.metrics_address: str | None = None
        self.unit_metrics_addresses: list[str | None] = []
        try:
            unit_args = []
            for i in range(num_units):
                args = ["unit", "--unit-id", str(i), *limit]
                if unit_capacity_bytes is not None:
                    args += ["--capacity", str(unit_capacity_bytes)]
                if metrics_port is not None:
                    port_i = 0 if metrics_port == 0 else metrics_port + 1 + i
                    args += ["--metrics-port", str(port_i), "--metrics-host", metrics_host]
                unit_args.append(args)
                self._spawn([*args, "--address", self._bind(transport, host, 0, i)])
            started = [self._wait_ready(p, start_timeout_s) for p in self._procs]
            bound = [address for address, _ in started]
            self.unit_metrics_addresses = [url for _, url in started]
            units = [_advertised(a, public) for a in bound]
            args = ["--heartbeat-s", str(liveness.heartbeat_s)]
            args += ["--dead-after-s", str(liveness.dead_after_s)]
            args += ["--holder-dead-after-s", str(liveness.holder_dead_after_s)]
            args += ["--holder-grace-s", str(liveness.holder_grace_s)]
            args += ["--allocation-s", str(allocation_s)]
            args += ["--replicas", str(replicas), *limit]
            if state_dir is not None:
                args += ["--state-dir", os.path.abspath(state_dir), "--fsync", fsync]
            if capacity_rows is not None:
                args += ["--capacity", str(capacity_rows)]
            if spread_bytes is not None:
                args += ["--spread-bytes", str(spread_bytes)]
            if max_lease_s is not None:
                args += ["--max-lease-s", str(max_lease_s)]
            if metrics_port is not None:
                args += ["--metrics-port", str(metrics_port), "--metrics-host", metrics_host]
            first = ["--address", self._bind(transport, host, port, None)]
            ctl = self._spawn(["controller", "--units", ",".join(units), *args, *first])
            ctl_address, self.metrics_address = self._wait_ready(ctl, start_timeout_s)
            self.address = _advertised(ctl_address, public)
            self.unit_addresses = units
            self.restarts = [0] * num_units  # restarts of each unit process so far
            self.controller_restarts = [0]  # (a list: the supervisor counts in it)
            restart = None if state_dir is None else [*args, "--address", ctl_address]
            self._controller_restartable = restart is not None
            # (the thread holds no reference to self: the finalizer runs when self goes)
            spawn = _Spawner(self._spawn_args, self._procs, self._env)
            thread = threading.Thread(
                target=_supervise,
                args=(spawn, unit_args, bound, self.address, self.restarts, max_restarts),
                kwargs={
                    "stopping": self._stopping,
                    "start_timeout_s": start_timeout_s,
                    "controller_restart": _ControllerRestart(
                        restart, units, public, self.controller_restarts
                    ),
                },
                name="transferqueue-supervisor",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()
        except BaseException:
            self.close()
            raise

    def _bind(self, transport: str, host: str, port: int, unit: int | None) -> str:
        if transport == "ipc":
            assert self._rundir is not None
            name = "controller" if unit is None else f"unit{unit}"
            return f"ipc://{os.path.join(self._rundir, name)}"
        return f"tcp://{host}:{port}"

    def _spawn_args(self, args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "transferqueue.deploy.server_main",
            *args,
            "--parent",
            str(os.getpid()),
            *(["--keys", self._keys] if self._keys is not None else []),
        ]

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        cmd = self._spawn_args(args)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self._env)
        self._procs.append(proc)
        return proc

    @staticmethod
    def _wait(proc: subprocess.Popen[str], timeout_s: float) -> str:
        return LocalService._wait_ready(proc, timeout_s)[0]

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, str | None]:
        """The server's bound address and its metrics URL (None: no endpoint), once ready."""
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        # (poll, not select: a process of many clients holds descriptors past select's 1,024)
        poller = select.poll()
        poller.register(proc.stdout, select.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(100):
                line = proc.stdout.readline()
                if line.startswith(READY):
                    address, *metrics = line[len(READY) :].split()
                    return address, (metrics[0] if metrics else None)
                if not line and proc.poll() is not None:
                    break
        if proc.poll() is not None:
            raise PeerGoneError(
                f"a TransferQueue server exited during start-up (exit code {proc.returncode}); "
                "its error is printed above"
            )
        raise PeerGoneError(f"a TransferQueue server did not start within {timeout_s} s")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def alive(self) -> bool:
        """Whether the service serves: its controller runs and so does a unit (or one that
        exited will be restarted)."""
        restarts = getattr(self, "controller_restarts", [0])[0]
        restartable = getattr(self, "_controller_restartable", False)
        if not self._procs:
            return False
        if self._procs[-1].poll() is not None and not (
            restartable and restarts < self._max_restarts
        ):
            return False
        units = self._procs[:-1]
        left = [r < self._max_restarts for r in getattr(self, "restarts", [])]
        return any(p.poll() is None or ok for p, ok in zip(units, left, strict=False))

    def close(self) -> None:
        """Stop every server process (SIGTERM, then SIGKILL after a grace period)."""
        self._finalizer()

    def __enter__(self) -> LocalService:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _Spawner:
    """Starts a replacement unit process (the supervisor's view of the service)."""

    def __init__(
        self,
        cmd: Any,
        procs: list[subprocess.Popen[str]],
        env: dict[str, str],
    ) -> None:
        self.cmd = cmd
        self.procs = procs
        self.env = env

    def replace(self, unit: int, args: list[str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(self.cmd(args), stdout=subprocess.PIPE, text=True, env=self.env)
        old = self.procs[unit]
        self.procs[unit] = proc
        if old.stdout is not None:
            old.stdout.close()
        return proc


class _ControllerRestart:
    """How the supervisor restarts the controller (``args``: its options less ``--units``;
    None: it is not restarted), the units' addresses as clients see them (kept up to date:
    a unit restarted on a new port), and its restarts so far."""

    def __init__(
        self,
        args: list[str] | None,
        units: list[str],
        public: str | None,
        restarts: list[int],
    ) -> None:
        self.args = args
        self.units = units
        self.public = public
        self.restarts = restarts

    def command(self) -> list[str]:
        assert self.args is not None
        return ["controller", "--units", ",".join(self.units), *self.args]


def _restart_controller(
    spawn: _Spawner, ctl: _ControllerRestart, max_restarts: int, start_timeout_s: float
) -> None:
    """The controller exited: start it again on its address; it recovers its state."""
    proc = spawn.procs[-1]
    if ctl.args is None or proc.poll() is None or ctl.restarts[0] >= max_restarts:
        return
    ctl.restarts[0] += 1
    log.warning(
        "the controller exited (code %s); restart %d of %d from its state_dir",
        proc.returncode,
        ctl.restarts[0],
        max_restarts,
    )
    new = spawn.replace(len(spawn.procs) - 1, ctl.command())
    try:
        LocalService._wait(new, start_timeout_s)
    except PeerGoneError as e:
        log.warning("the controller did not restart: %s", e)
        if new.poll() is None:
            new.kill()
            new.wait(timeout=5)


def _supervise(
    spawn: _Spawner,
    unit_args: list[list[str]],
    bound: list[str],
    controller: str,
    restarts: list[int],
    max_restarts: int,
    *,
    stopping: threading.Event,
    start_timeout_s: float,
    controller_restart: _ControllerRestart | None = None,
) -> None:
    """Restart unit processes that exit, on the address each had (a new one if that cannot
    be bound), at most ``max_restarts`` times each; each registers with the controller.
    With ``controller_restart``, a controller that exits is restarted too, after the units
    (a restarted controller waits for every unit to answer before it serves)."""
    while not stopping.wait(_SUPERVISE_S):
        for unit, args in enumerate(unit_args):
            proc = spawn.procs[unit]
            if proc.poll() is None or restarts[unit] >= max_restarts or stopping.is_set():
                continue
            restarts[unit] += 1
            log.warning(
                "storage unit %d exited (code %s); restart %d of %d",
                unit,
                proc.returncode,
                restarts[unit],
                max_restarts,
            )
            for address in (bound[unit], _any_port(bound[unit])):
                new = spawn.replace(unit, [*args, "--address", address, "--controller", controller])
                try:
                    now = LocalService._wait(new, start_timeout_s)
                    bound[unit] = now
                    if controller_restart is not None:
                        controller_restart.units[unit] = _advertised(now, controller_restart.public)
                    break
                except PeerGoneError as e:
                    log.warning("storage unit %d did not restart on %s: %s", unit, address, e)
                    if new.poll() is None:
                        new.kill()
                        new.wait(timeout=5)
        if controller_restart is not None and not stopping.is_set():
            _restart_controller(spawn, controller_restart, max_restarts, start_timeout_s)


def _any_port(address: str) -> str:
    """``address`` on any free port (tcp), or itself (ipc)."""
    if not address.startswith("tcp://"):
        return address
    return address.rsplit(":", 1)[0] + ":0"


def _stop(
    procs: list[subprocess.Popen[str]],
    rundir: str | None,
    stopping: threading.Event | None = None,
    threads: list[threading.Thread] | None = None,
) -> None:
    if stopping is not None:
        stopping.set()
    for t in threads or []:
        t.join(timeout=30)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
        if p.stdout is not None:
            p.stdout.close()
    if rundir is not None:
        shutil.rmtree(rundir, ignore_errors=True)


def serve(num_units: int = 2, **kwargs: Any) -> LocalService:
    """Start a local TransferQueue service; see :class:`LocalService` for the options."""
    return LocalService(num_units, **kwargs)
