"""A/B: one benchmark, run alternately from another source tree and from this one.

    python -m bench.ab OTHER_TREE                              # bench.throughput --no-ray, 2 rounds
    python -m bench.ab OTHER_TREE --rounds 3 -- --quick        # arguments after -- go to the bench
    python -m bench.ab OTHER_TREE --module bench.controller --keys 'per_s'
    python -m bench.ab OTHER_TREE --rounds 6 --add earlier/ab-throughput.json   # pool rounds

``OTHER_TREE`` is a checkout of the code to compare against (e.g. ``git worktree add
../base <commit>``, or ``git archive <commit> | tar -x -C ../base``). Each round runs the
benchmark module once from each tree (the order alternates between rounds, so drift on a
shared machine falls on both), as a separate process whose ``PYTHONPATH`` and working
directory are that tree. The benchmark's JSON results are collected, and for every numeric
result whose name matches ``--keys`` (default: GB/s and rates, higher is better) it prints
the ratio this/other.

The verdict is the geometric mean of the rounds' paired ratios (each round's this/other, the
two runs next to each other in time), with its 95% confidence interval from the spread of
those ratios (Student's t on their logarithms). Pairing cancels the machine's drift between
rounds; the mean uses every round, where the best or the median of each side keeps one run's
luck (on a 2-core machine the same code moves by 15-20% from one process to the next, and
not only downwards: a large copy's speed depends on where its pages land). The ratios of the
best rounds and of the medians are printed beside it. The interval says whether the rounds
were enough: a case whose interval holds 1.0 is not shown to differ. Each run's CPU time
stolen by the host and the load average are recorded beside its results (``runs_env``).
Results that are the benchmark's own baselines (``--baseline``: raw ZeroMQ, Ray's object
store, memcpy; the same code on both sides) are printed apart, as the noise floor of the run,
and not counted as the slowest case. ``--add`` pools the rounds of earlier runs (their JSON).
Writes ``ab-<module>.json`` to ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
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


_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
"""Student's t, two-sided 95%, by degrees of freedom (2.0 from 10 on: within 5% of it)."""


@dataclass(frozen=True)
class Comparison:
    """One higher-is-better result, this tree against the other, over paired rounds."""

    ratio: float
    """Geometric mean of the rounds' this/other ratios: the verdict."""
    low: float
    high: float
    """Its 95% confidence interval (``nan`` with one round)."""
    best_ratio: float
    """Best round of this side over best round of the other."""
    median_ratio: float
    """Median of this side over median of the other."""


def compare(other: list[float], this: list[float]) -> Comparison:
    """``this`` against ``other``, round by round (the two lists pair up in round order)."""
    if len(other) != len(this) or not other:
        raise ValueError(
            f"need the same number of rounds on each side, got {len(other)} and {len(this)}"
        )
    if min(other) <= 0 or min(this) <= 0:
        nan = float("nan")
        return Comparison(nan, nan, nan, nan, nan)
    logs = [math.log(b / a) for a, b in zip(other, this, strict=True)]
    mean = statistics.fmean(logs)
    if len(logs) > 1:
        half = _T95.get(len(logs) - 1, 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
    else:
        half = float("nan")
    return Comparison(
        ratio=math.exp(mean),
        low=math.exp(mean - half),
        high=math.exp(mean + half),
        best_ratio=max(this) / max(other),
        median_ratio=statistics.median(this) / statistics.median(other),
    )


def load_rounds(path: Path, module: str) -> dict[str, Any]:
    """The rounds of an earlier run of this script (its JSON), checked to be of ``module``."""
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("module") != module:
        raise SystemExit(f"{path}: rounds of {data.get('module')!r}, not of {module!r} (--module)")
    sides = data.get("runs", {})
    if len(sides.get("other", [])) != len(sides.get("this", [])) or not sides.get("this"):
        raise SystemExit(f"{path}: no paired rounds under 'runs'")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("other", type=Path, help="the source tree to compare against")
    ap.add_argument("--module", default="bench.throughput")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", default=r"GBps/|_per_s", help="regex of the results to compare")
    ap.add_argument(
        "--baseline",
        default=r"raw zmq|ray object store|memcpy",
        help="regex of the results that are the benchmark's own baselines (the same code on\n"
        "both sides): shown as the noise floor, not counted in the verdict",
    )
    ap.add_argument(
        "--add",
        type=Path,
        action="append",
        default=[],
        metavar="AB_JSON",
        help="pool the rounds of an earlier ab-<module>.json of the same module and trees\n"
        "(repeatable; with --rounds 0, only recomputes the verdict from them)",
    )
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    args = argv[cut + 1 :] or (["--no-ray"] if a.module == "bench.throughput" else [])
    trees = {"other": a.other.resolve(), "this": Path.cwd().resolve()}
    runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    runs_env: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
    for earlier in a.add:
        pooled = load_rounds(earlier, a.module)
        for side in ("other", "this"):
            runs[side] += pooled["runs"][side]
            runs_env[side] += pooled.get("runs_env", {}).get(side, [{}] * len(pooled["runs"][side]))
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
    if not runs["this"]:
        ap.error("no rounds: give --rounds or --add")
    keys = [k for k in runs["this"][0] if re.search(a.keys, k) and k in runs["other"][0]]
    summary: dict[str, Any] = {
        "module": a.module,
        "args": args,
        "rounds": len(runs["this"]),
        "pooled_from": [str(p) for p in a.add],
    }
    worst: dict[str, float] = {}
    floor: list[float] = []
    for k in keys:
        c = compare([run[k] for run in runs["other"]], [run[k] for run in runs["this"]])
        summary[k] = {
            "other": statistics.median(run[k] for run in runs["other"]),
            "this": statistics.median(run[k] for run in runs["this"]),
            **asdict(c),
        }
        line(
            f"{k}",
            c.ratio,
            "x",
            ci95=f"{c.low:.3f}-{c.high:.3f}",
            best=c.best_ratio,
            median=c.median_ratio,
        )
        if math.isnan(c.ratio):
            continue
        if re.search(a.baseline, k):
            floor.append(c.ratio)
        elif not worst or c.ratio < min(worst.values()):
            worst = {k: c.ratio}
    if floor:
        summary["baseline_ratios"] = [min(floor), max(floor)]
        print(
            f"the benchmark's own baselines (the same code on both sides): {min(floor):.3f}x to "
            f"{max(floor):.3f}x, the noise of {len(runs['this'])} rounds",
            flush=True,
        )
    if worst:
        ((case, ratio),) = worst.items()
        summary["worst"] = {"case": case, "ratio": ratio}
        line(f"slowest case: {case}", ratio, "x")
    summary["runs"] = runs
    summary["runs_env"] = runs_env
    write_json(f"ab-{a.module.rsplit('.', 1)[-1]}", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
