"""The service deployments: fuzzed servers keep serving, crashed consumers lose nothing,
``transferqueue serve`` works from the command line, Ray tasks can connect."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import fuzzwire
import msgpack
import numpy as np
import pytest
import rawwire as raw
import torch
import zmq

import transferqueue

pytestmark = pytest.mark.service


RSS_BOUND_BYTES = 64 << 20
"""How much a server's resident memory may grow while it is fuzzed (it starts at ~230 MB and
grew by less than 4 MB when measured)."""


def _fuzz(sock: zmq.Socket, server: str, pids: list[int], rss0: list[int]) -> tuple[int, int, int]:
    """Send every hostile case of ``server``; (requests with an id, answered, dropped).
    Every request whose header names it gets an answer, except waits that legitimately
    outlast the poll."""
    answered = dropped = numbered = 0
    pending: set[int] = set()
    for n, (label, frames) in enumerate(fuzzwire.cases(server)):
        sock.send_multipart(frames)
        rid = fuzzwire.numbered(frames)
        if rid is not None and label not in ("short-header",):
            pending.add(rid)
            numbered += 1
        while sock.poll(2000 if pending else 20):
            reply = sock.recv_multipart()
            got, status = struct.unpack_from("<QB", reply[0])
            assert status in (0, 1), label
            if status == 1:  # a typed error reply
                code, text = msgpack.unpackb(reply[0][9:])
                assert code in ERROR_CODES, (label, code, text)
            pending.discard(got)
            answered += 1
            if rid not in pending:
                break
        else:
            if rid in pending:
                # only a get_meta or allocate may still wait (its valid timeout_s)
                assert label.startswith(("get_meta", "allocate")), label
                pending.discard(rid)
                dropped += 1
        if n % 200 == 0:
            for pid, start in zip(pids, rss0, strict=True):
                assert fuzzwire.rss_bytes(pid) < start + RSS_BOUND_BYTES, (label, pid)
    return numbered, answered, dropped


ERROR_CODES = {
    "protocol", "bad_request", "schema", "unknown_field", "unknown_row", "unknown_lease",
    "lease_expired", "unknown_task", "capacity", "denied", "finished", "closed",
    "unknown_key", "key_leased",
}  # fmt: skip


def test_fuzzed_servers_answer_with_typed_errors_then_serve_bit_exact_data() -> None:
    """Every hostile case of every message kind (see fuzzwire) against a live controller and
    unit: each gets a typed error reply (or a result, when the mutation happens to be valid),
    no server dies, their RSS stays within RSS_BOUND_BYTES of where it started, and then a
    round trip of dense, ragged and object columns is bit-exact."""
    with transferqueue.serve(num_units=2) as svc:
        with transferqueue.connect(svc.address) as tq:  # warm every server up first
            c = tq.client()
            c.get_data(c.put({"w": torch.zeros(64, 33), "o": ["x"] * 64}, group=0))
        rss0 = [fuzzwire.rss_bytes(p) for p in svc.pids]
        ctx = zmq.Context()
        try:
            for server, address in [("controller", svc.address), ("unit", svc.unit_addresses[0])]:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                numbered, answered, dropped = _fuzz(sock, server, svc.pids, rss0)
                sock.close()
                assert numbered > 900 and dropped < 10, (server, numbered, dropped)
                assert answered + dropped >= numbered, (server, numbered, answered, dropped)
                assert svc.alive()
        finally:
            ctx.destroy(linger=0)
        for pid, start in zip(svc.pids, rss0, strict=True):
            assert fuzzwire.rss_bytes(pid) < start + RSS_BOUND_BYTES
        with transferqueue.connect(svc.address) as tq:
            client = tq.client()
            x = torch.randn(64, 33).to(torch.bfloat16)
            r = [torch.arange(i, dtype=torch.int32) for i in range(64)]
            o = [{"i": i, "s": "ü" * i} for i in range(64)]
            meta = client.put({"x": x, "r": r, "o": o}, group=0, partition="after")
            got = client.get_meta("after-t", ["x", "r", "o"], 64, partition="after", timeout_s=10)
            cols = client.get_data(got)
            assert torch.equal(cols["x"].view(torch.int16), x.view(torch.int16))  # type: ignore[union-attr]
            assert [t.tolist() for t in cols["r"]] == [t.tolist() for t in r]  # type: ignore[union-attr]
            assert cols["o"] == o and len(got) == len(meta) == 64


def test_hostile_requests_from_the_issue_get_typed_errors_and_the_service_keeps_serving() -> None:
    """allocate n=3e8, a unit write naming row 2**27, lease_s=inf, renew lease_s=-5: each a
    typed error before anything is sized; then puts and reads work as before."""
    with transferqueue.serve(num_units=1) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.address)
        unit = ctx.socket(zmq.DEALER)
        unit.setsockopt(zmq.LINGER, 0)
        unit.connect(svc.unit_addresses[0])
        try:
            ask = raw.ask
            # Allocate: n, partition, ...
            assert (
                raw.error_code(ask(sock, raw.request("allocate", [300_000_000, "p"]))) == "protocol"
            )
            get_meta = ["t", "p", ["x"], 4, float("inf")]  # task, partition, fields, batch, lease_s
            assert raw.error_code(ask(sock, raw.request("get_meta", get_meta))) == "protocol"
            renew = [12345, -5.0]  # lease_id, lease_s
            assert raw.error_code(ask(sock, raw.request("renew", renew))) == "protocol"
            spec = {"kind": "dense", "dtype": "float32", "shape": [1]}
            col = raw.tensor("float32", [1, 1], raw.inline(b"\x00" * 4))
            write = [raw.int64s([2**27]), {"x": col}, {"x": spec}, True]  # no grant
            assert raw.error_code(ask(unit, raw.request("write", write))) == "denied"
            forged = [*write, b"\x00" * 44]
            assert raw.error_code(ask(unit, raw.request("write", forged))) == "denied"
        finally:
            ctx.destroy(linger=0)
        for _ in range(3):  # (the controller was left unable to put once: never again)
            meta = client.put({"x": torch.arange(1000.0).reshape(1000, 1)}, group=0)
            assert torch.equal(client.get_data(meta)["x"], torch.arange(1000.0).reshape(1000, 1))  # type: ignore[arg-type]
        stats = client.stats()
        assert stats["units"][0]["slot_capacity"] < 10_000  # row 2**27 was never sized


CONSUMER = textwrap.dedent(
    """
    import sys, time, transferqueue
    tq = transferqueue.connect(sys.argv[1])
    c = tq.client()
    meta = c.get_meta("train", ["x"], 8, timeout_s=30, lease_s=float(sys.argv[2]))
    print("LEASED", " ".join(str(i) for i in meta.indexes), flush=True)
    time.sleep(600)  # killed here, mid-lease
    """
)


@pytest.mark.slow
def test_killed_consumer_process_rows_go_to_another_consumer() -> None:
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        client.declare_tasks(["train"])
        client.put({"x": torch.arange(16)}, group=np.arange(16))
        proc = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, svc.address, "1.5"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("LEASED"), line
            leased = sorted(int(i) for i in line.split()[1:])
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        seen: list[int] = []
        t0 = time.monotonic()
        while len(seen) < 16 and time.monotonic() - t0 < 20:
            meta = client.get_meta("train", ["x"], 8, timeout_s=3)
            x = client.get_data(meta)["x"] if len(meta) else torch.empty(0)
            seen += x.tolist()  # type: ignore[union-attr]
            if len(meta):
                client.ack(meta)
        assert sorted(seen) == list(range(16))  # nothing lost, nothing twice
        assert set(leased) <= set(seen)
        assert client.stats()["controller"]["rows_live"] == 0


def test_serve_cli_prints_address_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "transferqueue.deploy.cli", "serve", "--units", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://127.0.0.1:")  # loopback by default
        with transferqueue.connect(address) as tq:
            c = tq.client()
            c.put({"x": torch.ones(3)}, group=0)
            assert c.stats()["controller"]["rows_live"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ipc_transport() -> None:
    with transferqueue.serve(num_units=1, transport="ipc") as svc:
        assert svc.address.startswith("ipc://")
        with transferqueue.connect(svc.address) as tq:
            c = tq.client()
            meta = c.put({"r": [torch.arange(5), torch.arange(0)]}, group=0)
            assert [t.tolist() for t in c.get_data(meta)["r"]] == [[0, 1, 2, 3, 4], []]  # type: ignore[union-attr]


def test_connect_to_nothing_fails_fast_with_a_clear_error() -> None:
    with pytest.raises(transferqueue.PeerGoneError, match="transferqueue serve"):
        transferqueue.connect("tcp://127.0.0.1:1", connect_timeout_s=0.5)


@pytest.mark.ray
def test_ray_tasks_connect_and_exchange_data(ray_tq: str) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def produce(address: str, k: int) -> int:
        import torch

        import transferqueue

        with transferqueue.connect(address) as tq:
            tq.client().put({"x": torch.full((4,), k)}, group=k, partition="ray")
        return k

    with transferqueue.connect(ray_tq) as tq:
        tq.reset()
        ray.get([produce.remote(ray_tq, k) for k in range(3)])
        client = tq.client()
        meta = client.get_meta("t", ["x"], 12, partition="ray", timeout_s=10)
        x = client.get_data(meta)["x"]
        assert sorted(x.tolist()) == sorted([0] * 4 + [1] * 4 + [2] * 4)  # type: ignore[union-attr]
