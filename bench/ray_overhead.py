"""What ``deploy=ray`` costs the tiny demo against ``deploy=local``: per synchronous step, and
before the first step, measured in one run.

    python -m bench.ray_overhead                 # 40 steps per deployment, 2 rounds
    python -m bench.ray_overhead --steps 20 --rounds 1   # quicker
    python -m bench.ray_overhead --set reward.colocate=true   # both runs with an override

Each run is ``examples/grpo_arithmetic.py``'s default config (the tiny Llama, real HF engines,
TransferQueue) with ``train.max_staleness=0``, so every step waits for the one before: a step's
time is generation + reward + training + everything that moves data and weights between
them, and what ``deploy=ray`` adds to it is what the stages pay for being actors (actor
calls, TransferQueue over ZeroMQ instead of in-process, the weight publish through a
transport instead of a reference). Runs alternate local / ray, each in a fresh Python process
started the way a user starts the demo, so time to first step includes the interpreter, the
imports, Ray's start-up and the actors' (the local cluster is started by the run itself:
``deploy.address`` unset).

Prints, against ``deploy=local`` measured in the same run: the median step (steps after the
first ``--skip``), ``ray - local`` per step in ms, and the time to the first step in s;
writes ``bench/results/ray_overhead.json`` (also every step's time, each run's start-up
phases from the deployment's log line, and its step breakdown by stage).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import line, write_json

ROOT = Path(__file__).resolve().parents[1]
GOAL_OVERHEAD_MS = 20.0  # ray - local per synchronous step
GOAL_FIRST_STEP_S = 15.0  # time to first step under deploy=ray (2-core machine)
_RUN_TIMEOUT_S = 1800.0


def _child(mode: str, steps: int, out: Path, extra: list[str]) -> None:
    """One run (in this fresh process): the demo's config, synchronous, ``steps`` steps, and
    the overrides ``extra``."""
    from asyncflow import load_config, run

    logging.basicConfig(level=logging.WARNING)  # as the command line does
    logging.getLogger("asyncflow.deploy.ray").setLevel(logging.INFO)  # its start-up phases
    overrides = [
        f"deploy.mode={mode}",
        "train.max_staleness=0",
        f"train.steps={steps}",
        f"output.dir={out}",
        "output.plot=false",
        "output.loggers=[jsonl]",
        *extra,
    ]
    result = run(load_config(None, overrides))
    origin = result.timeline.origin
    summary = {
        "mode": mode,
        "first_step_wall": origin + result.records[0]["time_s"],
        "step_s": [r["step_s"] for r in result.records],
        "stages": [r["stages"] for r in result.records],
        "wall_s": result.wall_s,
        "extra": {k: v for k, v in result.extra.items() if isinstance(v, int | float | str)},
    }
    print("RESULT " + json.dumps(summary), flush=True)


def _run(mode: str, steps: int, extra: list[str]) -> dict[str, Any]:
    """A run in a fresh process; its summary with ``first_step_s`` (from the spawn)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with tempfile.TemporaryDirectory(prefix="ray-overhead-") as out:
        cmd = [sys.executable, "-m", "bench.ray_overhead", "--child", mode, "--steps", str(steps)]
        cmd += [f"--set={x}" for x in extra]
        started = time.time()
        proc = subprocess.run(
            [*cmd, "--out", out],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=_RUN_TIMEOUT_S,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"deploy={mode} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    result = next(
        json.loads(x[len("RESULT ") :]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")
    )
    result["first_step_s"] = result.pop("first_step_wall") - started
    result["startup_log"] = [x for x in proc.stderr.splitlines() if "deploy=ray:" in x][-1:]
    return result


def _median_ms(runs: list[dict[str, Any]], skip: int) -> float:
    steps = [s for r in runs for s in r["step_s"][skip:]]
    return 1000.0 * statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=40, help="steps per run")
    ap.add_argument("--rounds", type=int, default=2, help="local/ray pairs, alternating")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median")
    ap.add_argument("--child", choices=["local", "ray"], help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for both deployments' runs (repeatable)",
    )
    args = ap.parse_args()
    if args.child:
        if args.out is None:  # (a child started by hand: its run's files in a temporary folder)
            with tempfile.TemporaryDirectory(prefix="ray-overhead-") as out:
                _child(args.child, args.steps, Path(out), args.set)
            return
        _child(args.child, args.steps, args.out, args.set)
        return
    if args.steps <= args.skip:
        ap.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    runs: dict[str, list[dict[str, Any]]] = {"local": [], "ray": []}
    for r in range(args.rounds):
        for mode in ("local", "ray") if r % 2 == 0 else ("ray", "local"):
            got = _run(mode, args.steps, args.set)
            runs[mode].append(got)
            print(
                f"round {r + 1} {mode}: first step after {got['first_step_s']:.1f} s, median "
                f"step {1000 * statistics.median(got['step_s'][args.skip :]):.1f} ms",
                flush=True,
            )
    local_ms = _median_ms(runs["local"], args.skip)
    ray_ms = _median_ms(runs["ray"], args.skip)
    first = {m: statistics.median(r["first_step_s"] for r in rs) for m, rs in runs.items()}
    line("synchronous step, deploy=local", local_ms, "ms/step")
    line("synchronous step, deploy=ray", ray_ms, "ms/step", ratio=ray_ms / local_ms)
    line("ray overhead per step", ray_ms - local_ms, "ms", goal=f"<={GOAL_OVERHEAD_MS:g}")
    line("first step, deploy=local", first["local"], "s")
    line("first step, deploy=ray", first["ray"], "s", goal=f"<={GOAL_FIRST_STEP_S:g}")
    write_json(
        "ray_overhead",
        {
            "command": "python -m bench.ray_overhead " + " ".join(sys.argv[1:]),
            "settings": {
                "steps": args.steps,
                "rounds": args.rounds,
                "skip": args.skip,
                "overrides": args.set,
            },
            "step_ms": {"local": local_ms, "ray": ray_ms, "overhead": ray_ms - local_ms},
            "first_step_s": first,
            "goals": {"overhead_ms": GOAL_OVERHEAD_MS, "first_step_s": GOAL_FIRST_STEP_S},
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
