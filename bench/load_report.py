"""How ``python -m bench.load`` prints a case and draws its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import line

P99_GOAL_MS = 50.0  # (bench.load's goal, drawn on the plot)


def print_case(r: dict[str, Any]) -> None:
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
            **({"clients_cpu": ph["clients_cpu_share"]} if "clients_cpu_share" in ph else {}),
            ctl_cpu=ph["servers"]["controller"]["cpu_share"],
            unit_cpu=ph["servers"]["unit"]["cpu_share"],
        )
        rs = ph.get("restart")
        if rs is not None:
            line(
                f"  controller restarted under {n} clients [{deploy}]",
                rs["controller_away_s"],
                "s away",
                failed_calls=rs["failed_calls"],
                longest_call_s=rs["longest_call_s"],
                clients_served_after=rs["clients_served_after"],
            )
            for e in rs["errors"]:
                print(f"    {e}", flush=True)
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


def plot(cases: list[dict[str, Any]], path: Path) -> None:
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
