"""``transferqueue`` command line: run a local service, inspect a running one.

transferqueue serve --units 4              # prints tcp://127.0.0.1:PORT, serves until ^C
transferqueue stats tcp://127.0.0.1:PORT   # JSON of the controller and units
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading


def _serve(args: argparse.Namespace) -> int:
    from transferqueue.service import LocalService

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
    )
    print(service.address, flush=True)
    print(
        f"transferqueue: controller at {service.address}, {args.units} storage units; Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            if not service.alive():
                print("transferqueue: a server process exited; stopping", file=sys.stderr)
                return 1
    finally:
        service.close()
    return 0


def _stats(args: argparse.Namespace) -> int:
    from transferqueue.remote import connect

    with connect(args.address) as tq:
        print(json.dumps(tq.client().stats(), indent=2, default=str))
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
    s.add_argument("--advertise-host", default=None, help="host name clients use to connect")
    s.set_defaults(fn=_serve)
    st = sub.add_parser("stats", help="print a running service's state as JSON")
    st.add_argument("address")
    st.set_defaults(fn=_stats)
    args = ap.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    raise SystemExit(main())
