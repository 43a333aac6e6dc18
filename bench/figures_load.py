"""The renderers of ``python -m bench.load``'s figures (the README line and the table of
docs/transferqueue/performance.md). :mod:`bench.figures` registers them itself (it runs as
``__main__`` too), and they import its helpers when called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Json = dict[str, Any]


def readme_load(load: Callable[[str], Json]) -> str:
    from bench.figures import day, num, x  # (lazy: bench.figures registers this one)

    d = load("load")
    big = [c for c in d["cases"] if c["clients"] == max(c["clients"] for c in d["cases"])]
    parts = []
    for c in big:
        ph = c["phases"]
        parts.append(
            f"{c.get('deploy', 'local')}: {num(ph['saturated']['rows_per_s'])} rows/s saturated "
            f"({x(d['throughput_ratio'][c.get('deploy', 'local')])} that of "
            f"{min(k['clients'] for k in d['cases']):,} clients), paced `get_meta` p99 "
            f"{ph['paced']['latency_ms']['get_meta']['p99']:.1f} ms"
        )
    once = (
        "every row read exactly once"
        if d["goals"].get("every row read exactly once")
        else ("**rows lost or read twice**")
    )
    n = big[0]["clients"]
    peer = d.get("peer") or {}
    vs = ""
    if "ours_over_peer" in peer:
        r = peer["ours_over_peer"].get("local")
        if r is not None:
            vs = (
                f"; against TransferQueue 0.1.11 at {peer['clients']:,} clients "
                f"{x(r['saturated_rows_per_s'])} its saturated throughput"
            )
    return (
        f"- {n:,} concurrent clients on one service (`python -m bench.load`, run of {day(d)}): "
        + "; ".join(parts)
        + f"; {once}{vs}.\n"
    )


def _load_row(c: Json) -> list[str]:
    from bench.figures import num

    paced, sat = c["phases"]["paced"], c["phases"]["saturated"]
    n, deploy = c["clients"], c.get("deploy", "local")
    ctl = c["servers"]["controller"]
    if deploy == "peer":  # (its clients open their sockets on first use: the phase's figures)
        ph = sat["servers"]["controller"]
        rss, per = ph["rss_mb"], (ph["rss_mb"] - ctl["rss_mb_before_clients"]) * 1024 / n
        fds = ph["fds"]
    else:
        rss, per, fds = ctl["rss_mb"], ctl["kb_per_client"], ctl["fds"]
    eo = c["exactly_once"]
    once = "yes" if eo["twice"] == eo["missing"] == eo["extra"] == 0 else "**no**"
    return [
        deploy if deploy != "peer" else "peer (TQ 0.1.11)",
        f"{n:,}",
        num(sat["rows_per_s"]),
        f"{sat['fairness_min_over_mean']:.2f}",
        f"{paced['latency_ms']['get_meta']['p50']:.1f} / "
        f"{paced['latency_ms']['get_meta']['p99']:.1f}",
        num(sat["latency_ms"]["get_meta"]["p99"]),
        f"{rss:.0f} MB, {per:.0f} KB",
        f"{int(fds):,}",
        f"{c['connect_s']:.1f} s",
        once,
    ]


def load_table(load: Callable[[str], Json]) -> str:
    from bench.figures import _table, day, x

    d = load("load")
    rows = [_load_row(c) for c in d["cases"]]
    peer = d.get("peer")
    if peer and "error" not in peer:
        rows.append(_load_row(peer))
    head = [
        "service",
        "clients",
        "rows/s (saturated)",
        "slowest / mean client",
        "get_meta p50 / p99, paced (ms)",
        "get_meta p99, saturated (ms)",
        "controller RSS, per client",
        "controller fds",
        "connect all",
        "exactly once",
    ]
    goals = "; ".join(f"{g}: {'met' if ok else '**not met**'}" for g, ok in d["goals"].items())
    ratios = ", ".join(f"{k} {x(v)}" for k, v in d["throughput_ratio"].items())
    vs = "".join(
        f" The peer broke with {b['clients']:,} clients ({b['stage']}: "
        f"{str(b['error']).split(': ', 1)[-1][:160]})."
        for b in (peer or {}).get("broke_at", [])
    )
    if peer and "ours_over_peer" in peer:
        vs += (
            " At {:,} clients against the peer: ".format(peer["clients"])
            + "; ".join(
                f"{k} {x(v['saturated_rows_per_s'])} its saturated throughput"
                for k, v in peer["ours_over_peer"].items()
            )
            + "; its paced get_meta p99 {:.1f} ms against ours {}".format(
                peer["phases"]["paced"]["latency_ms"]["get_meta"]["p99"],
                ", ".join(
                    f"{c['phases']['paced']['latency_ms']['get_meta']['p99']:.1f} ms "
                    f"({c.get('deploy', 'local')})"
                    for c in d["cases"]
                    if c["clients"] == peer["clients"]
                ),
            )
            + "."
        )
    restarts = [
        f"{c['clients']:,} clients [{c.get('deploy', 'local')}]: the controller was away "
        f"{rs['controller_away_s']:.1f} s, the longest call took {rs['longest_call_s']:.1f} s, "
        f"{rs['failed_calls']} calls failed, {rs['clients_served_after']:,} clients were "
        "served after it"
        for c in d["cases"]
        if (rs := c["phases"].get("restart", {}).get("restart")) is not None
    ]
    rs_text = (
        "\nThe controller SIGKILLed and restarted with its state under load (every client "
        "as fast as it can): " + "; ".join(restarts) + ".\n"
        if restarts
        else ""
    )
    return (
        f"Run of {day(d)} (`docs/bench/load.json`, `{d['command'].strip()}`; saturated "
        "throughput at "
        f"the largest N over the smallest: {ratios}).{vs} Goals: {goals}.\n\n"
        + _table(head, rows)
        + rs_text
    )
