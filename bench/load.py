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
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

from bench.common import RESULTS_DIR, line, write_json
from bench.load_checks import exactly_once, servers_memory
from bench.load_report import P99_GOAL_MS, plot, print_case
from bench.load_service import RESTART_BOUND_S, RIDE_THROUGH_S, Served, proc_stats, service

CALLS = ("put", "get_meta", "get_data", "ack")
THROUGHPUT_GOAL = 0.8
FAIRNESS_GOAL = 0.25  # the slowest client's saturated cycles over the mean, at every N
WARM_PHASE = 99  # the phase number in the stamps of each client's first cycle
SATURATED_CYCLES = 8  # cycles per client the saturated phase is sized for (fairness)
SATURATED_GUESS = 1000.0  # cycles/s over all clients, to size it (measured: 850-1,050)
OWN_PARTITIONS = 512  # (at 4,096 clients: four clients to a partition "of their own")
CONNECTING = 64  # connects in flight at once per worker process
RESTART_PHASE_S = 20.0  # the restart phase at least (the kill a quarter in; back in 2-8 s)
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
    """One client's cycles in ``window`` (at most ``most``), their latencies into ``lat``; a
    call that fails ends the client's phase (reported: ``failed``, ``errors``)."""
    client = tq.async_client()
    cycles, stamps, errors = 0, [], []
    last_end = 0.0
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
        try:
            t0 = time.perf_counter()
            await client.put({"stamp": x.copy()}, partition=partition)
            t1 = time.perf_counter()
            meta = await client.get_meta(
                "load", ["stamp"], batch, partition=partition, timeout_s=60
            )
            t2 = time.perf_counter()
            cols = await client.get_data(meta)
            t3 = time.perf_counter()
            await client.ack(meta)
            t4 = time.perf_counter()
        except Exception as e:  # (reported: a load that fails a call fails the bench)
            errors.append(f"client {cid}: {type(e).__name__}: {e}")
            break
        for name, a, b in zip(CALLS, (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
            lat[name].append(b - a)
        stamps.append(np.asarray(cols["stamp"]).tolist())
        cycles += 1
        last_end = time.monotonic()
    return {
        "cid": cid,
        "cycles": cycles,
        "stamps": stamps,
        "failed": len(errors),
        "errors": errors,
        "last_end": last_end,
    }


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


async def _worker_main(
    address: str, first: int, count: int, batch: int, rates: list[float], ride_s: float
) -> None:
    """``count`` clients, one phase per rate (0: as fast as they can), each as long as the
    parent says, all starting at its signal; one JSON line per phase on stdout."""
    import transferqueue
    import transferqueue.deploy.connect  # (torch and the client: imported before the storm)

    print(json.dumps({"ready": True}), flush=True)  # (imports done: the storm starts together)
    sys.stdin.readline()
    t_connect = time.perf_counter()
    # all at once (a connection storm): every client's connect in flight together
    with concurrent.futures.ThreadPoolExecutor(CONNECTING) as pool:
        handles = list(
            pool.map(
                lambda _: transferqueue.connect(
                    address, call_timeout_s=120.0, shared_loop=True, ride_through_s=ride_s
                ),
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
                    "ended": time.monotonic(),  # (cycles begun in the window end after it)
                    "clients": [
                        {k: r[k] for k in ("cid", "cycles", "failed", "errors", "last_end")}
                        for r in results
                    ],
                    "stamps": [s for r in results for s in r["stamps"]],
                    "latency": {c: lat[c] for c in CALLS},
                }
            ),
            flush=True,
        )
    os._exit(0)  # (the parent has every figure; closing a thousand handles one by one is slow)


# --- the parent: the service, the workers, the checks ------------------------------------


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


def _phase(outs: list[dict[str, Any]], batch: int, start: float, phase_no: int) -> dict[str, Any]:
    """One phase's figures from the workers' reports; its rows read are in ``stamps``. Rates
    are over the phase's real length: from ``start`` until its last cycle ended (a cycle
    begun in the window may end after it: at thousands of clients, seconds after)."""
    seconds = max(o["ended"] for o in outs) - start
    clients = [c for o in outs for c in o["clients"]]
    cycles = np.array([c["cycles"] for c in clients], dtype=float)
    lat = {c: np.array([x for o in outs for x in o["latency"][c]]) * 1e3 for c in CALLS}
    total = float(cycles.sum())
    return {
        "cycles": total,
        "elapsed_s": seconds,
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


class _Restart(threading.Thread):
    """Restarts the controller at ``at`` (monotonic), in the background of a phase."""

    def __init__(self, served: Served, at: float) -> None:
        super().__init__(daemon=True)
        self.served, self.at = served, at
        self.took: float | None = None
        self.killed_at = 0.0
        self.error: BaseException | None = None

    def run(self) -> None:
        assert self.served.restart is not None
        time.sleep(max(0.0, self.at - time.monotonic()))
        self.killed_at = time.monotonic()
        try:
            self.took = self.served.restart()
        except BaseException as e:  # (the phase's report says it)
            self.error = e


def _restart_at(served: Served, at: float) -> _Restart:
    if served.restart is None:
        raise ValueError("the restart phase needs a local service (a controller with state)")
    restart = _Restart(served, at)
    restart.start()
    return restart


def _restarted(ph: dict[str, Any], outs: list[dict[str, Any]], restart: _Restart) -> None:
    """The restart phase's own figures: how long the controller was away, the clients'
    failed calls, the longest call, and how many clients finished a cycle after it was back."""
    assert restart.took is not None
    back = restart.killed_at + restart.took
    ends = [c["last_end"] for o in outs for c in o["clients"]]
    ph["restart"] = {
        "controller_away_s": restart.took,
        "failed_calls": sum(c["failed"] for o in outs for c in o["clients"]),
        "errors": [e for o in outs for c in o["clients"] for e in c["errors"]][:5],
        "longest_call_s": max(max(v) for o in outs for v in o["latency"].values() if v),
        "clients_served_after": sum(1 for t in ends if t > back),
    }


def run_case(
    n: int,
    procs: int,
    batch: int,
    phases: dict[str, tuple[float, float]],
    deploy: str = "local",
) -> dict[str, Any]:
    """One service (``deploy``: ``local`` or ``ray``) and ``n`` clients over ``procs``
    workers, then one phase per entry of ``phases``: name -> (cycles per second per client,
    0 for as fast as each can (the service's saturation throughput); seconds). A phase named
    ``restart`` (``local`` only; the last) runs as saturated while the controller is
    SIGKILLed a quarter into it and restarted with its state: every client rides through."""
    import transferqueue

    procs = max(1, min(procs, n))
    restarting = "restart" in phases
    ride_s = RIDE_THROUGH_S if restarting else 0.0
    with service(deploy, restartable=restarting) as served:
        address, unit = served.address, served.unit_pid
        ctl = served.controller_pid()
        setup = transferqueue.connect(address, ride_through_s=ride_s)
        partitions = sorted({_partition_of(c) for c in range(n)})
        sc = setup.client()
        for p in partitions:
            sc.declare_tasks(["load"], partition=p)
        before = {pid: proc_stats(pid) for pid in (ctl, unit)}
        workers = []
        first = 0
        for i in range(procs):
            count = n // procs + (1 if i < n % procs else 0)
            cmd = [sys.executable, "-m", "bench.load", "--worker", address, str(first)]
            cmd += [str(count), str(batch), ",".join(str(r) for r, _ in phases.values())]
            cmd += [str(ride_s)]
            workers.append(
                subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            )
            first += count
        stamps: list[tuple[int, ...]] = []
        written: set[tuple[int, ...]] = set()
        connect_s = warm_s = 0.0
        for w in workers:
            _line(w, WORKER_TIMEOUT_S)  # imports done
        for w in workers:  # every worker's clients connect at once
            assert w.stdin is not None
            w.stdin.write("connect\n")
            w.stdin.flush()
        for w in workers:
            hello = _line(w, WORKER_TIMEOUT_S)  # connected, one cycle each done
            stamps += [tuple(r) for s in hello["stamps"] for r in s]
            connect_s = max(connect_s, hello["connect_s"])
            warm_s = max(warm_s, hello["warm_s"])
        written |= {(c, WARM_PHASE, 0, r) for c in range(n) for r in range(batch)}
        connected = {pid: proc_stats(pid) for pid in (ctl, unit)}  # every client connected
        first_ctl = ctl
        res: dict[str, Any] = {
            "deploy": deploy,
            "clients": n,
            "procs": procs,
            "connect_s": connect_s,
            "first_cycle_s": warm_s,
            "phases": {},
        }
        for phase_no, (name, (rate, seconds)) in enumerate(phases.items()):
            idle = {pid: proc_stats(pid) for pid in (ctl, unit)}
            start = time.monotonic() + 0.5
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"{start} {seconds}\n")
                w.stdin.flush()
            restart = _restart_at(served, start + seconds / 4) if name == "restart" else None
            outs = []
            for w in workers:
                outs.append(_line(w, seconds + WORKER_TIMEOUT_S))
            if restart is not None:
                restart.join(RESTART_BOUND_S)
                if not restart.took:
                    raise RuntimeError(f"the controller's restart failed: {restart.error}")
            busy = {pid: proc_stats(pid) for pid in (served.controller_pid(), unit)}
            ph = _phase(outs, batch, start, phase_no)
            if restart is not None:
                _restarted(ph, outs, restart)
                idle[served.controller_pid()] = idle.pop(ctl)  # (a new process: from 0)
                idle[served.controller_pid()]["cpu_s"] = 0.0
                ctl = served.controller_pid()
            written |= ph.pop("written")
            stamps += [tuple(r) for o in outs for s in o["stamps"] for r in s]
            ph["rate_per_client"] = rate
            ph["seconds"] = seconds
            ph["servers"] = {
                role: {
                    "cpu_s_per_1k_cycles": (busy[pid]["cpu_s"] - idle[pid]["cpu_s"])
                    / max(ph["cycles"], 1)
                    * 1e3,
                    "cpu_share": (busy[pid]["cpu_s"] - idle[pid]["cpu_s"]) / ph["elapsed_s"],
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
    res["exactly_once"] = exactly_once(written, stamps)
    res["servers"] = servers_memory(before, connected, {"controller": first_ctl, "unit": unit}, n)
    return res


def _phases(n: int, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """The phases for ``n`` clients: name -> (cycles/s per client, 0: as fast as each can;
    seconds). Saturated lasts long enough for each client's share to be measured (about
    SATURATED_CYCLES cycles each at SATURATED_GUESS cycles/s over all clients)."""
    saturated_s = max(args.seconds, n * SATURATED_CYCLES / SATURATED_GUESS)
    return {"paced": (args.offered / n, args.seconds), "saturated": (0.0, saturated_s)}


def _peer(
    counts: list[int], args: argparse.Namespace, cases: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The same clients against the peer at the largest of ``counts`` it holds, printed with
    our figures at that N (``bench/load_peer.py`` in the peer's virtualenv); None when not
    asked for or not built."""
    from bench.load_peer_run import peer_available, run_peer_case

    if args.peer == "no" or (args.peer == "auto" and not peer_available()):
        if args.peer == "auto":
            print("peer: skipped (its virtualenv is not built: python -m bench.peer --setup)")
        return None
    broke: list[dict[str, Any]] = []
    for n in sorted(counts, reverse=True):  # the largest N it holds (the same phases as ours)
        peer = run_peer_case(n, args.procs, args.batch, _phases(n, args))
        if "error" not in peer:
            break
        broke.append({k: peer.get(k) for k in ("clients", "stage", "error", "log")})
        print(f"peer with {n} clients broke at {peer.get('stage')}: {peer['error']}", flush=True)
    peer["broke_at"] = broke
    if "error" in peer:
        print(f"peer: held none of {counts}", flush=True)
        return peer
    print_case(peer)
    n = peer["clients"]
    ours = [c for c in cases if c["clients"] == n]
    peer["ours_over_peer"] = {}
    for c in ours:
        deploy = c.get("deploy", "local")
        sat = c["phases"]["saturated"]["rows_per_s"] / peer["phases"]["saturated"]["rows_per_s"]
        p99 = (
            peer["phases"]["paced"]["latency_ms"]["get_meta"]["p99"]
            / c["phases"]["paced"]["latency_ms"]["get_meta"]["p99"]
        )
        peer["ours_over_peer"][deploy] = {"saturated_rows_per_s": sat, "paced_get_meta_p99": p99}
        line(f"ours [{deploy}] / peer at {n} clients, saturated throughput", sat, "x")
        line(f"peer / ours [{deploy}] at {n} clients, paced get_meta p99", p99, "x")
    return peer


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--worker"]:
        address, first, count, batch, rates, ride_s = args_in[1:7]
        try:
            asyncio.run(
                _worker_main(
                    address,
                    int(first),
                    int(count),
                    int(batch),
                    [float(r) for r in rates.split(",")],
                    float(ride_s),
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
    ap.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="skip the restart phase (local, largest N: the controller killed and restarted "
        "with its state while every client runs)",
    )
    ap.add_argument(
        "--peer",
        choices=["auto", "yes", "no"],
        default="auto",
        help="the same clients against the peer (TransferQueue 0.1.11) at the largest N it "
        "holds; auto: when its virtualenv is built (python -m bench.peer --setup)",
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
                phases = _phases(n, args)
                if deploy == "local" and n == max(counts) and args.restart:
                    phases["restart"] = (0.0, max(phases["saturated"][1], RESTART_PHASE_S))
                r = run_case(n, args.procs, args.batch, phases, deploy)
                print_case(r)
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
        for c in mine:
            rs = c["phases"].get("restart", {}).get("restart")
            if rs is not None:
                goals[
                    f"{c['clients']} clients ride through a controller restart: no failed "
                    f"call, every client served after it [{deploy}]"
                ] = rs["failed_calls"] == 0 and rs["clients_served_after"] == c["clients"]
        fair = min(c["phases"]["saturated"]["fairness_min_over_mean"] for c in mine)
        goals[f"no client starved: slowest >= {FAIRNESS_GOAL}x the mean, saturated [{deploy}]"] = (
            fair >= FAIRNESS_GOAL
        )
        line(
            f"saturated throughput {counts[-1]} / {counts[0]} clients [{deploy}]",
            ratios[deploy],
            "x",
        )
    peer = _peer(counts, args, cases)
    ok_once = all(
        c["exactly_once"]["twice"] == c["exactly_once"]["missing"] == 0
        and c["exactly_once"]["extra"] == 0
        for c in cases
    )
    goals["every row read exactly once"] = ok_once
    for goal, met in goals.items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}", flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(cases, RESULTS_DIR / "load.png")
    write_json(
        "load",
        {
            "command": "python -m bench.load " + " ".join(args_in),
            "settings": vars(args),
            "cases": cases,
            "throughput_ratio": ratios,
            "peer": peer,
            "goals": goals,
        },
    )
    return 0 if ok_once else 1


if __name__ == "__main__":
    sys.exit(main())
