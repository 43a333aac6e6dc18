"""``bench.load``'s clients against the peer (PyPI ``transferqueue`` 0.1.11), run as its users do.

Runs in the peer's own virtualenv (``python -m bench.peer --setup`` builds it) and imports the
peer, numpy and torch, nothing of ours; ``bench/load_peer_run.py`` starts it from our side::

    bench/.peer-venv/bin/python -m bench.load_peer --clients 64 --procs 4 --batch 8 \\
        --phases '{"paced": [1.5625, 8], "saturated": [0, 8]}'

This process is the peer's first process: Ray started here (2 logical CPUs: the controller
and the storage unit each ask for one), ``transfer_queue.init()`` with its default config but
one SimpleStorage unit (``bench.load`` runs one unit). The clients live in ``--procs`` worker
processes (this module with ``--worker``). A client in another process joins the peer the way
its own ``init()`` makes one there: an ``AsyncTransferQueueClient`` on the controller's
``zmq_info`` plus ``initialize_storage_manager`` with the backend's config, the config the
controller hands out (``get_config``), which this process passes to its workers pickled. Each
client is a separate ``AsyncTransferQueueClient`` (its own ZeroMQ context, sockets, storage
manager and handshake with the controller), all of a worker's clients on one event loop, each
context with one I/O thread (its ``zmq_io_threads``; the default, 8, would put 8 threads per
client in a process holding a thousand).

Every client runs ``bench.load``'s cycle: ``async_put`` of ``batch`` rows of ``stamp``
(int64 ``[batch, 4]`` = client, phase, cycle, row) -> ``async_get_meta`` (task ``load``,
``batch`` rows, the same partition) -> ``async_get_data`` -> ``async_clear_samples`` (the
peer's release of consumed rows; ``ack`` in the figures), half of the clients on one shared
partition, half on a partition of their own; ``paced`` phases offer a rate per client,
``saturated`` ones run each client as fast as it can. Each call is bounded
(``CALL_TIMEOUT_S``); after the phases every partition's rows still held are read
(``force_fetch``) and each stamp must have been read exactly once. Prints one JSON line (the
result, or ``{"error": ..., "stage": ...}``) on stdout; the peer's own logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

for _k, _v in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    # the peer's per-call torch thread cap, at this machine's cores (its default, 8, logs a
    # warning on every put where there are fewer)
    "TQ_NUM_THREADS": str(min(8, os.cpu_count() or 1)),
}.items():
    os.environ.setdefault(_k, _v)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from bench.load_checks import exactly_once, servers_memory  # noqa: E402  (stdlib only)

CALLS = ("put", "get_meta", "get_data", "ack")
TASK = "load"
UNITS = 1
IO_THREADS = 1  # per client's ZeroMQ context (the peer's zmq_io_threads)
CONNECTING = 64  # clients being constructed at once per worker (each handshakes)
CALL_TIMEOUT_S = 60.0  # one call of one client
CONNECT_TIMEOUT_S = 600.0  # a worker's connect of all its clients
ERRORS_KEPT = 5


# --- the worker process: many of the peer's async clients on one event loop -------------


def _stamps(col: torch.Tensor) -> list[list[int]]:
    """The ``stamp`` rows read back (the peer may return a field as a nested tensor)."""
    if col.is_nested:
        col = torch.stack([r.reshape(-1) for r in col.unbind()])
    return col.reshape(-1, 4).tolist()


async def _bounded(call: Any, what: str, cid: int) -> Any:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            return await call
    except TimeoutError:
        raise TimeoutError(
            f"client {cid}: {what} gave no answer within {CALL_TIMEOUT_S:g} s"
        ) from None


async def _client(
    client: Any,
    cid: int,
    batch: int,
    window: tuple[float, float],
    rate: float,
    phase_no: int,
    lat: dict[str, list[float]],
) -> dict[str, Any]:
    partition = "shared" if cid % 2 == 0 else f"own-{cid}"
    x = torch.zeros((batch, 4), dtype=torch.int64)  # (client, phase, cycle, row)
    x[:, 0] = cid
    x[:, 1] = phase_no
    x[:, 3] = torch.arange(batch)
    cycles, stamps = 0, []
    start, until = window
    phase = (cid * 0.618034) % 1.0  # paced: the clients' cycles spread evenly, as bench.load
    while time.monotonic() < until:
        if rate > 0:
            due = start + (cycles + phase) / rate
            if due >= until:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        x[:, 2] = cycles
        data = TensorDict({"stamp": x.clone()}, batch_size=batch)
        t0 = time.perf_counter()
        await _bounded(client.async_put(data=data, partition_id=partition), "put", cid)
        t1 = time.perf_counter()
        meta = await _bounded(
            client.async_get_meta(
                data_fields=["stamp"], batch_size=batch, partition_id=partition, task_name=TASK
            ),
            "get_meta",
            cid,
        )
        t2 = time.perf_counter()
        if meta.size != batch:
            raise RuntimeError(f"client {cid}: get_meta gave {meta.size} rows, asked {batch}")
        got = await _bounded(client.async_get_data(meta), "get_data", cid)
        t3 = time.perf_counter()
        await _bounded(client.async_clear_samples(meta), "clear_samples", cid)
        t4 = time.perf_counter()
        for name, a, b in zip(CALLS, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            lat[name].append(b - a)
        stamps.append(_stamps(got["stamp"]))
        cycles += 1
    return {"cid": cid, "cycles": cycles, "stamps": stamps, "end": time.monotonic()}


def _connect(conf: Any, cid: int) -> Any:
    from transfer_queue.client import AsyncTransferQueueClient

    client = AsyncTransferQueueClient(
        client_id=f"load-{cid}", controller_info=conf.controller.zmq_info, zmq_io_threads=IO_THREADS
    )
    backend = conf.backend.storage_backend
    client.initialize_storage_manager(manager_type=backend, config=conf.backend[backend])
    return client


async def _worker(
    out: Any, conf_path: str, first: int, count: int, batch: int, phases: list[list[Any]]
) -> None:
    """``count`` clients, then one phase per ``(name, rate, seconds)``, each started at the
    parent's signal (a monotonic time on stdin); one JSON line per step on ``out``."""
    with open(conf_path, "rb") as f:
        conf = pickle.load(f)  # (written by our own parent process)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CONNECTING) as pool:
        clients = list(pool.map(lambda i: _connect(conf, first + i), range(count)))
    _send(out, {"connect_s": time.perf_counter() - t0})
    for phase_no, (_name, rate, seconds) in enumerate(phases):
        start = float(sys.stdin.readline())
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        lat: dict[str, list[float]] = {c: [] for c in CALLS}
        window = (start, start + float(seconds))
        jobs = [
            _client(c, first + i, batch, window, float(rate), phase_no, lat)
            for i, c in enumerate(clients)
        ]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        done = [r for r in results if isinstance(r, dict)]
        errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
        _send(
            out,
            {
                "clients": [{"cid": r["cid"], "cycles": r["cycles"]} for r in done],
                "stamps": [s for r in done for s in r["stamps"]],
                "latency": lat,
                "end": max([r["end"] for r in done], default=start),
                "failed_clients": len(errors),
                "errors": errors[:ERRORS_KEPT],
            },
        )
    for c in clients:
        c.close()


def _send(out: Any, msg: dict[str, Any]) -> None:
    out.write(json.dumps(msg) + "\n")
    out.flush()


# --- the peer's first process: Ray, the peer, the workers, the checks ---------------------


def _line(worker: subprocess.Popen[str], timeout_s: float, what: str) -> dict[str, Any]:
    assert worker.stdout is not None
    ready, _, _ = select.select([worker.stdout], [], [], timeout_s)
    raw = worker.stdout.readline() if ready else ""
    if not raw:
        why = f"sent nothing within {timeout_s:g} s" if not ready else f"exited ({worker.poll()})"
        raise RuntimeError(f"peer load worker {worker.pid} {why} during {what}")
    msg: dict[str, Any] = json.loads(raw)
    if "error" in msg:
        raise RuntimeError(f"peer load worker {worker.pid} during {what}: {msg['error']}")
    return msg


def _pid_stats(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    rss_mb = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return {"cpu_s": cpu_s, "rss_mb": rss_mb, "fds": float(len(os.listdir(f"/proc/{pid}/fd")))}


def _server_pids() -> dict[str, int]:
    """The controller's and the unit's process ids (Ray actors on this machine), or none
    where the peer does not tell them."""
    import ray
    import transfer_queue.interface as tqi

    def pid(actor: Any) -> int:
        return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))

    pids: dict[str, int] = {}
    try:
        pids["controller"] = pid(
            ray.get_actor("TransferQueueController", namespace="transfer_queue")
        )
        units = list((tqi._TQ_STORAGE or {}).get("SimpleStorage", {}).values())
        if units:
            pids["unit"] = pid(units[0])
    except Exception as e:  # the figures without them
        print(f"peer load: no server process ids ({type(e).__name__}: {e})", file=sys.stderr)
    return pids


def _phase(outs: list[dict[str, Any]], batch: int, seconds: float, start: float) -> dict[str, Any]:
    """One phase's figures. Rates are over the phase's real length: the window, or longer
    where the clients' last cycles (started in the window) ended after it; under a storm of
    clients a cycle can take longer than the window itself."""
    clients = [c for o in outs for c in o["clients"]]
    cycles = np.array([c["cycles"] for c in clients], dtype=float)
    lat = {c: np.array([x for o in outs for x in o["latency"][c]]) * 1e3 for c in CALLS}
    total = float(cycles.sum())
    elapsed = max(seconds, max(o["end"] for o in outs) - start)
    failed = sum(o["failed_clients"] for o in outs)
    return {
        "cycles": total,
        "cycles_per_s": total / elapsed,
        "rows_per_s": total * batch / elapsed,
        "window_s": seconds,
        "elapsed_s": elapsed,
        "latency_ms": {
            c: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
            for c, v in lat.items()
            if len(v)
        },
        "fairness_min_over_mean": float(cycles.min() / cycles.mean())
        if total and not failed
        else 0.0,
        "starved_clients": int((cycles == 0).sum()) + failed,
        "failed_clients": failed,
        "errors": [e for o in outs for e in o["errors"]][:ERRORS_KEPT],
    }


def _drain(client: Any) -> list[list[int]]:
    """What every partition still holds (rows put that no client read back)."""
    left: list[list[int]] = []
    for p in client.get_partition_list():
        meta = client.get_meta(
            data_fields=["stamp"], batch_size=1, partition_id=p, mode="force_fetch"
        )
        if meta.size:
            left.extend(_stamps(client.get_data(meta)["stamp"]))
    return left


def run(
    n: int, procs: int, batch: int, phases: list[list[Any]], stage: list[str]
) -> dict[str, Any]:
    """The peer with one unit and ``n`` clients over ``procs`` workers; ``stage`` names the
    step under way (for the error entry when one fails)."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    procs = max(1, min(procs, n))
    workers: list[subprocess.Popen[str]] = []
    conf_path = ""
    stage[0] = "start"
    ray.init(address="local", num_cpus=UNITS + 1, include_dashboard=False, log_to_driver=False)
    try:
        conf = tq.init(
            OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": UNITS}}})
        )
        pids = _server_pids()
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump(conf, f)
            conf_path = f.name
        stage[0] = f"connect of {n} clients"
        first = 0
        for i in range(procs):
            count = n // procs + (1 if i < n % procs else 0)
            cmd = [sys.executable, "-m", "bench.load_peer", "--worker", conf_path, str(first)]
            cmd += [str(count), str(batch), json.dumps(phases)]
            workers.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
            first += count
        before = {role: _pid_stats(pid) for role, pid in pids.items()}
        t0 = time.perf_counter()
        for w in workers:
            _line(w, CONNECT_TIMEOUT_S, stage[0])
        connect_s = time.perf_counter() - t0
        os.unlink(conf_path)
        conf_path = ""
        connected = {role: _pid_stats(pid) for role, pid in pids.items()}
        res: dict[str, Any] = {
            "deploy": "peer",
            "system": f"transferqueue {tq.__version__} (PyPI), ray {ray.__version__}",
            "clients": n,
            "procs": procs,
            "connect_s": connect_s,
            "phases": {},
        }
        written: set[tuple[int, ...]] = set()
        stamps: list[tuple[int, ...]] = []
        for phase_no, (name, rate, seconds) in enumerate(phases):
            stage[0] = f"phase {name}"
            idle = {role: _pid_stats(pid) for role, pid in pids.items()}
            start = time.monotonic() + 0.5
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"{start}\n")
                w.stdin.flush()
            outs = [_line(w, seconds + 4 * CALL_TIMEOUT_S + 60, stage[0]) for w in workers]
            busy = {role: _pid_stats(pid) for role, pid in pids.items()}
            ph = _phase(outs, batch, float(seconds), start)
            ph["rate_per_client"] = float(rate)
            ph["servers"] = {
                role: {
                    "cpu_share": (busy[role]["cpu_s"] - idle[role]["cpu_s"]) / ph["elapsed_s"],
                    "rss_mb": busy[role]["rss_mb"],
                    "fds": busy[role]["fds"],
                }
                for role in pids
            }
            written |= {
                (c["cid"], phase_no, k, r)
                for o in outs
                for c in o["clients"]
                for k in range(c["cycles"])
                for r in range(batch)
            }
            stamps += [tuple(r) for o in outs for s in o["stamps"] for r in s]
            res["phases"][name] = ph
            if ph["failed_clients"]:
                res["error"] = f"{ph['failed_clients']} of {n} clients failed: {ph['errors'][0]}"
                res["stage"] = stage[0]
        stage[0] = "drain"
        for w in workers:
            if w.wait(timeout=120) != 0:
                raise RuntimeError(f"peer load worker {w.pid} exited with {w.returncode}")
        stamps += [tuple(r) for r in _drain(tq.get_client())]
        res["exactly_once"] = exactly_once(written, stamps)
        res["servers"] = servers_memory(before, connected, {r: r for r in pids}, n)
        return res
    finally:
        if conf_path:
            os.unlink(conf_path)
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(30)
        try:
            tq.close()
        finally:
            ray.shutdown()


def _on_term(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: tq.close, ray.shutdown


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    # JSON goes to the real stdout; anything the peer or Ray prints goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    torch.set_num_threads(1)
    if args_in[:1] == ["--worker"]:
        conf_path, first, count, batch, phases = args_in[1:6]
        try:
            asyncio.run(
                _worker(out, conf_path, int(first), int(count), int(batch), json.loads(phases))
            )
        except BaseException as e:
            _send(out, {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
            return 1
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, required=True)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--phases",
        required=True,
        help="JSON {name: [cycles/s per client (0: as fast as it can), seconds]}",
    )
    args = ap.parse_args(args_in)
    spec = [[name, float(r), float(s)] for name, (r, s) in json.loads(args.phases).items()]
    signal.signal(signal.SIGTERM, _on_term)
    stage = ["start"]
    try:
        res = run(args.clients, args.procs, args.batch, spec, stage)
    except BaseException as e:
        print(traceback.format_exc(), file=sys.stderr)
        res = {
            "deploy": "peer",
            "clients": args.clients,
            "procs": args.procs,
            "error": f"{type(e).__name__}: {e}",
            "stage": stage[0],
        }
    _send(out, res)
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
