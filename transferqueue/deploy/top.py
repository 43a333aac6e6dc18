"""``transferqueue top ADDRESS``: a live terminal view of a running service.

Built on the ``stats`` call (:meth:`transferqueue.client.async_client.AsyncClient.stats`): every
``interval_s`` it takes a snapshot and draws rows live/queued per partition and task, leases,
request rates and bytes/s (the difference of two snapshots' request counters, per server),
each server's clients (admitted of ``max_connections``; requests refused) and each unit's
memory. :func:`render` is pure (two snapshots in, text out), so the view is
tested without a terminal.

    partition  task     queued  leased  waiting  done  lost
    train      rollout      48      16        0   320     0
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["render", "run_top"]

_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen (ANSI)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _totals(stats: dict[str, Any] | None) -> tuple[int, int, int]:
    """(requests, bytes in, bytes out) of one server's stats, summed over kinds."""
    if not stats or "requests" not in stats:
        return 0, 0, 0
    kinds = stats["requests"]["kinds"].values()
    return (
        sum(k["requests"] for k in kinds),
        sum(k["bytes_in"] for k in kinds),
        sum(k["bytes_out"] for k in kinds),
    )


def _rates(now: dict[str, Any], before: dict[str, Any] | None, dt_s: float) -> str:
    """``req/s  in/s  out/s`` between two stats of one server (blank without a previous)."""
    if before is None or dt_s <= 0 or "error" in now:
        return f"{'-':>9} {'-':>11} {'-':>11}"
    a, b = _totals(now), _totals(before)
    req, bin_, bout = ((x - y) / dt_s for x, y in zip(a, b, strict=True))
    return f"{req:9.1f} {_mib(bin_) + '/s':>11} {_mib(bout) + '/s':>11}"


def _clients(stats: dict[str, Any]) -> str:
    """``clients/max_connections refused`` of one server (see transferqueue.wire.peers)."""
    c = stats.get("connections")
    if c is None:
        return f"{'-':>13} {'-':>8}"
    return f"{str(c['clients']) + '/' + str(c['max_connections']):>13} {c['refusals']:>8,}"


def render(stats: dict[str, Any], before: dict[str, Any] | None = None, dt_s: float = 0.0) -> str:
    """The view of ``stats`` (a client's ``stats()``); rates from ``before``, ``dt_s`` earlier."""
    ctl = stats["controller"]
    prev_ctl = None if before is None else before["controller"]
    cap = ctl.get("capacity_rows")
    lines = [
        f"rows live {ctl['rows_live']:,}"
        + ("" if cap is None else f" of {cap:,}")
        + f"   leases active {ctl['active_leases']:,}"
        + f"   expired {ctl.get('expired_leases', 0):,}"
        + f"   returned {ctl.get('returned_leases', 0):,}"
        + f" ({ctl.get('returned_rows', 0):,} rows)"
        + f"   rows lost {ctl['rows_lost']:,}",
        "",
        f"{'partition':<16} {'task':<16} {'live':>8} {'queued':>8} {'leased':>8} "
        f"{'waiting':>8} {'done':>10} {'lost':>6}",
    ]
    for pname, part in ctl["partitions"].items():
        tasks = part["tasks"] or {"-": None}
        for tname, t in tasks.items():
            if t is None:
                counts = f"{'':>8} {'':>8} {'':>8} {'':>10} {'':>6}"
            else:
                counts = (
                    f"{t['queued']:>8,} {t['leased']:>8,} {t['waiting']:>8,} "
                    f"{t['done']:>10,} {t['lost']:>6,}"
                )
            lines.append(f"{pname:<16.16} {tname:<16.16} {part['rows_live']:>8,} {counts}")
    lines += [
        "",
        f"{'server':<12} {'req/s':>9} {'in':>11} {'out':>11} {'rss':>12} {'held':>12} "
        f"{'clients/max':>13} {'refused':>8}",
    ]
    rss = ctl.get("memory", {}).get("resident_bytes", 0)
    lines.append(
        f"{'controller':<12} {_rates(ctl, prev_ctl, dt_s)} {_mib(rss):>12} {'':>12} "
        + _clients(ctl)
    )
    prev_units = [] if before is None else before["units"]
    for i, unit in enumerate(stats["units"]):
        name = f"unit {unit.get('unit', i)}"
        if "error" in unit:
            lines.append(f"{name:<12} {unit['error']}")
            continue
        prev = prev_units[i] if i < len(prev_units) and "error" not in prev_units[i] else None
        rss = unit.get("memory", {}).get("resident_bytes", 0)
        lines.append(
            f"{name:<12} {_rates(unit, prev, dt_s)} {_mib(rss):>12} {_mib(unit['bytes']):>12} "
            + _clients(unit)
        )
    shm = next((u["memory"]["shm_used_bytes"] for u in stats["units"] if "memory" in u), None)
    if shm is not None:
        lines.append(f"/dev/shm used on the units' host: {_mib(shm)}")
    return "\n".join(lines)


def run_top(
    read_stats: Callable[[], dict[str, Any]],
    *,
    interval_s: float = 2.0,
    iterations: int | None = None,
    out: TextIO | None = None,
    clear: bool = True,
) -> int:
    """Draw ``render(read_stats())`` every ``interval_s`` until ``iterations`` views (None:
    until interrupted) on ``out`` (None: ``sys.stdout`` as it is then). ``clear``: redraw in
    place (a terminal); else views one after another.
    """
    out = sys.stdout if out is None else out
    if iterations is not None and iterations < 1:
        raise ValueError(f"iterations must be >= 1 (or None: until Ctrl-C), got {iterations}")
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    before: dict[str, Any] | None = None
    t_before = 0.0
    n = 0
    try:
        while True:
            stats = read_stats()
            now = time.monotonic()
            view = render(stats, before, now - t_before)
            out.write((_CLEAR if clear else "") + view + "\n")
            out.flush()
            n += 1
            if iterations is not None and n >= iterations:
                return 0
            before, t_before = stats, now
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
