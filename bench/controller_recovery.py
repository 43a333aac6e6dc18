"""Controller restart (``state_dir``): snapshot, log replay and recovery times, journal cost.

    python -m bench.controller_recovery --rows 1000000   # the reported run (~1-2 min)
    python -m bench.controller_recovery --rows 100000    # a smoke test

On the controller core (:class:`~transferqueue.controller.journaled.JournaledController`, journal in
a temporary directory, ``fsync="batch"``, whose fsyncs run at the service's tick, not here):

1. build a state of ``--rows`` committed rows (puts of 1000 rows, two declared tasks; task
   ``a`` consumed a tenth, 100 leases outstanding) and time one snapshot (written, fsynced,
   renamed) and its size;
2. journal a tail of ``--tail`` get_meta/ack records after it, then recover a new core from
   the directory: snapshot load, replay rate (records/s) and the whole recovery (load +
   replay), checked equal to the original (stats);
3. the journal's cost on a get_meta(batch 64)/ack loop: a plain Controller (baseline), the
   journaled core with no journal (the wrapper alone) and with its journal (``never`` and
   ``always`` fsync), as ratios to the baseline measured in the same run (the cases take
   turns, best of ``--repeat`` rounds);
4. with ``--service``, the same through processes: ``transferqueue.serve(num_units=2,
   state_dir=...)`` at its defaults, ``--rows`` rows put by a client (1000 a put, 32 bytes
   each), task ``a`` acks a tenth, 100 leases held; then the controller is SIGKILLed and the
   same connected client times how long until the supervisor's restart answers ``stats``
   and until a ``get_meta`` hands out rows again (recovery, reconciliation with both units'
   inventories included), and checks that every row, ack and lease came back.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import transferqueue
from bench.common import line, write_json
from transferqueue.controller.core import Controller
from transferqueue.controller.journal import JournalSettings, read_snapshot
from transferqueue.controller.journaled import JournaledController, open_controller
from transferqueue.errors import PeerGoneError
from transferqueue.schema import FieldSpec

_PUT = 1000
_SETTINGS = JournalSettings(fsync="batch", snapshot_records=10**9, snapshot_s=1e9)


def _make() -> JournaledController:
    return JournaledController(2)


def _fill(ctl: Controller, rows: int) -> list[int]:
    """``rows`` committed rows in partition ``p`` with tasks a and b declared; task a
    consumed a tenth of them; returns the ids of 100 leases left outstanding."""
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (8,)), "y": FieldSpec.object()}, "p")
    ctl.queues.declare_tasks("p", ["a", "b"])
    for start in range(0, rows, _PUT):
        n = min(_PUT, rows - start)
        meta = ctl.writes.allocate(n, "p", groups=np.arange(start, start + n) // 8, nbytes=n * 64)
        ctl.writes.commit(meta.indexes, ["x", "y"], versions=0)
    for _ in range(rows // 10 // 256):
        got, _ = ctl.queues.poll(
            task="a", partition="p", fields=["x"], batch_size=256, lease_s=3600
        )
        assert got is not None and got.lease_id is not None
        ctl.queues.ack(got.lease_id)
    held = []
    for _ in range(100):
        got, _ = ctl.queues.poll(
            task="b", partition="p", fields=["x", "y"], batch_size=8, lease_s=3600
        )
        assert got is not None and got.lease_id is not None
        held.append(got.lease_id)
    return held


def _loop(ctl: Controller, iters: int, batch: int = 64) -> float:
    """Seconds for ``iters`` get_meta + ack of task ``a`` (it consumes ``iters * batch``
    rows: the state must hold them)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        got, _ = ctl.queues.poll(
            task="a", partition="p", fields=["x"], batch_size=batch, lease_s=60
        )
        assert got is not None and got.lease_id is not None
        ctl.queues.ack(got.lease_id)
    return time.perf_counter() - t0


def recovery(rows: int, tail: int, root: Path) -> dict[str, Any]:
    state = root / "state"
    ctl, _ = open_controller(state, _make, _SETTINGS)
    t0 = time.perf_counter()
    _fill(ctl, rows)
    build_s = time.perf_counter() - t0
    assert ctl.journal is not None
    built_records = ctl.journal.appended
    ctl.journal.snapshot(ctl)
    snap_s = ctl.journal.last_snapshot_s
    snap_mb = os.path.getsize(state / "snapshot") / 1e6
    line(f"snapshot of {rows} rows", snap_s, "s", size_mb=snap_mb)
    loop_iters = tail // 2
    _loop(ctl, loop_iters, batch=8)
    records = ctl.journal.records
    ctl.journal.close()
    want = ctl.stats()
    t0 = time.perf_counter()
    read_snapshot(str(state))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back, recovered = open_controller(state, _make, _SETTINGS)
    recover_s = time.perf_counter() - t0
    assert recovered and back.stats() == want, "the recovered core differs"
    replay_s = max(recover_s - load_s, 1e-9)
    rate = records / replay_s
    line("snapshot load", load_s, "s")
    line(f"log replay ({records} records)", rate, "records/s")
    line(f"recovery (load + {records} records)", recover_s, "s")
    assert back.journal is not None
    back.journal.close()
    return {
        "rows": rows,
        "build_s": build_s,
        "build_records": built_records,
        "snapshot_s": snap_s,
        "snapshot_mb": snap_mb,
        "snapshot_load_s": load_s,
        "tail_records": records,
        "replay_records_per_s": rate,
        "recovery_s": recover_s,
    }


def journal_cost(iters: int, repeat: int, root: Path) -> dict[str, Any]:
    """get_meta/ack loop rate, journal off vs on, on equal states; the cases take turns,
    ``repeat`` rounds, best round each (a shared host's noise and the page cache's
    write-back of the files above hit every case alike)."""
    rows = (iters * 64 * (repeat + 1)) * 10 // 9 + 1000
    plain: Controller = Controller(2)
    cases: dict[str, tuple[Controller, int]] = {"plain Controller": (plain, iters)}
    cases["journaled core, no journal"] = (_make(), iters)
    for fsync, n in (("never", iters), ("always", max(iters // 10, 50))):
        jc, _ = open_controller(root / f"cost-{fsync}", _make, JournalSettings(fsync=fsync))
        cases[f"journal fsync={fsync}"] = (jc, n)
    for core, _ in cases.values():
        _fill(core, rows)
    best = dict.fromkeys(cases, 0.0)
    for core, n in cases.values():
        _loop(core, n)  # (a warm-up round, not counted)
    for _ in range(repeat):
        for name, (core, n) in cases.items():
            best[name] = max(best[name], n / _loop(core, n))
    out: dict[str, Any] = {"iters": iters, "batch": 64, "repeat": repeat, "rows": rows}
    base = best["plain Controller"]
    for name, rate in best.items():
        line(f"get_meta+ack, {name}", rate, "loops/s", ratio=rate / base)
        out[name] = {"loops_per_s": rate, "ratio": rate / base}
    for core, _ in cases.values():
        if isinstance(core, JournaledController) and core.journal is not None:
            core.journal.close()
    return out


def _answered(call: Any, timeout_s: float = 300.0) -> Any:
    """``call()`` once the restarted controller answers it (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except PeerGoneError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def service_recovery(rows: int, root: Path) -> dict[str, Any]:
    """Step 4 of the module docstring: a SIGKILLed controller of a local service."""
    state = root / "service-state"
    with (
        transferqueue.serve(num_units=2, state_dir=state) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["a", "b"], partition="p")
        t0 = time.perf_counter()
        for start in range(0, rows, _PUT):
            n = min(_PUT, rows - start)
            x = np.arange(start * 8, (start + n) * 8, dtype=np.float32).reshape(n, 8)
            c.put({"x": x}, partition="p")
            if start % 100_000 == 0:
                print(f"  put {start + n:,} rows", flush=True)
        put_s = time.perf_counter() - t0
        for _ in range(rows // 10 // 1024):
            c.ack(c.get_meta("a", ["x"], 1024, partition="p", timeout_s=60))
        held = [
            c.get_meta("b", ["x"], 8, partition="p", timeout_s=60, lease_s=3600) for _ in range(100)
        ]
        before = c.stats()["controller"]
        old = svc.pids[-1]
        t0 = time.perf_counter()
        os.kill(old, signal.SIGKILL)
        after = _answered(lambda: c.stats())["controller"]
        stats_s = time.perf_counter() - t0
        got = _answered(lambda: c.get_meta("a", ["x"], 64, partition="p", timeout_s=60))
        first_meta_s = time.perf_counter() - t0
        assert svc.pids[-1] != old and len(got) == 64, "the controller did not come back"
        for key in ("rows_live", "next_index", "active_leases", "rows_lost", "partitions"):
            assert after[key] == before[key], f"{key} differs after the restart"
        for meta in held:
            c.ack(meta)  # (the leases came back: their acks are accepted)
        c.ack(got)
        line(f"service: put {rows} rows", rows / put_s, "rows/s")
        line("service: SIGKILL -> restarted controller answers stats", stats_s, "s")
        line("service: SIGKILL -> first get_meta served", first_meta_s, "s")
        return {
            "rows": rows,
            "put_rows_per_s": rows / put_s,
            "kill_to_stats_s": stats_s,
            "kill_to_get_meta_s": first_meta_s,
            "state_mb": sum(f.stat().st_size for f in state.iterdir() if f.is_file()) / 1e6,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="committed rows (default 1M)")
    ap.add_argument("--tail", type=int, default=100_000, help="log records after the snapshot")
    ap.add_argument("--iters", type=int, default=1000, help="get_meta+ack loops per round")
    ap.add_argument("--repeat", type=int, default=5, help="rounds of the cost cases")
    ap.add_argument("--dir", default=None, help="where the state goes (default: a temp dir)")
    ap.add_argument("--service", action="store_true", help="also time a service's restart")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="tq-recovery-") as d:
        results = {
            "recovery": recovery(a.rows, a.tail, Path(d)),
            "journal_cost": journal_cost(a.iters, a.repeat, Path(d)),
        }
        if a.service:
            results["service"] = service_recovery(a.rows, Path(d))
    write_json("controller_recovery", results)


if __name__ == "__main__":
    main()
