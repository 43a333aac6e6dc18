"""Entry point of one TransferQueue server process (started by :class:`LocalService`).

    python -m transferqueue.deploy.server_main unit --unit-id 0 --address tcp://127.0.0.1:0 --parent
    PID python -m transferqueue.deploy.server_main controller --units A,B --address ADDR --parent
    PID

A unit restarted by its supervisor gets ``--controller ADDR`` and registers there. Each server
admits at most ``--max-connections`` client connections (default: its open-file limit, raised
to the hard limit first, less a reserve; see :mod:`transferqueue.wire.peers`). A
controller with ``--state-dir DIR`` keeps its state there and recovers it when restarted
(``--fsync never|batch|always``: see :mod:`transferqueue.controller.journal`).

It prints ``READY <bound address>`` once serving (with ``--metrics-port``, which serves
Prometheus metrics, see :mod:`transferqueue.deploy.metrics`: ``READY <address> <metrics url>``),
stops on SIGTERM/SIGINT, and stops on its own when its parent process is gone. Keys come
from ``--keys DIR`` (or the environment), the grant key shared with the other servers from
the environment (see :mod:`transferqueue.wire.auth`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import zmq.asyncio

from transferqueue.aio import wait_event
from transferqueue.controller.health import ALLOCATION_S
from transferqueue.controller.journal import FSYNC_POLICIES, JournalSettings
from transferqueue.deploy.server import ControllerServer, UnitServer
from transferqueue.deploy.service import READY
from transferqueue.limits import MAX_LEASE_S
from transferqueue.storage.malloc import keep_freed_memory
from transferqueue.wire.auth import ServerKeys, grant_key_from_env, server_keys
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Liveness
from transferqueue.wire.peers import max_connections_for, raise_open_file_limit

_PARENT_POLL_S = 1.0


async def _serve_until_stopped(server: Any, parent: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # (one line: the parent reads it with select, which sees no second buffered line)
    metrics = "" if server.metrics_address is None else " " + server.metrics_address
    print(READY + server.address + metrics, flush=True)
    while not stop.is_set():
        await wait_event(stop, _PARENT_POLL_S)
        if os.getppid() != parent:  # orphaned: whoever started us is gone
            break
    await server.close()


async def _run_unit(
    unit_id: int,
    address: str,
    capacity_bytes: int | None,
    parent: int,
    keys: ServerKeys | None,
    controller: str | None,
    common: dict[str, Any],
) -> None:
    ctx = zmq.asyncio.Context()
    server = UnitServer(
        ctx,
        unit_id,
        address,
        capacity_bytes=capacity_bytes,
        keys=keys,
        grant_key=grant_key_from_env(),
        controller=controller,
        **common,
    )
    server.start()
    await _serve_until_stopped(server, parent)
    ctx.term()


async def _run_controller(
    units: Sequence[str],
    address: str,
    capacity_rows: int | None,
    spread_bytes: int | None,
    max_lease_s: float,
    parent: int,
    keys: ServerKeys | None,
    liveness: Liveness,
    allocation_s: float,
    common: dict[str, Any],
    replicas: int = 1,
    state_dir: str | None = None,
    fsync: str = "batch",
) -> None:
    ctx = zmq.asyncio.Context()
    extra: dict[str, Any] = {} if spread_bytes is None else {"spread_bytes": spread_bytes}
    if state_dir is not None:
        extra.update(state_dir=state_dir, journal=JournalSettings(fsync=fsync))
    server = ControllerServer(
        ctx,
        units,
        address,
        capacity_rows=capacity_rows,
        max_lease_s=max_lease_s,
        keys=keys,
        grant_key=grant_key_from_env(),
        liveness=liveness,
        allocation_s=allocation_s,
        replicas=replicas,
        **common,
        **extra,
    )
    await server.start()
    await _serve_until_stopped(server, parent)
    ctx.term()


def _child_main(argv: list[str]) -> None:
    """Entry point of a server process (``python -m transferqueue.deploy.service ...``)."""
    ap = argparse.ArgumentParser(prog="transferqueue.deploy.service")
    ap.add_argument("role", choices=["unit", "controller"])
    ap.add_argument("--address", required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--unit-id", type=int, default=0)
    ap.add_argument("--capacity", type=int, default=None)
    ap.add_argument("--spread-bytes", type=int, default=None)
    ap.add_argument("--units", default="")
    ap.add_argument("--max-lease-s", type=float, default=MAX_LEASE_S)
    ap.add_argument("--keys", default=None)
    ap.add_argument("--controller", default=None)
    ap.add_argument("--heartbeat-s", type=float, default=DEFAULT_LIVENESS.heartbeat_s)
    ap.add_argument("--dead-after-s", type=float, default=DEFAULT_LIVENESS.dead_after_s)
    ap.add_argument(
        "--holder-dead-after-s", type=float, default=DEFAULT_LIVENESS.holder_dead_after_s
    )
    ap.add_argument("--holder-grace-s", type=float, default=DEFAULT_LIVENESS.holder_grace_s)
    ap.add_argument("--allocation-s", type=float, default=ALLOCATION_S)
    ap.add_argument("--metrics-port", type=int, default=None)
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--state-dir", default=None)
    ap.add_argument("--fsync", default="batch", choices=FSYNC_POLICIES)
    ap.add_argument("--max-connections", type=int, default=None)
    a = ap.parse_args(argv)
    raise_open_file_limit()  # (before the default of max_connections is derived from it)
    common = {  # (the settings both kinds of server take)
        "metrics_port": a.metrics_port,
        "metrics_host": a.metrics_host,
        "max_connections": max_connections_for(a.max_connections),
    }
    keep_freed_memory()  # reuse freed payload buffers instead of faulting in fresh pages
    keys = server_keys(a.keys)
    if a.role == "unit":
        asyncio.run(
            _run_unit(a.unit_id, a.address, a.capacity, a.parent, keys, a.controller, common)
        )
    else:
        asyncio.run(
            _run_controller(
                a.units.split(","),
                a.address,
                a.capacity,
                a.spread_bytes,
                a.max_lease_s,
                a.parent,
                keys,
                Liveness(
                    heartbeat_s=a.heartbeat_s,
                    dead_after_s=a.dead_after_s,
                    holder_dead_after_s=a.holder_dead_after_s,
                    holder_grace_s=a.holder_grace_s,
                ),
                a.allocation_s,
                common,
                a.replicas,
                a.state_dir,
                a.fsync,
            )
        )


if __name__ == "__main__":
    _child_main(sys.argv[1:])
