"""Controller and embedded data-path benchmark (TransferQueue core).

    python -m bench.controller            # full run (~1-2 min on 2 cores)
    python -m bench.controller --quick    # smaller sizes, for a smoke test

Cases, each against a baseline measured in the same run:

1. ``put+get_meta+ack`` rate through the embedded client, batch 64 (samples/s).
2. ``get_meta+ack`` cost as rows held by the controller grow 1k -> 100k -> 1M; the ratio of
   the 1M cost to the 1k cost must stay <= 2 (a batch costs O(batch), not O(rows)). Measured
   on the controller core (the algorithm) and through the client (what users see).
3. Embedded ``put`` + ``get_data`` of a dense float32 batch of 1024 x 8192 x 9 fields
   (~288 MB, TransferQueue's "Small" case) against a memcpy of the same bytes into a new
   tensor (``clone``: what any read that returns an independent tensor must do) and into a
   warm preallocated buffer (``copy_``: the hardware ceiling). Target: >= 50% of the clone
   memcpy.
4. ``get_meta`` of 64 rows from 1,000 live rows over the wire (a local service: the controller
   and one unit are processes of their own, this process the client, as in ``bench.peer``)
   against a bare ZeroMQ round trip in the same layout: a DEALER here, a ROUTER in a process
   of its own, over loopback tcp (the transport our client uses), a msgpack request shaped
   like a ``GetMeta`` out and a msgpack reply holding 64 int64 indexes back. Rounds alternate
   the two; medians. Target: ours within 2x the bare round trip.

    python -m bench.controller --cases wire   # one case (its own JSON: controller-wire.json)
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

import transferqueue
from bench.bare import BareRoundTrip
from bench.common import line, timeit, write_json
from bench.peer_cases import MetaLoop
from transferqueue.controller.core import Controller
from transferqueue.schema import FieldSpec


def put_get_ack_rate(batch: int, seconds: float) -> dict[str, Any]:
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        client.declare_tasks(["t"])
        x = torch.arange(batch, dtype=torch.int64)
        n = 0
        t_end = time.perf_counter() + seconds
        t0 = time.perf_counter()
        while time.perf_counter() < t_end:
            client.put({"x": x}, group=0)
            meta = client.get_meta("t", ["x"], batch, timeout_s=5)
            client.ack(meta)
            n += batch
        dt = time.perf_counter() - t0
    rate = n / dt
    line(f"embedded put+get_meta+ack (batch {batch})", rate, "samples/s")
    return {"batch": batch, "samples_per_s": rate, "samples": n, "seconds": dt}


def _fill_core(ctl: Controller, rows: int) -> None:
    ctl.rows.register_fields({"x": FieldSpec.dense(torch.int64)}, "p")
    chunk = 65536
    for start in range(0, rows, chunk):
        meta = ctl.writes.allocate(min(chunk, rows - start), "p")
        ctl.writes.commit(meta.indexes, ["x"])


def core_cost(rows: int, batch: int, iters: int) -> float:
    """Seconds per get_meta+ack on the controller core with ``rows`` queued for the task."""
    ctl = Controller(num_units=2)
    ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=batch, lease_s=60)
    _fill_core(ctl, rows + batch * (iters + 10))
    for _ in range(10):  # warm up
        meta, _ = ctl.queues.poll(
            task="t", partition="p", fields=None, batch_size=batch, lease_s=60
        )
        assert meta is not None and meta.lease_id is not None
        ctl.queues.ack(meta.lease_id, meta.indexes)
    t0 = time.perf_counter()
    for _ in range(iters):
        meta, _ = ctl.queues.poll(
            task="t", partition="p", fields=None, batch_size=batch, lease_s=60
        )
        assert meta is not None and meta.lease_id is not None
        ctl.queues.ack(meta.lease_id, meta.indexes)
    return (time.perf_counter() - t0) / iters


def client_cost(rows: int, batch: int, iters: int) -> float:
    """Seconds per get_meta+ack through the embedded client with ``rows`` queued."""
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        total = rows + batch * (iters + 10)
        chunk = 65536
        for start in range(0, total, chunk):
            client.put({"x": torch.zeros(min(chunk, total - start), dtype=torch.int64)}, group=0)
        for _ in range(10):
            client.ack(client.get_meta("t", ["x"], batch, timeout_s=5))
        t0 = time.perf_counter()
        for _ in range(iters):
            client.ack(client.get_meta("t", ["x"], batch, timeout_s=5))
        return (time.perf_counter() - t0) / iters


def scaling(sizes: list[int], batch: int, iters: int) -> dict[str, Any]:
    out: dict[str, Any] = {"batch": batch, "rows": sizes, "core_s": [], "client_s": []}
    for rows in sizes:
        core = min(core_cost(rows, batch, iters) for _ in range(3))
        cli = min(client_cost(rows, batch, iters) for _ in range(2))
        out["core_s"].append(core)
        out["client_s"].append(cli)
        line(f"get_meta+ack core, {rows:>9,} rows held", core * 1e6, "us/batch")
        line(f"get_meta+ack client, {rows:>9,} rows held", cli * 1e6, "us/batch")
    out["core_ratio_max_to_min_rows"] = out["core_s"][-1] / out["core_s"][0]
    out["client_ratio_max_to_min_rows"] = out["client_s"][-1] / out["client_s"][0]
    line(
        f"get_meta cost ratio {sizes[-1]:,} / {sizes[0]:,} rows",
        out["core_ratio_max_to_min_rows"],
        "x (core)",
        client=out["client_ratio_max_to_min_rows"],
        target="<=2",
    )
    return out


def dense_small(rows: int, width: int, fields: int, repeat: int) -> dict[str, Any]:
    cols = {f"f{i}": torch.randn(rows, width) for i in range(fields)}
    nbytes = rows * width * fields * 4
    src = torch.cat([c.reshape(-1) for c in cols.values()])
    warm = torch.empty_like(src)
    memcpy_clone = timeit(lambda: src.clone(), repeat=repeat)
    memcpy_warm = timeit(lambda: warm.copy_(src), repeat=repeat)
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        client.declare_tasks(["t"])

        def cycle() -> None:
            client.put(cols, group=0)
            meta = client.get_meta("t", list(cols), rows, timeout_s=30)
            client.get_data(meta)
            client.ack(meta)

        tq_t = timeit(cycle, warmup=2, repeat=repeat)
        put_t = timeit(lambda: client.ack(_put_then_meta(client, cols, rows)), repeat=repeat)
        meta = _put_then_meta(client, cols, rows)
        get_t = timeit(lambda: client.get_data(meta), repeat=repeat)
        client.ack(meta)
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    res = {
        "bytes": nbytes,
        "shape": [rows, width, fields],
        "memcpy_clone_GBps": gbs(memcpy_clone["best_s"]),
        "memcpy_warm_GBps": gbs(memcpy_warm["best_s"]),
        "tq_put_get_GBps": gbs(tq_t["best_s"]),
        "tq_put_GBps": gbs(put_t["best_s"]),
        "tq_get_GBps": gbs(get_t["best_s"]),
    }
    res["ratio_vs_memcpy_clone"] = res["tq_put_get_GBps"] / res["memcpy_clone_GBps"]
    res["ratio_vs_memcpy_warm"] = res["tq_put_get_GBps"] / res["memcpy_warm_GBps"]
    mb = nbytes / 1e6
    line(f"memcpy clone ({mb:.0f} MB)", res["memcpy_clone_GBps"], "GB/s")
    line(f"memcpy into warm buffer ({mb:.0f} MB)", res["memcpy_warm_GBps"], "GB/s")
    line("embedded put (one copy in)", res["tq_put_GBps"], "GB/s")
    line("embedded get_data (one gather out)", res["tq_get_GBps"], "GB/s")
    line(
        "embedded put+get_data",
        res["tq_put_get_GBps"],
        "GB/s",
        vs_clone=res["ratio_vs_memcpy_clone"],
        vs_warm=res["ratio_vs_memcpy_warm"],
        target="vs_clone>=0.5",
    )
    return res


def _put_then_meta(client: transferqueue.Client, cols: dict[str, torch.Tensor], rows: int) -> Any:
    client.put(cols, group=0)
    return client.get_meta("t", list(cols), rows, timeout_s=30)


# -- a small call near the wire ---------------------------------------------------------------
WIRE_GOAL = 2.0  # ours / bare ZeroMQ round trip, get_meta of 64 from 1,000 live rows


def wire_round_trip(live: int, batch: int, rounds: int, seconds: float) -> dict[str, Any]:
    """Ours ``get_meta`` (local service, one unit) against the bare round trip, alternating
    rounds (module docstring, case 4); seconds per call, medians of the rounds."""
    bare = BareRoundTrip()
    try:
        with (
            transferqueue.serve(num_units=1) as svc,
            transferqueue.connect(svc.address) as tq,
        ):
            client = tq.client()
            partition = f"meta{live}"

            def fill(live: int) -> None:
                client.clear(partition)
                x = torch.arange(live, dtype=torch.int64).view(live, 1)
                client.put({"x": x}, partition=partition)

            def call(live: int, batch: int) -> float:
                t0 = time.perf_counter()
                meta = client.get_meta("bench", ["x"], batch, partition=partition, timeout_s=10)
                dt = time.perf_counter() - t0
                if len(meta) != batch:
                    raise AssertionError(f"get_meta returned {len(meta)} rows, asked {batch}")
                client.ack(meta)
                return dt

            loop = MetaLoop(fill, call)
            bare.seconds_per_call(batch, 0.5)  # warm up both
            loop.run(live, batch, 0.5)
            ours_s, bare_s = [], []
            for rnd in range(rounds):
                for who in ("bare", "ours") if rnd % 2 == 0 else ("ours", "bare"):
                    if who == "bare":
                        bare_s.append(bare.seconds_per_call(batch, seconds))
                    else:
                        ours_s.append(batch / loop.run(live, batch, seconds)["samples_per_s"])
    finally:
        bare.close()
    bare_med, ours_med = statistics.median(bare_s), statistics.median(ours_s)
    ratio = ours_med / bare_med
    paired = statistics.median(o / b for o, b in zip(ours_s, bare_s, strict=True))
    line(f"bare ZeroMQ round trip ({batch} indexes back)", bare_med * 1e6, "us/call")
    line(
        f"get_meta of {batch} from {live:,} rows over the wire",
        ours_med * 1e6,
        "us/call",
        vs_bare=ratio,
        paired_rounds=paired,
    )
    verdict = "pass" if ratio <= WIRE_GOAL else "FAIL"
    print(f"get_meta / bare round trip {ratio:.2f}x (goal <= {WIRE_GOAL:g}x): {verdict}")
    return {
        "live": live,
        "batch": batch,
        "bare_s": bare_s,
        "ours_s": ours_s,
        "bare_median_s": bare_med,
        "ours_median_s": ours_med,
        "ratio": ratio,
        "ratio_paired_median": paired,
    }


CASES = ("rate", "scaling", "dense", "wire")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke test)")
    ap.add_argument(
        "--cases", nargs="+", choices=CASES, default=list(CASES), help="run only these cases"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    np.random.seed(0)
    if args.quick:
        sizes, iters, rate_s, dense = [1_000, 100_000], 200, 1.0, (256, 8192, 9)
        wire_rounds, wire_s = 2, 1.0
    else:
        sizes, iters, rate_s, dense = [1_000, 100_000, 1_000_000], 500, 3.0, (1024, 8192, 9)
        wire_rounds, wire_s = 6, 2.0
    results: dict[str, Any] = {}
    if "rate" in args.cases:
        results["put_get_ack"] = put_get_ack_rate(64, rate_s)
    if "scaling" in args.cases:
        results["scaling"] = scaling(sizes, 64, iters)
    if "dense" in args.cases:
        results["dense_small"] = dense_small(*dense, repeat=5)
    if "wire" in args.cases:
        results["wire"] = wire_round_trip(1_000, 64, wire_rounds, wire_s)
    subset = [c for c in CASES if c in args.cases]
    write_json("controller" if subset == list(CASES) else f"controller-{'-'.join(subset)}", results)


if __name__ == "__main__":
    main()
