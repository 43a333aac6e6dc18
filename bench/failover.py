"""How fast a local service notices a dead storage unit and serves again: the figures behind
the failover table of ``docs/transferqueue/reliability.md``.

    python -m bench.failover              # 6 kills of each kind (~2 min on 2 cores)
    python -m bench.failover --kills 2    # a smoke test

On ``transferqueue.serve(num_units=2, spread_bytes=0)`` at its default liveness (heartbeat
0.5 s, dead after 4 s: a bound of 4.5 s), a consumer holds 1000 leased rows spread over both
units; then one unit is SIGKILLed, alternately unit 0 and unit 1, and the bench times, from
the kill:

- ``read fails``: the consumer's ``get_data`` of its batch raising ``RowsLostError`` (the
  call waits on the dead unit until its connection drops or the bound passes);
- ``rows reported lost``: ``stats()`` counting the dead unit's rows as lost;
- ``unit serving again``: the supervisor's restart registered with the controller (a put
  with rows on the restarted unit commits);

and with ``replicas=2`` (same layout, 2 copies of each row): ``read served by the other
copy``, the consumer's ``get_data`` returning every row bit-exact, and ``second copies
restored``: from the restarted unit's return until ``rows_one_copy`` is 0 again (every row
put so far, 1000 more per kill, copied from the surviving unit; see
:mod:`transferqueue.controller.recopy`). Medians and maxima of
the kills; the bound they are measured against is the liveness bound, from the same run's
configuration. Writes ``bench/results/failover.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import transferqueue
from bench.common import line, write_json
from transferqueue import Liveness, RowsLostError

ROWS = 1000
POLL_S = 0.02


def _until(what: Callable[[], Any], timeout_s: float, label: str) -> float:
    """Poll ``what`` until truthy; the monotonic time it was first seen so (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return time.monotonic()
        time.sleep(POLL_S)
    raise TimeoutError(f"{label}: not within {timeout_s} s")


def _revived(c: transferqueue.Client, units_lost0: int) -> bool:
    """Whether the controller has lost the killed unit and taken its restart back (only
    then does it place rows on the new incarnation)."""
    stats = c.stats()["controller"]
    return bool(stats["units_lost"] > units_lost0 and all(stats["units_alive"]))


def _put(c: transferqueue.Client, start: int) -> Any:
    return c.put({"x": torch.arange(start, start + ROWS).view(ROWS, 1)}, partition="p")


def _kill_one(svc: Any, c: transferqueue.Client, unit: int, start: int) -> dict[str, float]:
    """One kill with replicas=1: the three times from the kill, in seconds."""
    meta = _put(c, start)
    on_unit = int((meta.units == unit).sum())
    held = c.get_meta("t", ["x"], ROWS, partition="p", lease_s=600)
    stats = c.stats()["controller"]
    lost0, units_lost0 = stats["rows_lost"], stats["units_lost"]
    t0 = time.monotonic()
    os.kill(svc.pids[unit], signal.SIGKILL)
    try:
        c.get_data(held)
        raise AssertionError("a read of rows on a dead unit succeeded")
    except RowsLostError:
        read_fails = time.monotonic() - t0
    c.ack(held)
    lost_at = _until(lambda: c.stats()["controller"]["rows_lost"] >= lost0 + on_unit, 60, "lost")
    back_at = _until(lambda: _revived(c, units_lost0), 120, "restart")
    again = _put(c, start + ROWS)  # rows on both units: the restarted one takes its share
    assert sorted(np.unique(again.units).tolist()) == [0, 1]
    c.ack(c.get_meta("t", ["x"], ROWS, partition="p", timeout_s=30))
    return {
        "read fails": read_fails,
        "rows reported lost": lost_at - t0,
        "unit serving again": back_at - t0,
    }


def _kill_replicated(
    svc: Any, c: transferqueue.Client, unit: int, start: int
) -> tuple[float, float, int]:
    """One kill with replicas=2: seconds from the kill until the held batch is read whole;
    seconds from the unit's return until every row has two copies again, and the rows
    copied (the rows put so far stay: no task is declared)."""
    _put(c, start)
    held = c.get_meta("t", ["x"], ROWS, partition="p", lease_s=600)
    stats = c.stats()["controller"]
    units_lost0, recopied0 = stats["units_lost"], stats["rows_recopied"]
    t0 = time.monotonic()
    os.kill(svc.pids[unit], signal.SIGKILL)
    got = c.get_data(held)["x"]
    took = time.monotonic() - t0
    assert isinstance(got, torch.Tensor)  # every row, as put (fifo: in put order)
    assert torch.equal(got.view(-1), torch.arange(start, start + ROWS)), "rows differ"
    c.ack(held)
    back = _until(lambda: _revived(c, units_lost0), 120, "restart")
    done = _until(lambda: c.stats()["controller"]["rows_one_copy"] == 0, 120, "second copies")
    copied = c.stats()["controller"]["rows_recopied"] - recopied0
    return took, done - back, copied


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6, help="kills of each kind (<= 10)")
    args = ap.parse_args(argv)
    kills = max(1, min(args.kills, 10))
    liveness = Liveness()
    times: dict[str, list[float]] = {}
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, max_restarts=10) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        for k in range(kills):
            for name, s in _kill_one(svc, c, k % 2, k * 10 * ROWS).items():
                times.setdefault(name, []).append(s)
            print(f"kill {k + 1}/{kills} (replicas=1) done", flush=True)
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, max_restarts=10, replicas=2) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        for k in range(kills):
            s, restored, copied = _kill_replicated(svc, c, k % 2, k * 10 * ROWS)
            times.setdefault("read served by the other copy (replicas=2)", []).append(s)
            times.setdefault("second copies restored, from the unit's return", []).append(restored)
            print(
                f"kill {k + 1}/{kills} (replicas=2) done: second copy restored in "
                f"{restored:.2f} s for {copied} rows",
                flush=True,
            )
    print(f"liveness bound {liveness.bound_s} s; {kills} kills each; seconds from the kill:")
    results = {}
    for name, vals in times.items():
        med, worst = statistics.median(vals), max(vals)
        line(name, med, "s median", max_s=worst, bound_s=liveness.bound_s)
        results[name] = {"median_s": med, "max_s": worst, "all_s": vals}
    write_json("failover", {"kills": kills, "bound_s": liveness.bound_s, "results": results})


if __name__ == "__main__":
    main()
