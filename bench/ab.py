"""A/B: one benchmark, run alternately from another source tree and from this one.

    python -m bench.ab OTHER_TREE                              # bench.throughput --no-ray, 2 rounds
    python -m bench.ab OTHER_TREE --rounds 3 -- --quick        # arguments after -- go to the bench
    python -m bench.ab OTHER_TREE --module bench.controller --keys 'per_s'

``OTHER_TREE`` is a checkout of the code to compare against (e.g. ``git worktree add
../base <commit>``, or ``git archive <commit> | tar -x -C ../base``). Each round runs the
benchmark module once from each tree (the order alternates between rounds, so drift on a
shared machine falls on both), as a separate process whose ``PYTHONPATH`` and working
directory are that tree. The benchmark's JSON results are collected, and for every numeric
result whose name matches ``--keys`` (default: GB/s and rates, higher is better) it prints
the ratio this/other of the best round on each side, and beside it the ratio of the medians.

The best round is the verdict, for the reason the benchmarks themselves report the best of
several tries: on a shared machine noise only slows a run down (another process, the host
taking the core back), so the fastest of N rounds estimates what the code can do, and it
converges as N grows while the median keeps the noise. Each run's CPU time stolen by the host
and the load average are recorded beside its results (``runs_env``), so a round that ran on a
busy machine can be seen. Writes ``ab-<module>.json`` to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import line, write_json


def _flatten(obj: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out[prefix] = float(obj)
    return out


def _cpu_ticks() -> tuple[int, int]:
    """(all, stolen) CPU ticks since boot, from /proc/stat; (0, 0) where there is none."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0, 0
    ticks = [int(f) for f in fields]
    return sum(ticks[:8]), ticks[7] if len(ticks) > 7 else 0


def run_once(
    tree: Path, module: str, args: list[str], out_dir: Path
) -> tuple[dict[str, float], dict[str, float]]:
    """Run ``python -m module args`` from ``tree``: its JSON results, flattened, and the
    machine's state while it ran (share of CPU time stolen by the host, load average)."""
    env = dict(os.environ, ASYNCFLOW_BENCH_DIR=str(out_dir))
    extra = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *([extra] if extra else [])])
    print(f"--- {tree}: python -m {module} {' '.join(args)}", flush=True)
    all0, steal0 = _cpu_ticks()
    subprocess.run([sys.executable, "-m", module, *args], cwd=tree, env=env, check=True)
    all1, steal1 = _cpu_ticks()
    state = {
        "steal_share": (steal1 - steal0) / (all1 - all0) if all1 > all0 else 0.0,
        "load_1min": os.getloadavg()[0],
    }
    name = module.rsplit(".", 1)[-1]
    return _flatten(json.loads((out_dir / f"{name}.json").read_text())), state


def compare(other: list[float], this: list[float]) -> tuple[float, float]:
    """(best this / best other, median this / median other) of one higher-is-better result."""
    best_other, med_other = max(other), statistics.median(other)
    best = max(this) / best_other if best_other else float("nan")
    median = statistics.median(this) / med_other if med_other else float("nan")
    return best, median


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("other", type=Path, help="the source tree to compare against")
    ap.add_argument("--module", default="bench.throughput")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", default=r"GBps/|_per_s", help="regex of the results to compare")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    args = argv[cut + 1 :] or (["--no-ray"] if a.module == "bench.throughput" else [])
    trees = {"other": a.other.resolve(), "this": Path.cwd().resolve()}
    runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    runs_env: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["other", "this"] if r % 2 == 0 else ["this", "other"]
            for side in order:
                out = Path(tmp) / f"{side}-{r}"
                results, state = run_once(trees[side], a.module, args, out)
                runs[side].append(results)
                runs_env[side].append(state)
                print(
                    f"    round {r + 1}/{a.rounds} {side}: host stole "
                    f"{100 * state['steal_share']:.1f}% of CPU, load {state['load_1min']:.2f}",
                    flush=True,
                )
    keys = [k for k in runs["this"][0] if re.search(a.keys, k) and k in runs["other"][0]]
    summary: dict[str, Any] = {"module": a.module, "args": args, "rounds": a.rounds}
    worst = float("inf")
    for k in keys:
        ratio, median_ratio = compare(
            [run[k] for run in runs["other"]], [run[k] for run in runs["this"]]
        )
        best_this, best_other = (
            max(run[k] for run in runs["this"]),
            max(run[k] for run in runs["other"]),
        )
        summary[k] = {
            "other": best_other,
            "this": best_this,
            "ratio": ratio,
            "median_ratio": median_ratio,
        }
        line(
            f"{k}: this {best_this:.4g} vs other {best_other:.4g}", ratio, "x", median=median_ratio
        )
        worst = min(worst, ratio)
    summary["worst_ratio"] = worst
    line("slowest case (best round each side)", worst, "x")
    summary["runs"] = runs
    summary["runs_env"] = runs_env
    write_json(f"ab-{a.module.rsplit('.', 1)[-1]}", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
