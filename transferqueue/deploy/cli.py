"""``transferqueue`` command line: run a local service, inspect a running one, make keys.

transferqueue serve --units 4              # prints tcp://127.0.0.1:PORT, serves until ^C
transferqueue serve --units 3 --replicas 2 # each row on two units: one may die
transferqueue serve --state-dir DIR        # the controller keeps its state: restarted, recovers
transferqueue stats tcp://127.0.0.1:PORT   # JSON of the controller and units
transferqueue top tcp://127.0.0.1:PORT     # live view: rows, tasks, leases, rates, memory
transferqueue serve --metrics-port 0       # also Prometheus endpoints (URLs on stderr)
transferqueue serve --max-connections 512  # clients past 512 per server get a typed refusal
transferqueue save tcp://127.0.0.1:PORT DIR  # partitions to Arrow IPC files (progress on stderr)
transferqueue load tcp://127.0.0.1:PORT DIR  # into a store without those partitions
transferqueue keygen DIR [--admin]         # keys for a service beyond loopback
transferqueue serve --host 0.0.0.0 --keys DIR [--advertise-host NAME]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable

from transferqueue.controller.health import ALLOCATION_S
from transferqueue.controller.journal import FSYNC_POLICIES
from transferqueue.deploy.service import MAX_RESTARTS
from transferqueue.errors import TQError
from transferqueue.limits import CONNECTION_FD_RESERVE
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Liveness


def _serve(args: argparse.Namespace) -> int:
    from transferqueue.deploy.service import LocalService

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service = LocalService(
        args.units,
        host=args.host,
        port=args.port,
        transport=args.transport,
        capacity_rows=args.capacity_rows,
        unit_capacity_bytes=args.unit_capacity_bytes,
        spread_bytes=args.spread_bytes,
        advertise_host=args.advertise_host,
        keys=args.keys,
        max_lease_s=args.max_lease_s,
        liveness=Liveness(
            heartbeat_s=args.heartbeat_s,
            dead_after_s=args.dead_after_s,
            holder_dead_after_s=args.holder_dead_after_s,
            holder_grace_s=args.holder_grace_s,
        ),
        allocation_s=args.allocation_s,
        max_restarts=args.max_restarts,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        replicas=args.replicas,
        state_dir=args.state_dir,
        fsync=args.fsync,
        max_connections=args.max_connections,
    )
    print(service.address, flush=True)
    print(
        f"transferqueue: controller at {service.address}, {args.units} storage units, "
        f"{args.replicas} cop{'y' if args.replicas == 1 else 'ies'} of each row; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    if service.metrics_address is not None:
        units = " ".join(str(u) for u in service.unit_metrics_addresses)
        print(
            f"transferqueue: metrics at {service.metrics_address} (controller), {units} (units)",
            file=sys.stderr,
            flush=True,
        )
    try:
        while not stop.wait(0.5):
            # (a unit that exits is restarted by the service; the others keep serving)
            if not service.alive():
                print(
                    "transferqueue: the controller exited, or every storage unit did and has no "
                    "restart left; stopping",
                    file=sys.stderr,
                )
                return 1
    finally:
        service.close()
    return 0


def _stats(args: argparse.Namespace) -> int:
    from transferqueue.deploy.connect import connect

    with connect(
        args.address, keys=args.keys, connect_timeout_s=args.timeout, call_timeout_s=args.timeout
    ) as tq:
        print(json.dumps(tq.client().stats(), indent=2, default=str))
    return 0


def _top(args: argparse.Namespace) -> int:
    from transferqueue.deploy.connect import connect
    from transferqueue.deploy.top import run_top

    iterations = 1 if args.once else args.iterations
    with connect(
        args.address, keys=args.keys, connect_timeout_s=args.timeout, call_timeout_s=args.timeout
    ) as tq:
        client = tq.client()
        return run_top(
            client.stats,
            interval_s=args.interval,
            iterations=iterations,
            clear=iterations != 1 and sys.stdout.isatty(),
        )


def _progress(verb: str) -> Callable[[str, int, int], None]:
    """Rows done per partition on stderr, at most about twice a second (and at the end)."""
    last = [0.0]

    def show(partition: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 0.5:
            return
        last[0] = now
        end = "\n" if done >= total else ""
        print(f"\r{verb} {partition}: {done}/{total} rows", end=end, file=sys.stderr, flush=True)

    return show


def _save(args: argparse.Namespace) -> int:
    from transferqueue.deploy.connect import connect

    with connect(
        args.address, keys=args.keys, connect_timeout_s=args.timeout, call_timeout_s=args.timeout
    ) as tq:
        rows = tq.client().save(
            args.directory,
            args.partition,
            batch_rows=args.batch_rows,
            progress=None if args.quiet else _progress("saving"),
        )
    print(json.dumps({"saved": args.directory, "rows": rows}))
    return 0


def _load(args: argparse.Namespace) -> int:
    from transferqueue.deploy.connect import connect

    with connect(
        args.address, keys=args.keys, connect_timeout_s=args.timeout, call_timeout_s=args.timeout
    ) as tq:
        rows = tq.client().load(
            args.directory, progress=None if args.quiet else _progress("loading")
        )
    print(json.dumps({"loaded": args.directory, "rows": rows}))
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from transferqueue.wire.auth import keygen

    clients = tuple(args.client or ["client"])
    for path in keygen(args.directory, clients=clients, admin=args.admin):
        print(path)
    print(
        f"transferqueue: servers take --keys {args.directory}; a client host needs server.key "
        "and its own *.key_secret (connect(address, keys=DIR) or TRANSFERQUEUE_KEYS=DIR)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="transferqueue", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a controller and storage units as local processes")
    s.add_argument("--units", type=int, default=2, help="number of storage units (default 2)")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to bind (default loopback; 0.0.0.0 listens on every interface)",
    )
    s.add_argument("--port", type=int, default=0, help="controller port (default: a free one)")
    s.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    s.add_argument("--capacity-rows", type=int, default=None, help="rows held at most")
    s.add_argument("--unit-capacity-bytes", type=int, default=None, help="bytes per unit")
    s.add_argument(
        "--spread-bytes",
        type=int,
        default=None,
        help="a put spreads over one unit per this many bytes (default 16 MiB; 0: all units)",
    )
    s.add_argument(
        "--advertise-host",
        default=None,
        help="host name or address clients connect to (default: the bound host; with 0.0.0.0 "
        "the address this host reaches others from)",
    )
    s.add_argument(
        "--keys",
        default=None,
        help="key directory from `transferqueue keygen` (default $TRANSFERQUEUE_KEYS); needed "
        "for any --host but 127.0.0.1",
    )
    s.add_argument("--max-lease-s", type=float, default=None, help="longest lease (default 1 day)")
    s.add_argument(
        "--heartbeat-s",
        type=float,
        default=DEFAULT_LIVENESS.heartbeat_s,
        help=f"controller pings a silent unit after this (default {DEFAULT_LIVENESS.heartbeat_s})",
    )
    s.add_argument(
        "--dead-after-s",
        type=float,
        default=DEFAULT_LIVENESS.dead_after_s,
        help="a unit silent this long is dead: its rows are lost and it is restarted "
        f"(default {DEFAULT_LIVENESS.dead_after_s})",
    )
    s.add_argument(
        "--holder-dead-after-s",
        type=float,
        default=DEFAULT_LIVENESS.holder_dead_after_s,
        help="a client holding leases silent this long is dead: its rows go back to their "
        f"queues (default {DEFAULT_LIVENESS.holder_dead_after_s})",
    )
    s.add_argument(
        "--holder-grace-s",
        type=float,
        default=DEFAULT_LIVENESS.holder_grace_s,
        help="after a restart with --state-dir, how long holders of restored leases have to "
        f"beat again (default {DEFAULT_LIVENESS.holder_grace_s})",
    )
    s.add_argument(
        "--allocation-s",
        type=float,
        default=ALLOCATION_S,
        help="rows a put allocated but did not commit by then are reclaimed "
        f"(default {ALLOCATION_S:g})",
    )
    s.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help=f"restarts of each storage unit process (default {MAX_RESTARTS})",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics: the controller on this port, unit i on port+1+i "
        "(0: free ports; default: off)",
    )
    s.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface the metrics endpoints listen on (default loopback)",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="copies of each row, on different units (default 1; 2: a unit that dies loses no row)",
    )
    s.add_argument(
        "--state-dir",
        default=None,
        help="keep the controller's state in this directory: a controller that dies is "
        "restarted and recovers it (default: none, a dead controller ends the service)",
    )
    s.add_argument(
        "--fsync",
        choices=FSYNC_POLICIES,
        default="batch",
        help="with --state-dir: never, batch (default: within 0.5 s) or always (before each "
        "reply): what a host crash keeps",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="client connections each server admits, the next refused until one closes "
        "(a client holds one to each server; default: the open-file limit, ulimit -n, "
        f"raised to its hard limit, less {CONNECTION_FD_RESERVE})",
    )
    s.set_defaults(fn=_serve)
    st = sub.add_parser("stats", help="print a running service's state as JSON")
    st.add_argument("address", help="tcp://HOST:PORT, as `transferqueue serve` prints it")
    st.add_argument("--keys", default=None, help="key directory (default $TRANSFERQUEUE_KEYS)")
    st.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    st.set_defaults(fn=_stats)
    t = sub.add_parser("top", help="live view of a running service (from its stats)")
    t.add_argument("address", help="tcp://HOST:PORT, as `transferqueue serve` prints it")
    t.add_argument("--interval", type=float, default=2.0, help="seconds between views")
    t.add_argument("--iterations", type=int, default=None, help="views to draw (default: ^C)")
    t.add_argument("--once", action="store_true", help="draw one view and exit")
    t.add_argument("--keys", default=None, help="key directory (default $TRANSFERQUEUE_KEYS)")
    t.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    t.set_defaults(fn=_top)
    for name, fn, what in (
        ("save", _save, "write partitions of a running service to a directory (Arrow IPC)"),
        ("load", _load, "load a directory written by save into a running service"),
    ):
        c = sub.add_parser(name, help=what)
        c.add_argument("address", help="tcp://HOST:PORT, as `transferqueue serve` prints it")
        c.add_argument("directory", help="the save's directory (save: new or empty)")
        if name == "save":
            c.add_argument(
                "--partition", action="append", help="partition to save (repeatable; default all)"
            )
            c.add_argument(
                "--batch-rows", type=int, default=8192, help="rows read and written at a time"
            )
        c.add_argument("--quiet", action="store_true", help="no progress on stderr")
        c.add_argument("--keys", default=None, help="key directory (default $TRANSFERQUEUE_KEYS)")
        c.add_argument("--timeout", type=float, default=60.0, help="seconds to wait per call")
        c.set_defaults(fn=fn)
    k = sub.add_parser("keygen", help="write CURVE keys for a service and its clients")
    k.add_argument("directory")
    k.add_argument("--client", action="append", help="client key name (repeatable; default client)")
    k.add_argument(
        "--admin", action="store_true", help="also an admin key: only it may clear/reset"
    )
    k.set_defaults(fn=_keygen)
    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except (TQError, ValueError) as e:
        print(f"transferqueue: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
