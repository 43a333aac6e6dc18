"""The local-service deployment: a controller and N storage units as processes on one host.

``serve()`` (or ``transferqueue serve``) starts them, waits until each has bound its socket,
and returns the controller's address; any process connects with
``transferqueue.connect(address)``. Servers bind to loopback unless told otherwise; binding
other interfaces is an explicit choice (``host="0.0.0.0"``) that needs keys (``keys=DIR``,
see :mod:`transferqueue.auth`; without them the service refuses to start), and the address
handed to clients is then ``advertise_host`` (default: the address this host reaches others
from). The servers share a fresh grant key (:mod:`transferqueue.grants`), handed to them in
their environment.

Children stop on SIGTERM/SIGINT, and on their own when the parent that started them is gone.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from types import TracebackType
from typing import Any

from transferqueue.auth import ENV_GRANT_KEY, advertised_host, require_keys, server_keys
from transferqueue.errors import PeerGoneError
from transferqueue.grants import new_grant_key

__all__ = ["READY", "LocalService", "serve"]

READY = "TRANSFERQUEUE-READY "  # a server process prints this, then its bound address


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
    ) -> None:
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
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._rundir)
        try:
            for i in range(num_units):
                args = ["unit", "--unit-id", str(i), "--address", self._bind(transport, host, 0, i)]
                if unit_capacity_bytes is not None:
                    args += ["--capacity", str(unit_capacity_bytes)]
                self._spawn(args)
            units = [_advertised(self._wait(p, start_timeout_s), public) for p in self._procs]
            args = ["controller", "--units", ",".join(units)]
            args += ["--address", self._bind(transport, host, port, None)]
            if capacity_rows is not None:
                args += ["--capacity", str(capacity_rows)]
            if spread_bytes is not None:
                args += ["--spread-bytes", str(spread_bytes)]
            if max_lease_s is not None:
                args += ["--max-lease-s", str(max_lease_s)]
            ctl = self._spawn(args)
            self.address = _advertised(self._wait(ctl, start_timeout_s), public)
            self.unit_addresses = units
        except BaseException:
            self.close()
            raise

    def _bind(self, transport: str, host: str, port: int, unit: int | None) -> str:
        if transport == "ipc":
            assert self._rundir is not None
            name = "controller" if unit is None else f"unit{unit}"
            return f"ipc://{os.path.join(self._rundir, name)}"
        return f"tcp://{host}:{port}"

    def _spawn(self, args: list[str]) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            "-m",
            "transferqueue.server_main",
            *args,
            "--parent",
            str(os.getpid()),
            *(["--keys", self._keys] if self._keys is not None else []),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=self._env)
        self._procs.append(proc)
        return proc

    @staticmethod
    def _wait(proc: subprocess.Popen[str], timeout_s: float) -> str:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                line = proc.stdout.readline()
                if line.startswith(READY):
                    return line[len(READY) :].strip()
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
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

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


def _stop(procs: list[subprocess.Popen[str]], rundir: str | None) -> None:
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
