"""A/B: one benchmark, run alternately from another source tree and from this one.

    python -m bench.ab OTHER_TREE                              # bench.throughput --no-ray, 2 rounds
    python -m bench.ab OTHER_TREE --rounds 3 -- --quick        # arguments after -- go to the bench
    python -m bench.ab OTHER_TREE --module bench.controller --keys 'per_s'

``OTHER_TREE`` is a checkout of the code to compare against (e.g. ``git worktree add
../base <commit>``, or ``git archive <commit> | tar -x -C ../base``). Each round runs the
benchmark module once from each tree (the order alternates between rounds, so drift on a
shared machine falls on both), as a separate process whose ``PYTHONPATH`` and working
directory are that tree. The benchmark's JSON results are collected, and for every numeric
result whose name matches ``--keys`` (default: GB/s and rates) it prints the median of
each side and the ratio this/other. Writes ``ab-<module>.json`` to ``bench/results/``.
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


def run_once(tree: Path, module: str, args: list[str], out_dir: Path) -> dict[str, float]:
    """Run ``python -m module args`` from ``tree``; its JSON results, flattened."""
    env = dict(os.environ, ASYNCFLOW_BENCH_DIR=str(out_dir))
    extra = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *([extra] if extra else [])])
    print(f"--- {tree}: python -m {module} {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", module, *args], cwd=tree, env=env, check=True)
    name = module.rsplit(".", 1)[-1]
    return _flatten(json.loads((out_dir / f"{name}.json").read_text()))


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
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["other", "this"] if r % 2 == 0 else ["this", "other"]
            for side in order:
                out = Path(tmp) / f"{side}-{r}"
                runs[side].append(run_once(trees[side], a.module, args, out))
    keys = [k for k in runs["this"][0] if re.search(a.keys, k) and k in runs["other"][0]]
    summary: dict[str, Any] = {"module": a.module, "args": args, "rounds": a.rounds}
    for k in keys:
        other = statistics.median(run[k] for run in runs["other"])
        this = statistics.median(run[k] for run in runs["this"])
        ratio = this / other if other else float("nan")
        summary[k] = {"other": other, "this": this, "ratio": ratio}
        line(f"{k}: this {this:.4g} vs other {other:.4g}", ratio, "x")
    summary["runs"] = runs
    write_json(f"ab-{a.module.rsplit('.', 1)[-1]}", summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
