"""TransferQueue service throughput against raw ZeroMQ and Ray's object store, in one run.

    python -m bench.throughput              # full sizes (~4-6 min on 2 cores)
    python -m bench.throughput --quick      # small sizes, smoke test
    python -m bench.throughput --no-ray     # skip the Ray baseline
    python -m bench.throughput --replicas   # only the cost of replicas=2 (4 units, ~1 min)

Every system moves the same bytes out of this process into a server process and back
(put + get), measured after a warm-up, best of several runs:

- ``transferqueue``: a local service (``transferqueue serve``) with 1 and 4 storage units;
  ``put`` + ``get_meta`` + ``get_data`` + ``ack``. Twice: as clients connect by default (the
  units are on this host, so column data goes through shared memory), and with
  ``shm_max_bytes=0`` (``frames``: every byte over the ZeroMQ sockets, as between hosts).
- ``raw zmq``: the same bytes as zero-copy frames (the faster of 8 MiB chunks and
  TransferQueue's chunk size) sent to an echo process over a DEALER/ROUTER pair and sent
  back: the ceiling of any ZeroMQ-based store.
- ``ray``: ``ray.put``-style transfer of the same torch tensors to an actor that stores them
  and returns them (what RL frameworks built on Ray do today).

Workloads: (a) dense float32 [1024, 8192] x 9 fields (~288 MB, TransferQueue's "Small" case);
(b) 256 ragged token sequences of 128-4096 int32 ids plus per-token float32 logprobs, once
packed (``ragged``: values + offsets, the tensors Ray gets are the packed ones) and once as
one tensor per sequence (``ragged-seqs``: what a user holds; TransferQueue packs on put and
hands back per-sequence views, Ray pickles every tensor).
Also: controller ``get_meta`` + ``ack`` over the wire at batch 64 (samples/s).
``--replicas`` measures only TransferQueue with 4 units keeping one and two copies of each
row (``replicas=2``: every put writes twice), shared memory and frames, and prints the ratio.
Prints one line per case and the ratios; writes ``bench/results/throughput.json`` and a plot.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

import transferqueue
from bench.common import RESULTS_DIR, line, timeit, write_json
from transferqueue import Ragged
from transferqueue.client.unit_link import SHM_MAX_BYTES
from transferqueue.wire.codec import CHUNK_BYTES


# -- workloads ---------------------------------------------------------------------------------
def dense_case(rows: int, width: int, fields: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {f"f{i}": torch.randn(rows, width, generator=g) for i in range(fields)}


def ragged_case(seqs: int, lo: int, hi: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(lo, hi + 1, seqs)
    ids = [torch.from_numpy(rng.integers(0, 50_000, n).astype(np.int32)) for n in lengths]
    logp = [torch.from_numpy(-rng.random(n).astype(np.float32)) for n in lengths]
    return {"ids": Ragged.from_tensors(ids), "logprobs": Ragged.from_tensors(logp)}


def as_sequences(cols: dict[str, Any]) -> dict[str, Any]:
    """The ragged case as users often hold it: one tensor per sequence."""
    return {k: [t.clone() for t in v.unbind()] for k, v in cols.items()}


def packed(cols: dict[str, Any]) -> dict[str, Any]:
    return {k: Ragged.from_tensors(v) if isinstance(v, list) else v for k, v in cols.items()}


def nbytes(cols: dict[str, Any]) -> int:
    total = 0
    for c in cols.values():
        if isinstance(c, list):
            total += sum(t.numel() * t.element_size() for t in c)
        elif isinstance(c, Ragged):
            total += c.nbytes + c.offsets.numel() * 8
        else:
            total += c.numel() * c.element_size()
    return total


def buffers(cols: dict[str, Any], chunk: int) -> list[memoryview]:
    """The raw buffers of a workload, as zero-copy frames of at most ``chunk`` bytes."""
    out = []
    for c in packed(cols).values():
        parts = [c.values, c.offsets] if isinstance(c, Ragged) else [c]
        for t in parts:
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().data
            out += [raw[i : i + chunk] for i in range(0, raw.nbytes, chunk)]
    return out


# -- raw ZeroMQ ceiling ------------------------------------------------------------------------
def _echo_server(address_q: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address_q.put(f"tcp://127.0.0.1:{port}")
    stored: list[Any] = []
    while True:
        msg = sock.recv_multipart(copy=False)
        ident, kind = msg[0], msg[1].bytes
        if kind == b"put":
            stored = msg[2:]
            sock.send_multipart([ident, b"ok"])
        elif kind == b"get":
            sock.send_multipart([ident, *stored], copy=False)
        else:
            break
    sock.close(0)
    ctx.term()


def repeats(cols: dict[str, Any], repeat: int) -> int:
    """Small payloads are cheap to repeat and noisier: every system gets more tries."""
    return repeat if nbytes(cols) > 64 << 20 else repeat * 6


def raw_zmq(cases: dict[str, dict[str, Any]], repeat: int) -> dict[str, float]:
    ctx_mp = mp.get_context("spawn")
    q = ctx_mp.Queue()
    proc = ctx_mp.Process(target=_echo_server, args=(q,), daemon=True)
    proc.start()
    address = q.get(timeout=60)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    out = {}
    try:
        for name, cols in cases.items():
            # The ceiling: the best of small (8 MiB) frames and TransferQueue's own chunking.
            best = []
            for chunk in sorted({8 << 20, CHUNK_BYTES}):
                frames = buffers(cols, chunk)

                def cycle(frames: list[memoryview] = frames) -> None:
                    sock.send_multipart([b"put", *frames], copy=False)
                    sock.recv_multipart()
                    sock.send(b"get")
                    back = sock.recv_multipart(copy=False)
                    assert len(back) == len(frames)

                best.append(timeit(cycle, warmup=1, repeat=repeats(cols, repeat))["best_s"])
            out[name] = min(best)
        sock.send(b"stop")
    finally:
        sock.close(0)
        ctx.term()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return out


# -- TransferQueue -----------------------------------------------------------------------------
def tq_service(
    units: int,
    cases: dict[str, dict[str, Any]],
    repeat: int,
    *,
    shm: bool = True,
    replicas: int = 1,
) -> dict[str, float]:
    out = {}
    with (
        transferqueue.serve(num_units=units, replicas=replicas) as svc,
        transferqueue.connect(svc.address, shm_max_bytes=SHM_MAX_BYTES if shm else 0) as tq,
    ):
        client = tq.client()
        for name, cols in cases.items():
            rows = len(next(iter(cols.values())))
            client.declare_tasks([name], partition=name)  # rows are freed after each get

            unbind = any(isinstance(c, list) for c in cols.values())

            def cycle(
                cols: dict[str, Any] = cols,
                rows: int = rows,
                name: str = name,
                unbind: bool = unbind,
            ) -> None:
                client.put(cols, group=0, partition=name)
                meta = client.get_meta(name, list(cols), rows, partition=name, timeout_s=60)
                got = client.get_data(meta)
                if unbind:  # hand back what was given: one tensor per sequence (views)
                    for c in got.values():
                        assert isinstance(c, Ragged)
                        c.unbind()
                client.ack(meta)

            out[name] = timeit(cycle, warmup=2, repeat=repeats(cols, repeat))["best_s"]
    return out


def wire_meta_rate(batch: int, seconds: float) -> float:
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        for _ in range(16):  # 800k rows queued for the task
            client.put({"x": torch.zeros(50_000, dtype=torch.int64)}, group=0)
        for _ in range(20):
            client.ack(client.get_meta("t", ["x"], batch, timeout_s=5))
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            client.ack(client.get_meta("t", ["x"], batch, timeout_s=5))
            n += batch
        return n / (time.perf_counter() - t0)


# -- Ray object store --------------------------------------------------------------------------
class _Store:
    def __init__(self) -> None:
        self.cols: Any = None

    def put(self, cols: Any) -> bool:
        self.cols = cols
        return True

    def get(self) -> Any:
        return self.cols


def ray_store(cases: dict[str, dict[str, Any]], repeat: int) -> dict[str, float] | None:
    try:
        import ray
    except ImportError:
        return None
    for k, v in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }.items():
        os.environ.setdefault(k, v)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out = {}
    try:
        store: Any = ray.remote(num_cpus=0)(_Store).remote()
        for name, cols in cases.items():
            # Ray cannot serialize our Ragged type natively: hand it the tensors it is made of.
            plain = {
                k: (v.values, v.offsets) if isinstance(v, Ragged) else v for k, v in cols.items()
            }

            def cycle(plain: dict[str, Any] = plain) -> None:
                ray.get(store.put.remote(plain))
                ray.get(store.get.remote())

            out[name] = timeit(cycle, warmup=1, repeat=repeats(cols, repeat))["best_s"]
    finally:
        ray.shutdown()
    return out


# -- report ------------------------------------------------------------------------------------
def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(results["bytes"])
    systems = [s for s in results["GBps"] if results["GBps"][s]]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(systems)
    for k, sys_name in enumerate(systems):
        vals = [results["GBps"][sys_name].get(c, 0.0) for c in cases]
        ax.bar(np.arange(len(cases)) + k * width, vals, width, label=sys_name)
    ax.set_xticks(np.arange(len(cases)) + width * (len(systems) - 1) / 2, cases)
    ax.set_ylabel("put + get GB/s (higher is better)")
    ax.set_title(
        "TransferQueue service vs raw ZeroMQ and Ray object store, one host\n"
        "(transferqueue: shared memory with same-host units; frames: ZeroMQ only)",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def replicas_cost(cases: dict[str, dict[str, Any]], repeat: int) -> None:
    """put+get GB/s with one and with two copies of each row (4 units), in one run."""
    sizes = {k: nbytes(v) for k, v in cases.items()}
    gbps: dict[str, dict[str, float]] = {}
    for variant, shm in (("", True), (" frames", False)):
        for copies in (1, 2):
            name = f"transferqueue 4 units replicas={copies}{variant}"
            times = tq_service(4, cases, repeat, shm=shm, replicas=copies)
            gbps[name] = {c: sizes[c] / t / 1e9 for c, t in times.items()}
            for case, v in gbps[name].items():
                line(f"{name}: {case} ({sizes[case] / 1e6:.0f} MB)", v, "GB/s")
    ratios = {}
    for variant in ("", " frames"):
        one, two = (gbps[f"transferqueue 4 units replicas={k}{variant}"] for k in (1, 2))
        for c in cases:
            ratios[f"replicas=2 vs 1{variant}: {c}"] = two[c] / one[c]
    for k, v in ratios.items():
        line(f"ratio {k}", v, "x")
    write_json("throughput_replicas", {"bytes": sizes, "GBps": gbps, "ratios": ratios})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--replicas", action="store_true", help="only the cost of replicas=2")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        cases = {"dense": dense_case(256, 8192, 9), "ragged": ragged_case(64, 128, 4096)}
    else:
        cases = {"dense": dense_case(1024, 8192, 9), "ragged": ragged_case(256, 128, 4096)}
    cases["ragged-seqs"] = as_sequences(cases["ragged"])
    if args.replicas:
        replicas_cost(cases, args.repeat)
        return
    sizes = {k: nbytes(v) for k, v in cases.items()}
    times: dict[str, dict[str, float] | None] = {}
    runs: list[tuple[str, Callable[[], dict[str, float] | None]]] = [
        ("raw zmq", lambda: raw_zmq(cases, args.repeat)),
        ("transferqueue 1 unit", lambda: tq_service(1, cases, args.repeat)),
        ("transferqueue 4 units", lambda: tq_service(4, cases, args.repeat)),
        ("transferqueue 1 unit frames", lambda: tq_service(1, cases, args.repeat, shm=False)),
        ("transferqueue 4 units frames", lambda: tq_service(4, cases, args.repeat, shm=False)),
    ]
    if not args.no_ray:
        runs.append(("ray object store", lambda: ray_store(cases, args.repeat)))
    for name, fn in runs:
        times[name] = fn()
        for case, t in (times[name] or {}).items():
            line(f"{name}: {case} ({sizes[case] / 1e6:.0f} MB)", sizes[case] / t / 1e9, "GB/s")
    gbps = {s: {c: sizes[c] / t / 1e9 for c, t in (ts or {}).items()} for s, ts in times.items()}
    ratios: dict[str, float] = {}
    for units in ("1 unit", "4 units"):
        for variant in ("", " frames"):
            tq = gbps[f"transferqueue {units}{variant}"]
            ratios[f"{units}{variant}: dense vs raw zmq"] = tq["dense"] / gbps["raw zmq"]["dense"]
            if gbps.get("ray object store"):
                for c in cases:
                    ratios[f"{units}{variant}: {c} vs ray"] = tq[c] / gbps["ray object store"][c]
    for k, v in ratios.items():
        target = ">=0.6" if "raw zmq" in k else ">=3"
        line(f"ratio {k}", v, "x", target=target)
    rate = wire_meta_rate(64, 3.0 if not args.quick else 1.0)
    line("get_meta+ack over the wire (batch 64)", rate, "samples/s", target=">=20000")
    results = {
        "bytes": sizes,
        "seconds": times,
        "GBps": gbps,
        "ratios": ratios,
        "wire_get_meta_ack_samples_per_s": rate,
    }
    write_json("throughput", results)
    plot(results, str(RESULTS_DIR / "throughput.png"))


if __name__ == "__main__":
    main()
