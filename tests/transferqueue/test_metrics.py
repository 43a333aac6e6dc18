"""Prometheus endpoints of a real local service: counters move by the right amount per
message kind, rows and leases are right, scrapes never hang; ``transferqueue top``."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
import torch
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

import transferqueue
from transferqueue.deploy import cli
from transferqueue.deploy.metrics import SnapshotCollector, check_metrics_port
from transferqueue.errors import BadRequestError
from transferqueue.wire import messages as m
from transferqueue.wire.rpc import RpcClient

pytestmark = pytest.mark.service

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture(scope="module")
def svc() -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=2, spread_bytes=0, metrics_port=0) as s:
        yield s


@pytest.fixture
def client(svc: transferqueue.LocalService) -> Iterator[transferqueue.Client]:
    # shm_max_bytes=0: payload travels as frames, so the units' byte counters see it
    with transferqueue.connect(svc.address, shm_max_bytes=0) as tq:
        yield tq.client()


def test_request_counters_move_by_kind(
    svc: transferqueue.LocalService, client: transferqueue.Client
) -> None:
    assert svc.metrics_address is not None and len(svc.unit_metrics_addresses) == 2
    units = [u for u in svc.unit_metrics_addresses if u is not None]
    assert len(units) == 2
    x = torch.arange(8 * 256, dtype=torch.float32).reshape(8, 256)  # 8 KiB
    client.put({"x": x}, group=0, partition="kinds")  # registers the field on first use
    c0 = scrape(svc.metrics_address)
    u0 = [scrape(u) for u in units]

    client.put({"x": x}, group=0, partition="kinds")
    meta = client.get_meta("t", ["x"], 8, partition="kinds", timeout_s=10)
    cols = client.get_data(meta)
    client.ack(meta)
    assert isinstance(cols["x"], torch.Tensor) and torch.equal(cols["x"], x)

    c1 = scrape(svc.metrics_address)
    u1 = [scrape(u) for u in units]

    def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    for kind, n in {"allocate": 1, "commit": 1, "get_meta": 1, "ack": 1, "discard": 0}.items():
        got = delta(c0, c1, "transferqueue_requests_total", server="controller", kind=kind)
        assert got == n, kind
        # the latency histogram counts each request once
        got = delta(c0, c1, "transferqueue_request_seconds_count", kind=kind)
        assert got == n, kind

    def over_units(name: str, kind: str) -> float:
        return sum(delta(a, b, name, kind=kind) for a, b in zip(u0, u1, strict=True))

    writes = over_units("transferqueue_requests_total", "write")
    reads = over_units("transferqueue_requests_total", "read")
    assert (writes, reads) == (2, 2)  # (spread over both units)
    got_in = over_units("transferqueue_received_bytes_total", "write")
    got_out = over_units("transferqueue_sent_bytes_total", "read")
    assert x.nbytes <= got_in < x.nbytes + 4096
    assert x.nbytes <= got_out < x.nbytes + 4096
    # every kind's histogram count equals its request count, on every server
    for samples in (c1, *u1):
        for (name, labels), v in samples.items():
            if name == "transferqueue_requests_total":
                assert samples[("transferqueue_request_seconds_count", labels)] == v
    assert value(c1, "transferqueue_scrape_ok") == 1
    assert total(c1, "transferqueue_process_resident_bytes") > 0


def test_connections_exposed(svc: transferqueue.LocalService, client: transferqueue.Client) -> None:
    client.put({"x": [1, 2]}, partition="conns")  # (the client's first requests: admitted)
    ctl = scrape(svc.metrics_address or "")
    assert value(ctl, "transferqueue_clients", server="controller") >= 1
    assert value(ctl, "transferqueue_clients_peak", server="controller") >= 1
    assert value(ctl, "transferqueue_connections", server="controller") >= 1
    assert value(ctl, "transferqueue_connection_refusals_total", server="controller") == 0
    for url in svc.unit_metrics_addresses:
        unit = scrape(url or "")
        # the controller's own connection and this client's, at least
        assert value(unit, "transferqueue_connections", server="unit") >= 2


def test_errors_counted(svc: transferqueue.LocalService, client: transferqueue.Client) -> None:
    assert svc.metrics_address is not None
    c0 = scrape(svc.metrics_address)

    async def refused() -> None:  # a request the controller's handler refuses
        ctx = zmq.asyncio.Context()
        rpc = RpcClient(ctx, svc.address)
        try:
            msg = m.RegisterUnit(unit_id=99, address="tcp://127.0.0.1:1", incarnation="x")
            await rpc.call(msg)
        finally:
            await rpc.close()
            ctx.term()

    with pytest.raises(BadRequestError, match="unit_id 99"):
        asyncio.run(refused())
    c1 = scrape(svc.metrics_address)
    for name in ("transferqueue_request_errors_total", "transferqueue_requests_total"):
        got = total(c1, name, server="controller", kind="register_unit")
        assert got == 1 + total(c0, name, server="controller", kind="register_unit"), name
    assert total(c1, "transferqueue_bad_messages_total") == total(
        c0, "transferqueue_bad_messages_total"
    )


def test_rows_and_leases(svc: transferqueue.LocalService, client: transferqueue.Client) -> None:
    assert svc.metrics_address is not None
    client.declare_tasks(["train"], partition="rows")
    client.put({"r": torch.zeros(10, 4)}, group=0, partition="rows")
    meta = client.get_meta("train", ["r"], 4, partition="rows", timeout_s=10)
    s = scrape(svc.metrics_address)
    assert value(s, "transferqueue_rows_live", partition="rows") == 10
    assert value(s, "transferqueue_rows_put_total", partition="rows") == 10
    rows = {
        state: value(s, "transferqueue_task_rows", partition="rows", task="train", state=state)
        for state in ("queued", "leased", "done", "waiting")
    }
    assert rows == {"queued": 6, "leased": 4, "done": 0, "waiting": 0}
    assert value(s, "transferqueue_leases_active") >= 1
    client.ack(meta)  # the only declared task acknowledged 4 rows: they are freed
    s = scrape(svc.metrics_address)
    assert value(s, "transferqueue_rows_live", partition="rows") == 6
    assert value(s, "transferqueue_rows_freed_total", partition="rows") == 4
    assert value(s, "transferqueue_task_rows", partition="rows", task="train", state="done") == 4
    assert value(s, "transferqueue_rows_recopied_total") == 0  # (one copy kept: none made)


def test_expired_leases_counted(
    svc: transferqueue.LocalService, client: transferqueue.Client
) -> None:
    assert svc.metrics_address is not None
    before = value(scrape(svc.metrics_address), "transferqueue_leases_expired_total")
    client.put({"y": torch.zeros(2, 4)}, group=0, partition="expiry")
    client.get_meta("slow", ["y"], 2, partition="expiry", timeout_s=10, lease_s=0.2)
    deadline = time.monotonic() + 30  # (the lease timer wakes at least every 0.5 s)
    while time.monotonic() < deadline:
        s = scrape(svc.metrics_address)
        if value(s, "transferqueue_leases_expired_total") > before:
            break
        time.sleep(0.1)
    assert value(s, "transferqueue_leases_expired_total") == before + 1
    queued = value(s, "transferqueue_task_rows", partition="expiry", task="slow", state="queued")
    assert queued == 2  # back in the queue


def test_stats_name_the_endpoints(
    svc: transferqueue.LocalService, client: transferqueue.Client
) -> None:
    stats = client.stats()
    assert stats["controller"]["metrics_address"] == svc.metrics_address
    assert [u["metrics_address"] for u in stats["units"]] == svc.unit_metrics_addresses
    assert stats["controller"]["requests"]["kinds"]["stats"]["requests"] >= 1
    assert all(u["memory"]["resident_bytes"] > 0 for u in stats["units"])


def test_off_by_default() -> None:
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        assert svc.metrics_address is None and svc.unit_metrics_addresses == [None]
        stats = tq.client().stats()
        assert stats["controller"]["metrics_address"] is None
        assert stats["units"][0]["metrics_address"] is None


def test_top_once(
    svc: transferqueue.LocalService,
    client: transferqueue.Client,
    capsys: pytest.CaptureFixture[str],
) -> None:
    client.put({"tp": torch.zeros(3, 4)}, group=0, partition="toppart")
    client.get_meta("toptask", ["tp"], 1, partition="toppart", timeout_s=10)
    assert cli.main(["top", svc.address, "--once"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("toppart"))
    assert row.split()[:6] == ["toppart", "toptask", "3", "2", "1", "0"]  # live queued leased
    assert "unit 0" in out and "unit 1" in out and "controller" in out
    assert cli.main(["top", svc.address, "--iterations", "2", "--interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert out.count("toptask") == 2  # two views; the second has rates
    assert "req/s" in out


def test_serve_cli_prints_its_metrics_endpoints() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transferqueue.deploy.cli",
            "serve",
            "--units",
            "1",
            "--metrics-port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("tcp://127.0.0.1:")
        proc.stderr.readline()  # "controller at ..."
        line = proc.stderr.readline()
        urls = re.findall(r"http://127\.0\.0\.1:\d+/metrics", line)
        assert len(urls) == 2, line  # the controller's and the unit's, on loopback
        for url, server in zip(urls, ("controller", "unit"), strict=True):
            s = scrape(url)
            assert value(s, "transferqueue_scrape_ok") == 1
            assert (
                "transferqueue_requests_total",
                frozenset({("server", server), ("kind", "stats")}),
            ) in s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_metrics_port_checked() -> None:
    for bad in (-1, 70000, "8000", True):
        with pytest.raises(ValueError, match="metrics_port"):
            check_metrics_port(bad)
    with pytest.raises(ValueError, match="metrics_port"):
        transferqueue.serve(num_units=1, metrics_port=-1)


def test_scrape_of_a_stuck_or_failing_server_reports_not_ok() -> None:
    """A loop that never runs the snapshot (busy) or a snapshot that fails: the scrape
    answers at once with scrape_ok 0, it neither hangs nor raises."""
    stuck = asyncio.new_event_loop()  # (never run: a loop too busy to answer)

    async def never() -> dict[str, object]:
        raise AssertionError("not reached")

    try:
        fams = list(SnapshotCollector(stuck, never, timeout_s=0.2).collect())
        assert [f.name for f in fams] == ["transferqueue_scrape_ok"]
        assert fams[0].samples[0].value == 0
    finally:
        stuck.run_until_complete(asyncio.sleep(0.01))  # (the cancelled snapshot ends)
        stuck.close()
    fams = list(SnapshotCollector(stuck, never, timeout_s=0.2).collect())  # closed loop
    assert fams[0].samples[0].value == 0


@pytest.mark.ray
def test_ray_deployment_serves_metrics(ray_cluster: None) -> None:
    from transferqueue.deploy.ray import start_on_ray

    tq = start_on_ray(num_units=1, metrics_port=0)
    try:
        client = tq.client()
        client.put({"x": torch.zeros(5, 4)}, group=0, partition="ray")
        stats = client.stats()
        url = stats["controller"]["metrics_address"]
        unit_url = stats["units"][0]["metrics_address"]
        assert url.startswith("http://127.0.0.1:") and unit_url.startswith("http://127.0.0.1:")
        s = scrape(url)
        assert value(s, "transferqueue_rows_live", partition="ray") == 5
        assert value(s, "transferqueue_requests_total", server="controller", kind="commit") == 1
        u = scrape(unit_url)
        assert value(u, "transferqueue_requests_total", server="unit", kind="write") == 1
    finally:
        tq.close()


def test_returned_leases_counted(
    svc: transferqueue.LocalService, client: transferqueue.Client
) -> None:
    assert svc.metrics_address is not None
    s = scrape(svc.metrics_address)
    before = [
        value(s, f"transferqueue_{name}_total")
        for name in ("leases_returned", "rows_returned", "holders_lost")
    ]
    client.put({"h": torch.zeros(3, 4)}, group=0, partition="holders")
    other = transferqueue.connect(svc.address)
    other.client().get_meta("held", ["h"], 3, partition="holders", timeout_s=10, lease_s=600)
    other.close()  # a handle closed holding rows: they go back at once
    s = scrape(svc.metrics_address)
    after = [
        value(s, f"transferqueue_{name}_total")
        for name in ("leases_returned", "rows_returned", "holders_lost")
    ]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 3, 1]
    assert (
        value(s, "transferqueue_task_rows", partition="holders", task="held", state="queued") == 3
    )
    from transferqueue.deploy.top import render  # (here: its output stream binds at import)

    assert f"returned {after[0]:,.0f} ({after[1]:,.0f} rows)" in render(client.stats())
