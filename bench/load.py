"""Many concurrent clients on one TransferQueue service: throughput, latency, fairness, the
servers' CPU, memory and descriptors, and exactly-once, as the number of clients grows.

    python -m bench.load                          # N = 64, 512, 4096 clients, local and Ray
    python -m bench.load --clients 64,256 --seconds 5 --procs 2 --deploy local   # a smoke test

Each client is a connected handle of its own (``transferqueue.connect``: its own connections
to the controller and the unit, its own lease holder), an async client; the clients are
spread over ``--procs`` worker processes (8), in each of which they share one event loop
thread (``connect(shared_loop=True)``), the ZeroMQ context, the liveness watch of each server
and one holders' heartbeat. The clients of a worker connect all at once (64 connects in
flight per worker: a connection storm). Every client runs cycles of ``put`` (``--batch`` rows
of a small dense field that names the client and the cycle) -> ``get_meta`` -> ``get_data``
-> ``ack``, half of them on one shared partition whose task all of them consume (so a row
written by one client may be read by any other), half on a partition of their own (up to 512
such partitions: at 4,096 clients, four clients share each, as the controller keeps at most
1,024 tasks, ``transferqueue.limits``). Each client runs one cycle before the phases (its
first calls open its connection to the unit and start its holder's heartbeat). After the
phases every partition is finished and drained, and each row's (client, phase, cycle, row)
stamp must have been read exactly once by its partition's task: the bench fails loudly
otherwise.

Two phases per N on the same connected clients: ``paced`` offers ``--offered`` cycles/s
spread over all clients for ``--seconds`` (each client ``offered / N``: latency under a load
the service can carry, however many clients share it), then ``saturated``, every client as
fast as it can, for ``--seconds`` or long enough for about 8 cycles per client, whichever is
longer (the service's throughput, and each client's share of it; latency there is queueing,
N over the throughput). Printed per phase: cycles/s, p50 / p99 of each call, the clients',
the controller's and the unit's share of a core; saturated, the slowest client's cycles over
the mean (fairness); per N, the servers' resident memory, memory per client and open
descriptors with every client connected, and the time to connect them all. The clients share
the machine's cores with the service. Goals (no collapse under load): saturated throughput
at the largest N at least 0.8x that at the smallest, ``get_meta`` p99 under 50 ms at the
largest N paced, every row read exactly once. JSON: ``bench/results/load.json``; plot:
``bench/results/load.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import math
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, line, write_json

CALLS = ("put", "get_meta", "get_data", "ack")
THROUGHPUT_GOAL = 0.8
P99_GOAL_MS = 50.0
FAIRNESS_GOAL = 0.25  # the slowest client's saturated cycles over the mean, at every N
WARM_PHASE = 99  # the phase number in the stamps of each client's first cycle
SATURATED_CYCLES = 8  # cycles per client the saturated phase is sized for (fairness)
SATURATED_GUESS = 1000.0  # cycles/s over all clients, to size it (measured: 850-1,050)
OWN_PARTITIONS = 512  # (at 4,096 clients: four clients to a partition "of their own")
CONNECTING = 64  # connects in flight at once per worker process
WORKER_TIMEOUT_S = 600.0  # a worker's connect of all its clients, or its report after a phase


# --- the worker process: many clients on one event loop ---------------------------------


def _partition_of(cid: int) -> str:
    """Even clients share one partition; odd ones have partitions of their own, one per
    client up to ``OWN_PARTITIONS`` of them, then shared round-robin (a controller keeps at
    most ``MAX_TASKS`` tasks: each tracks every row slot of the store)."""
    return "shared" if cid % 2 == 0 else f"own-{(cid // 2) % OWN_PARTITIONS}"


async def _client(
    tq: Any,
    cid: int,
    partition: str,
    batch: int,
    window: tuple[float, float],
    rate: float,
    phase_no: int,
    lat: dict[str, list[float]],
    most: int | None = None,
) -> dict[str, Any]:
    """One client's cycles in ``window`` (at most ``most``), their latencies into ``lat``."""
    client = tq.async_client()
    cycles, stamps = 0, []
    x = np.zeros((batch, 4), dtype=np.int64)  # (client, phase, cycle, row): unique per row
    x[:, 0] = cid
    x[:, 1] = phase_no
    x[:, 3] = np.arange(batch)
    start, until = window
    # paced: cycle k starts at start + (k + phase) / rate, the phases spread evenly
    phase = (cid * 0.618034) % 1.0
    while time.monotonic() < until and (most is None or cycles < most):
        if rate > 0:
            due = start + (cycles + phase) / rate
            if due >= until:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        x[:, 2] = cycles
        t0 = time.perf_counter()
        await client.put({"stamp": x.copy()}, partition=partition)
        t1 = time.perf_counter()
        meta = await client.get_meta("load", ["stamp"], batch, partition=partition, timeout_s=60)
        t2 = time.perf_counter()
        cols = await client.get_data(meta)
        t3 = time.perf_counter()
        await client.ack(meta)
        t4 = time.perf_counter()
        for name, a, b in zip(CALLS, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            lat[name].append(b - a)
        stamps.append(np.asarray(cols["stamp"]).tolist())
        cycles += 1
    return {"cid": cid, "cycles": cycles, "stamps": stamps}


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


async def _worker_main(
    address: str, first: int, count: int, batch: int, rates: list[float]
) -> None:
    """``count`` clients, one phase per rate (0: as fast as they can), each as long as the
    parent says, all starting at its signal; one JSON line per phase on stdout."""
    import transferqueue

    t_connect = time.perf_counter()
    # all at once (a connection storm): every client's connect in flight together
    with concurrent.futures.ThreadPoolExecutor(CONNECTING) as pool:
        handles = list(
            pool.map(
                lambda _: transferqueue.connect(address, call_timeout_s=120.0, shared_loop=True),
                range(count),
            )
        )
    connect_s = time.perf_counter() - t_connect
    # one cycle each before the phases: a client's first calls also open its connection to
    # the unit and start its holder's heartbeat; the phases time clients in their stride
    warm = await asyncio.gather(
        *(
            tq.run_async(
                _client(
                    tq,
                    first + i,
                    _partition_of(first + i),
                    batch,
                    (0.0, math.inf),
                    0.0,
                    WARM_PHASE,
                    {c: [] for c in CALLS},
                    most=1,
                )
            )
            for i, tq in enumerate(handles)
        )
    )
    print(
        json.dumps(
            {
                "connect_s": connect_s,
                "warm_s": time.perf_counter() - t_connect - connect_s,
                "stamps": [s for r in warm for s in r["stamps"]],
            }
        ),
        flush=True,
    )
    for phase_no, rate in enumerate(rates):
        # the parent's common start (monotonic clock) and the phase's length
        start, seconds = (float(x) for x in sys.stdin.readline().split())
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        lat: dict[str, list[float]] = {c: [] for c in CALLS}
        jobs = []
        for i, tq in enumerate(handles):
            cid = first + i
            partition = _partition_of(cid)
            # each client runs on its handle's own event loop, as a program whose work is
            # mostly TransferQueue calls does (run_async): its calls then hop no thread
            client = _client(
                tq, cid, partition, batch, (start, start + seconds), rate, phase_no, lat
            )
            jobs.append(tq.run_async(client))
        cpu0 = _cpu_s()
        results = await asyncio.gather(*jobs)
        print(
            json.dumps(
                {
                    "cpu_s": _cpu_s() - cpu0,
                    "clients": [{"cid": r["cid"], "cycles": r["cycles"]} for r in results],
                    "stamps": [s for r in results for s in r["stamps"]],
                    "latency": {c: lat[c] for c in CALLS},
                }
            ),
            flush=True,
        )
    os._exit(0)  # (the parent has every figure; closing a thousand handles one by one is slow)


# --- the parent: the service, the workers, the checks ------------------------------------


def _proc_stats(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / tick
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"cpu_s": cpu_s, "rss_mb": rss / 2**20, "fds": fds}


def _line(worker: subprocess.Popen[str], timeout_s: float) -> Any:
    """The worker's next JSON line, within ``timeout_s`` (a worker that hangs or dies fails
    the bench naming it, never blocks it)."""
    assert worker.stdout is not None
    line_, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([worker.stdout], [], [], 1.0)
        if ready:
            line_ = worker.stdout.readline()
            break
        if worker.poll() is not None:
            break
    if not line_:
        worker.kill()
        raise RuntimeError(
            f"load worker {worker.pid} sent nothing within {timeout_s:g} s "
            f"(exit code {worker.poll()}); its error is printed above"
        )
    return json.loads(line_)


def _drain(tq: Any, partitions: list[str]) -> list[list[int]]:
    """Finish every partition and read what is left for the task (rows put in the window's
    last cycles that no client read back)."""
    client = tq.client()
    left: list[list[int]] = []
    for p in partitions:
        client.finish(p)
        for meta, cols in client.stream(task="load", fields=["stamp"], batch_size=256, partition=p):
            left.extend(np.asarray(cols["stamp"]).tolist())
            del meta
    return left


def _phase(outs: list[dict[str, Any]], batch: int, seconds: float, phase_no: int) -> dict[str, Any]:
    """One phase's figures from the workers' reports; its rows read are in ``stamps``."""
    clients = [c for o in outs for c in o["clients"]]
    cycles = np.array([c["cycles"] for c in clients], dtype=float)
    lat = {c: np.array([x for o in outs for x in o["latency"][c]]) * 1e3 for c in CALLS}
    total = float(cycles.sum())
    return {
        "cycles": total,
        "cycles_per_s": total / seconds,
        "rows_per_s": total * batch / seconds,
        "latency_ms": {
            c: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))}
            for c, v in lat.items()
            if len(v)
        },
        "fairness_min_over_mean": float(cycles.min() / cycles.mean()) if total else 0.0,
        "clients_cpu_share": sum(o["cpu_s"] for o in outs) / seconds,
        "starved_clients": int((cycles == 0).sum()),
        "written": {
            (c["cid"], phase_no, k, r)
            for c in clients
            for k in range(c["cycles"])
            for r in range(batch)
        },
    }


@contextlib.contextmanager
def _service(deploy: str) -> Iterator[tuple[str, int, int]]:
    """A service of one unit: ``local`` (``transferqueue.serve``: processes of its own) or
    ``ray`` (``launch_on_ray``: Ray actors, on the cluster :func:`main` started); yields its
    address and the controller's and the unit's process ids."""
    import transferqueue

    if deploy == "local":
        with transferqueue.serve(num_units=1) as svc:
            yield svc.address, svc.pids[-1], svc.pids[0]  # (units start first)
        return
    import ray

    from transferqueue.deploy.ray import launch_on_ray

    start = launch_on_ray(num_units=1, spread=False)
    handle = start.handle()
    try:
        ctl, unit = start.actors[-1], start.actors[0]
        address, ctl_pid, unit_pid = ray.get(
            [ctl.address.remote(), ctl.pid.remote(), unit.pid.remote()], timeout=120
        )
        yield str(address), int(ctl_pid), int(unit_pid)
    finally:
        handle.close()


def run_case(
    n: int,
    procs: int,
    batch: int,
    phases: dict[str, tuple[float, float]],
    deploy: str = "local",
) -> dict[str, Any]:
    """One service (``deploy``: ``local`` or ``ray``) and ``n`` clients over ``procs``
    workers, then one phase of ``seconds`` per entry of ``rates``: cycles per second per
    client, 0 for as fast as each can (the service's saturation throughput)."""
    import transferqueue

    procs = max(1, min(procs, n))
    with _service(deploy) as (address, ctl, unit):
        setup = transferqueue.connect(address)
        partitions = sorted({_partition_of(c) for c in range(n)})
        sc = setup.client()
        for p in partitions:
            sc.declare_tasks(["load"], partition=p)
        before = {pid: _proc_stats(pid) for pid in (ctl, unit)}
        workers = []
        first = 0
        for i in range(procs):
            count = n // procs + (1 if i < n % procs else 0)
            cmd = [sys.executable, "-m", "bench.load", "--worker", address, str(first)]
            cmd += [str(count), str(batch), ",".join(str(r) for r, _ in phases.values())]
            workers.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
            first += count
        stamps: list[tuple[int, ...]] = []
        written: set[tuple[int, ...]] = set()
        connect_s = warm_s = 0.0
        for w in workers:
            hello = _line(w, WORKER_TIMEOUT_S)  # connected, one cycle each done
            stamps += [tuple(r) for s in hello["stamps"] for r in s]
            connect_s = max(connect_s, hello["connect_s"])
            warm_s = max(warm_s, hello["warm_s"])
        written |= {(c, WARM_PHASE, 0, r) for c in range(n) for r in range(batch)}
        connected = {pid: _proc_stats(pid) for pid in (ctl, unit)}  # every client connected
        res: dict[str, Any] = {
            "deploy": deploy,
            "clients": n,
            "procs": procs,
            "connect_s": connect_s,
            "first_cycle_s": warm_s,
            "phases": {},
        }
        for phase_no, (name, (rate, seconds)) in enumerate(phases.items()):
            idle = {pid: _proc_stats(pid) for pid in (ctl, unit)}
            start = time.monotonic() + 0.5
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"{start} {seconds}\n")
                w.stdin.flush()
            outs = []
            for w in workers:
                outs.append(_line(w, seconds + WORKER_TIMEOUT_S))
            busy = {pid: _proc_stats(pid) for pid in (ctl, unit)}
            ph = _phase(outs, batch, seconds, phase_no)
            written |= ph.pop("written")
            stamps += [tuple(r) for o in outs for s in o["stamps"] for r in s]
            ph["rate_per_client"] = rate
            ph["seconds"] = seconds
            ph["servers"] = {
                role: {
                    "cpu_s_per_1k_cycles": (busy[pid]["cpu_s"] - idle[pid]["cpu_s"])
                    / max(ph["cycles"], 1)
                    * 1e3,
                    "cpu_share": (busy[pid]["cpu_s"] - idle[pid]["cpu_s"]) / seconds,
                    "rss_mb": busy[pid]["rss_mb"],
                }
                for role, pid in (("controller", ctl), ("unit", unit))
            }
            res["phases"][name] = ph
        for w in workers:
            if w.wait(timeout=120) != 0:
                raise RuntimeError(f"a load worker exited with {w.returncode}")
        stamps += [tuple(r) for r in _drain(setup, partitions)]
        setup.close()
    seen: dict[tuple[int, ...], int] = {}
    for stamp in stamps:
        seen[stamp] = seen.get(stamp, 0) + 1
    res["exactly_once"] = {
        "written": len(written),
        "twice": sum(1 for v in seen.values() if v > 1),
        "missing": len(written - set(seen)),
        "extra": len(set(seen) - written),
    }
    res["servers"] = {
        role: {
            "rss_mb_before_clients": before[pid]["rss_mb"],
            "rss_mb": connected[pid]["rss_mb"],
            "fds": connected[pid]["fds"],
            "kb_per_client": (connected[pid]["rss_mb"] - before[pid]["rss_mb"]) * 1024 / n,
        }
        for role, pid in (("controller", ctl), ("unit", unit))
    }
    return res


def _print_case(r: dict[str, Any]) -> None:
    n, deploy = r["clients"], r.get("deploy", "local")
    for name, ph in r["phases"].items():
        lm = ph["latency_ms"]
        line(
            f"load {n} clients [{deploy}], {name}",
            ph["cycles_per_s"],
            "cycles/s",
            get_meta_p50_ms=lm["get_meta"]["p50"],
            get_meta_p99_ms=lm["get_meta"]["p99"],
            put_p99_ms=lm["put"]["p99"],
            **(
                {"achieved_over_offered": ph["cycles_per_s"] / (ph["rate_per_client"] * n)}
                if ph["rate_per_client"]
                else {"fairness": ph["fairness_min_over_mean"]}
            ),
            clients_cpu=ph["clients_cpu_share"],
            ctl_cpu=ph["servers"]["controller"]["cpu_share"],
            unit_cpu=ph["servers"]["unit"]["cpu_share"],
        )
    for role, sv in r["servers"].items():
        line(
            f"  {role} with {n} clients connected [{deploy}]",
            sv["rss_mb"],
            "MB RSS",
            kb_per_client=sv["kb_per_client"],
            fds=sv["fds"],
        )
    eo = r["exactly_once"]
    ok = eo["twice"] == eo["missing"] == eo["extra"] == 0
    print(
        f"  exactly once: {eo['written']} rows, {eo['twice']} twice, {eo['missing']} missing,"
        f" {eo['extra']} unknown: {'ok' if ok else 'FAILED'}; "
        f"connect {r['connect_s']:.1f} s, first cycles "
        f"{r.get('first_cycle_s', 0.0):.1f} s",
        flush=True,
    )


def _plot(cases: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for deploy in dict.fromkeys(c.get("deploy", "local") for c in cases):
        mine = [c for c in cases if c.get("deploy", "local") == deploy]
        n = [c["clients"] for c in mine]
        for name in mine[0]["phases"]:
            a.plot(
                n, [c["phases"][name]["rows_per_s"] for c in mine], "-o", label=f"{name} [{deploy}]"
            )
            b.plot(
                n,
                [c["phases"][name]["latency_ms"]["get_meta"]["p99"] for c in mine],
                "-o" if name == "paced" else ":x",
                label=f"get_meta p99, {name} [{deploy}]",
            )
    a.set(xscale="log", xlabel="concurrent clients", ylabel="rows/s", title="throughput")
    a.legend(fontsize=8)
    b.axhline(P99_GOAL_MS, color="grey", ls="--", lw=1)
    b.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        address, first, count, batch, rates = args_in[1:6]
        try:
            asyncio.run(
                _worker_main(
                    address,
                    int(first),
                    int(count),
                    int(batch),
                    [float(r) for r in rates.split(",")],
                )
            )
        except BaseException:  # (at once: closing a thousand handles one by one takes long)
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", default="64,512,4096", help="comma-separated client counts")
    ap.add_argument("--procs", type=int, default=8, help="worker processes the clients share")
    ap.add_argument("--batch", type=int, default=8, help="rows per put and per get_meta")
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each phase")
    ap.add_argument(
        "--offered",
        type=float,
        default=100.0,
        help="the paced phase's cycles/s over all clients (each client offered/N)",
    )
    ap.add_argument(
        "--deploy",
        choices=["local", "ray", "both"],
        default="both",
        help="the service's servers as processes of its own, as Ray actors, or both",
    )
    args = ap.parse_args(args_in)
    counts = [int(c) for c in args.clients.split(",")]
    deploys = ["local", "ray"] if args.deploy == "both" else [args.deploy]
    cases: list[dict[str, Any]] = []
    goals: dict[str, bool] = {}
    ratios: dict[str, float] = {}
    for deploy in deploys:
        if deploy == "ray":
            from bench.rl_ray import start_ray, stop_ray

            start_ray(num_cpus=2)
        try:
            mine = []
            for n in counts:
                # saturated: long enough for each client's share to be measured (about
                # SATURATED_CYCLES cycles each at SATURATED_GUESS cycles/s over all clients)
                saturated_s = max(args.seconds, n * SATURATED_CYCLES / SATURATED_GUESS)
                phases = {
                    "paced": (args.offered / n, args.seconds),
                    "saturated": (0.0, saturated_s),
                }
                r = run_case(n, args.procs, args.batch, phases, deploy)
                _print_case(r)
                mine.append(r)
        finally:
            if deploy == "ray":
                stop_ray()
        cases += mine
        sat = [c["phases"]["saturated"]["rows_per_s"] for c in mine]
        ratios[deploy] = sat[-1] / sat[0]
        p99 = mine[-1]["phases"]["paced"]["latency_ms"]["get_meta"]["p99"]
        goals[
            f"saturated throughput at {counts[-1]} >= {THROUGHPUT_GOAL}x at {counts[0]} [{deploy}]"
        ] = ratios[deploy] >= THROUGHPUT_GOAL
        goals[f"get_meta p99 at {counts[-1]} (paced) < {P99_GOAL_MS:g} ms [{deploy}]"] = (
            p99 < P99_GOAL_MS
        )
        fair = min(c["phases"]["saturated"]["fairness_min_over_mean"] for c in mine)
        goals[f"no client starved: slowest >= {FAIRNESS_GOAL}x the mean, saturated [{deploy}]"] = (
            fair >= FAIRNESS_GOAL
        )
        line(
            f"saturated throughput {counts[-1]} / {counts[0]} clients [{deploy}]",
            ratios[deploy],
            "x",
        )
    ok_once = all(
        c["exactly_once"]["twice"] == c["exactly_once"]["missing"] == 0
        and c["exactly_once"]["extra"] == 0
        for c in cases
    )
    goals["every row read exactly once"] = ok_once
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    _plot(cases, RESULTS_DIR / "load.png")
    write_json(
        "load",
        {
            "command": "python -m bench.load " + " ".join(args_in),
            "settings": vars(args),
            "cases": cases,
            "throughput_ratio": ratios,
            "goals": goals,
        },
    )
    return 0 if ok_once else 1


if __name__ == "__main__":
    sys.exit(main())
