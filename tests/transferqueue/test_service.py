"""The service deployments: fuzzed servers keep serving, crashed consumers lose nothing,
``transferqueue serve`` works from the command line, Ray tasks can connect."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

import transferqueue
from transferqueue import wire

pytestmark = pytest.mark.service


def _raw_request(sock: zmq.Socket, frames: list[bytes], wait_s: float = 2.0) -> list[bytes] | None:
    sock.send_multipart(frames)
    if sock.poll(int(wait_s * 1000)):
        return sock.recv_multipart()
    return None


def _fuzz_frames(rng: random.Random) -> list[bytes]:
    good = wire.encode_request(
        "write",
        1,
        {
            "indexes": np.arange(3, dtype=np.int64),
            "columns": {"x": torch.randn(3, 600)},
            "specs": {"x": transferqueue.FieldSpec.dense("float32", [600])},
            "create": True,
        },
    )
    good = [bytes(f) for f in good]
    kind = rng.randrange(7)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 64))]
    if kind == 1:  # truncated header
        return [good[0][: rng.randrange(1, len(good[0]))], *good[1:]]
    if kind == 2:  # truncated payload frame
        return [good[0], good[1][: rng.randrange(0, len(good[1]))]]
    if kind == 3:  # missing frames
        return good[:1]
    if kind == 4:  # valid msgpack, wrong shape of request
        return [msgpack.packb(rng.choice([1, "x", [1, 2], {"k": 5}, {"k": "get_meta", "i": 9}]))]
    if kind == 5:  # right kind, garbage arguments
        return [
            msgpack.packb(
                {
                    "k": rng.choice(["get_meta", "write", "read", "ack"]),
                    "i": 3,
                    "a": {"indexes": "nope", "batch_size": -1, "task": 5},
                }
            )
        ]
    return [bytes(b) for b in good[:1]] + [rng.randbytes(len(good[1]))]  # random payload


def test_fuzzed_servers_answer_or_drop_then_still_serve_correct_data() -> None:
    rng = random.Random(0)
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        x = torch.randn(64, 33)
        meta = client.put({"x": x, "o": [str(i) for i in range(64)]}, group=0)
        ctx = zmq.Context()
        try:
            for address in [svc.address, *svc.unit_addresses]:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                answered = 0
                for _ in range(150):
                    reply = _raw_request(sock, _fuzz_frames(rng), wait_s=0.5)
                    if reply is not None:
                        answered += 1
                        msg = msgpack.unpackb(reply[0])
                        assert ("e" in msg) or ("r" in msg)  # a reply is typed or a result
                sock.close()
                assert answered > 50  # most malformed requests got an error reply
            assert svc.alive()
            # the service still serves exactly what was stored
            cols = client.get_data(meta)
            assert torch.equal(cols["x"], x)  # type: ignore[arg-type]
            assert cols["o"] == [str(i) for i in range(64)]
            got = client.get_meta("t", ["x"], 64, timeout_s=5)
            assert len(got) == 64
        finally:
            ctx.term()


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
        [sys.executable, "-m", "transferqueue.cli", "serve", "--units", "2"],
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
