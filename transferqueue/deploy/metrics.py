"""Prometheus exposition of one TransferQueue server (controller or storage unit).

Opt-in (``metrics_port``: 0 any free port, None off): :class:`MetricsEndpoint` serves
``http://HOST:PORT/metrics`` from prometheus_client's HTTP thread. The server's state lives
on its asyncio loop, so a scrape never reads it directly: :class:`SnapshotCollector` hops
onto the loop (``run_coroutine_threadsafe``, bounded by ``SCRAPE_TIMEOUT_S``) for one plain
snapshot (:meth:`ControllerServer.metrics_snapshot`, :meth:`UnitServer.metrics_snapshot`)
and turns it into metric families. A loop too busy or closed makes that scrape report
``transferqueue_scrape_ok 0`` and nothing else; it never hangs nor touches the server.
Requests are counted on the loop with plain ints (:mod:`transferqueue.wire.counters`), never
with prometheus_client's locked metric objects.

    metric (prefix transferqueue_)          labels                    server
    requests_total, request_errors_total    server, kind              both
    request_seconds (histogram)             server, kind              both
    received_bytes_total, sent_bytes_total  server, kind              both
    bad_messages_total                      server                    both
    process_resident_bytes                  server                    both
    connections, clients, clients_peak      server                    both
    connection_refusals_total               server                    both
    rows_live, rows_put_total, ...          partition                 controller
    task_rows                               partition, task, state    controller
    leases_active, leases_expired_total                               controller
    leases_returned_total, rows_returned_total, holders_lost_total    controller
    unit_rows, unit_bytes, shm_attached_bytes, shm_used_bytes  unit   unit

``state`` of ``task_rows`` is queued, leased, waiting (fields not all written yet), done,
lost or dropped. Counters restart from 0 when their server process does (Prometheus reads a
drop as a restart); those of the controller's core (rows put, leases expired) also at a
``reset``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from transferqueue.wire.counters import LATENCY_BOUNDS_S

__all__ = [
    "SCRAPE_TIMEOUT_S",
    "MetricsEndpoint",
    "SnapshotCollector",
    "check_metrics_port",
    "process_memory",
]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0
"""How long a scrape waits for the server's loop to take its snapshot."""

_TASK_STATES = ("queued", "leased", "waiting", "done", "lost", "dropped")
_PARTITION_COUNTS = ("rows_put", "rows_freed", "rows_lost")  # (exposed with _total)


def check_metrics_port(port: Any) -> int | None:
    """``port`` if it is a metrics port (None: off; 0: any free port); else a ValueError."""
    if port is None or (isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536):
        return port
    raise ValueError(
        f"metrics_port must be None (no endpoint), 0 (any free port) or a port in 1..65535, "
        f"got {port!r}"
    )


def process_memory(shm_dir: str) -> dict[str, int]:
    """This process's resident memory and the used bytes of the ``shm_dir`` file system
    (``/dev/shm``: every process's arenas on this host), in bytes; 0 where unknown."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass  # (not Linux: left unknown)
    try:
        shm_used = shutil.disk_usage(shm_dir).used
    except OSError:
        shm_used = 0
    return {"resident_bytes": rss, "shm_used_bytes": int(shm_used)}


class SnapshotCollector:
    """A prometheus_client collector reading ``snapshot`` (called on ``loop``) per scrape."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        snapshot: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
        *,
        timeout_s: float = SCRAPE_TIMEOUT_S,
    ) -> None:
        self._loop = loop
        self._snapshot = snapshot
        self._timeout_s = timeout_s

    def _take(self) -> dict[str, Any] | None:
        coro = self._snapshot()
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed: the server is stopping
            coro.close()
            return None
        try:
            return fut.result(timeout=self._timeout_s)
        except Exception as e:  # a busy loop or a failed snapshot: this scrape reports it
            fut.cancel()
            log.warning("metrics snapshot failed: %r", e)
            return None

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        snap = self._take()
        ok = GaugeMetricFamily(
            "transferqueue_scrape_ok", "1 when this scrape read the server's state, else 0"
        )
        ok.add_metric([], 0.0 if snap is None else 1.0)
        yield ok
        if snap is not None:
            yield from _families(snap)


def _families(snap: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    server = str(snap["server"])
    requests = snap["requests"]
    fams: dict[str, Any] = {
        "requests": CounterMetricFamily(
            "transferqueue_requests", "requests answered, by kind", labels=["server", "kind"]
        ),
        "errors": CounterMetricFamily(
            "transferqueue_request_errors",
            "requests answered with an error, by kind",
            labels=["server", "kind"],
        ),
        "bytes_in": CounterMetricFamily(
            "transferqueue_received_bytes", "request bytes received", labels=["server", "kind"]
        ),
        "bytes_out": CounterMetricFamily(
            "transferqueue_sent_bytes",
            "reply bytes sent as frames (not those placed in shared memory)",
            labels=["server", "kind"],
        ),
    }
    hist = HistogramMetricFamily(
        "transferqueue_request_seconds",
        "seconds from a request's receipt to its reply (a blocking get_meta's wait included)",
        labels=["server", "kind"],
    )
    bounds = [*(f"{b:g}" for b in LATENCY_BOUNDS_S), "+Inf"]
    for kind, c in requests["kinds"].items():
        for key, fam in fams.items():
            fam.add_metric([server, kind], c[key])
        cumulative, total = [], 0
        for bound, n in zip(bounds, c["buckets"], strict=True):
            total += n
            cumulative.append((bound, total))
        hist.add_metric([server, kind], cumulative, c["seconds"])
    yield from fams.values()
    yield hist
    bad = CounterMetricFamily(
        "transferqueue_bad_messages", "messages dropped or refused by schema", labels=["server"]
    )
    bad.add_metric([server], requests["bad_messages"])
    yield bad
    rss = GaugeMetricFamily(
        "transferqueue_process_resident_bytes", "the server process's RSS", labels=["server"]
    )
    rss.add_metric([server], snap["memory"]["resident_bytes"])
    yield rss
    yield from _connection_families(server, snap["connections"])
    if "controller" in snap:
        yield from _controller_families(snap["controller"])
    if "unit" in snap:
        yield from _unit_families(snap["unit"], snap["memory"])


def _connection_families(server: str, conns: dict[str, Any]) -> Iterator[Any]:
    """Open connections, admitted clients (now and at most) and refused requests (see
    :mod:`transferqueue.wire.peers`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for key, what in (
        ("connections", "connections open (clients, the service's own, refused)"),
        ("clients", "client connections admitted (at most max_connections)"),
        ("clients_peak", "client connections admitted at once, at most, since the start"),
    ):
        gauge = GaugeMetricFamily(f"transferqueue_{key}", what, labels=["server"])
        gauge.add_metric([server], conns[key])
        yield gauge
    refusals = CounterMetricFamily(
        "transferqueue_connection_refusals",
        "requests refused: their connection was past max_connections",
        labels=["server"],
    )
    refusals.add_metric([server], conns["refusals"])
    yield refusals


def _controller_families(stats: dict[str, Any]) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    live = GaugeMetricFamily("transferqueue_rows_live", "rows held", labels=["partition"])
    counts = {
        key: CounterMetricFamily(
            f"transferqueue_{key}", f"{key} per partition", labels=["partition"]
        )
        for key in _PARTITION_COUNTS
    }
    task_rows = GaugeMetricFamily(
        "transferqueue_task_rows",
        "rows of a partition by their state for a consumer task",
        labels=["partition", "task", "state"],
    )
    for pname, part in stats["partitions"].items():
        live.add_metric([pname], part["rows_live"])
        for key, fam in counts.items():
            fam.add_metric([pname], part[key])
        for tname, task in part["tasks"].items():
            for state in _TASK_STATES:
                task_rows.add_metric([pname, tname, state], task[state])
    yield live
    yield from counts.values()
    yield task_rows
    active = GaugeMetricFamily("transferqueue_leases_active", "leases not yet acknowledged")
    active.add_metric([], stats["active_leases"])
    yield active
    expired = CounterMetricFamily(
        "transferqueue_leases_expired", "leases whose deadline passed before their ack"
    )
    expired.add_metric([], stats["expired_leases"])
    yield expired
    for name, key, doc in (
        ("leases_returned", "returned_leases", "leases returned because their holder died"),
        ("rows_returned", "returned_rows", "rows those returned leases gave back"),
        ("holders_lost", "holders_lost", "lease holders declared gone (silent, closed, replaced)"),
    ):
        fam = CounterMetricFamily(f"transferqueue_{name}", doc)
        fam.add_metric([], stats.get(key, 0))
        yield fam
    one = GaugeMetricFamily(
        "transferqueue_rows_one_copy",
        "live rows with one copy left although the service keeps two (replicas=2)",
    )
    one.add_metric([], stats.get("rows_one_copy", 0))
    yield one
    recopied = CounterMetricFamily(
        "transferqueue_rows_recopied",
        "second copies made again of rows left with one copy (replicas=2)",
    )
    recopied.add_metric([], stats.get("rows_recopied", 0))
    yield recopied
    alive = GaugeMetricFamily("transferqueue_unit_alive", "1: the unit serves", labels=["unit"])
    placed = GaugeMetricFamily(
        "transferqueue_unit_placed_bytes", "payload bytes placed per unit", labels=["unit"]
    )
    for u, (ok, nbytes) in enumerate(zip(stats["units_alive"], stats["unit_bytes"], strict=True)):
        alive.add_metric([str(u)], 1.0 if ok else 0.0)
        placed.add_metric([str(u)], nbytes)
    yield alive
    yield placed


def _unit_families(stats: dict[str, Any], memory: dict[str, int]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    unit = [str(stats["unit"])]
    for name, key, doc in (
        ("unit_rows", "rows", "rows this unit holds"),
        ("unit_bytes", "bytes", "payload bytes this unit holds"),
        ("shm_arenas", "shm_arenas", "client shared-memory arenas attached"),
        ("shm_attached_bytes", "shm_attached_bytes", "bytes of the arenas attached"),
    ):
        fam = GaugeMetricFamily(f"transferqueue_{name}", doc, labels=["unit"])
        fam.add_metric(unit, stats[key])
        yield fam
    shm = GaugeMetricFamily(
        "transferqueue_shm_used_bytes", "used bytes of the host's /dev/shm", labels=["unit"]
    )
    shm.add_metric(unit, memory["shm_used_bytes"])
    yield shm


class MetricsEndpoint:
    """``http://host:port/metrics`` of one server, on prometheus_client's HTTP thread.

    Started by the server on its running loop (:meth:`UnitServer.start`,
    :meth:`ControllerServer.start`); ``close`` (idempotent) stops the thread.
    ``host`` defaults to loopback: metrics name partitions and tasks, so listening beyond
    it is the operator's explicit choice.
    """

    def __init__(
        self,
        snapshot: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
        port: int,
        host: str = "127.0.0.1",
    ) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(asyncio.get_running_loop(), snapshot))
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        bound_host, bound_port = self._httpd.server_address[:2]
        self.url = f"http://{_url_host(str(bound_host))}:{bound_port}/metrics"
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
