"""``python -m bench.rl --elastic``: the rollout's capacity changed while a run goes on.

One ``deploy=ray`` run of the ``async-k1`` schedule (simulated engines; the ``measured``
workload, SmolLM2's response lengths up to 1,024 tokens: with the long-tail one a single
sample of up to 8,192 tokens sets each step's pace, whatever the capacity) starts with 2
generators; once a third of its steps are recorded it is scaled to 4
(``asyncflow scale``'s control channel), and once as many steps again are recorded with 4, to
1. Three fixed-capacity runs (1, 2 and 4 generators, from start to end) on the same trainer
(the same training GPUs in every run: only the rollout's capacity changes) give what each
capacity is worth (each generator runs at most 16 sequences at once, so that a step needs 4
rounds of one, 1 round of four). Printed per phase of the elastic run: its steady throughput
(modelled samples/s, the phase's first two steps left out: the change's own cost) against the
fixed run of that size, and the ratio; then whether every group was trained exactly once and the
staleness bound held in every run. Writes ``bench/results/rl_elastic.json`` and
``rl_elastic.png`` (the elastic run's instances and throughput over time, the fixed runs'
throughput as lines).

    python -m bench.rl --elastic                 # 2 -> 4 -> 1 against fixed 1, 2, 4 (~8 min)
    python -m bench.rl --elastic --steps 24      # shorter phases
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncflow import RunResult
from asyncflow.control import ask
from bench.common import RESULTS_DIR, line, write_json
from engines.simulated import Calibration

__all__ = ["PLAN", "elastic", "phases"]

PLAN = (2, 4, 1)
"""The elastic run's rollout instances, phase by phase."""
TRAIN_GPUS = 16
"""The trainer's GPUs in every run (ample: the rollout sets the pace)."""
MAX_BATCH = 16
"""Sequences a generator runs at once: a step's 64 samples take 4 rounds on one generator, 1
on four (with the calibrated 64 one generator holds a whole step, and more add little)."""
SETTLE_STEPS = 2
"""Steps of a phase left out of its throughput (the change itself: a new generator loading
weights, a leaving one draining)."""


def _steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _until(out: Path, steps: int, done: threading.Event) -> bool:
    while not done.is_set():
        if _steps(out) >= steps:
            return True
        time.sleep(0.1)
    return False


def _scaler(out: Path, per_phase: int, done: threading.Event, seen: list[dict[str, Any]]) -> None:
    """Scale the run writing ``out`` through :data:`PLAN`: each change once ``per_phase``
    steps are recorded since the previous change returned."""
    since = 0
    for n in PLAN[1:]:
        if not _until(out, since + per_phase, done):
            return
        t0, at = time.monotonic(), _steps(out)
        reply = ask(out, {"op": "scale", "stage": "rollout", "n": n}, 600.0)
        since = _steps(out)
        seen.append(
            {"n": n, "asked_at_step": at, "done_at_step": since, "took_s": time.monotonic() - t0}
        )
        if not reply.get("ok"):
            raise RuntimeError(f"scale rollout={n} refused: {reply.get('error')}")


def phases(records: list[dict[str, Any]], time_scale: float) -> list[dict[str, Any]]:
    """The runs of consecutive records with the same rollout instances: their steps and
    steady throughput (modelled samples/s over the phase's records past the first
    :data:`SETTLE_STEPS`, and past the run's first record)."""
    out: list[dict[str, Any]] = []
    for i, rec in enumerate(records):
        n = int(rec["instances"]["rollout"])
        if not out or out[-1]["instances"] != n:
            out.append({"instances": n, "first_step": rec["step"], "records": []})
        out[-1]["last_step"] = rec["step"]
        if i:
            out[-1]["records"].append(rec)
    for ph in out:
        steady = ph.pop("records")[SETTLE_STEPS:]
        span = sum(float(r["step_s"]) for r in steady)
        samples = sum(int(r["samples"]) for r in steady)
        ph["steady_steps"] = len(steady)
        ph["samples_per_s"] = samples / span * time_scale if span else float("nan")
    return out


def _invariants(result: RunResult, groups_per_step: int, k: int) -> tuple[bool, bool]:
    trained = [g for rep in result.reports for g in rep.groups]
    once = trained == list(range(len(result.reports) * groups_per_step))
    bound = all(min(r.staleness) >= 0 and max(r.staleness) <= k for r in result.reports)
    return once, bound


def _plot(result: RunResult, fixed: dict[int, float], time_scale: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result.records[1:]
    t = [float(r["time_s"]) for r in recs]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.step(t, [r["instances"]["rollout"] for r in recs], where="post")
    top.set_ylabel("rollout instances")
    top.grid(alpha=0.3)
    top.set_title("elastic rollout: 2 -> 4 -> 1 generators (bench.rl --elastic)")
    rate = [r["samples"] / float(r["step_s"]) * time_scale for r in recs]
    bottom.plot(t, rate, label="elastic run, per step")
    for i, (n, v) in enumerate(sorted(fixed.items())):
        bottom.axhline(v, color=f"C{i + 1}", linestyle="--", label=f"fixed {n} generator(s)")
    bottom.set_xlabel("run time (s, real)")
    bottom.set_ylabel("samples/s (modelled)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def elastic(setup: Any, cal: Calibration, steps: int) -> dict[str, Any]:
    """Run the fixed-capacity runs and the elastic one (see the module doc); print and write
    the comparison; returns it."""
    from bench.rl import SCHEDULE_BY_NAME, analyse, run_schedule
    from bench.rl_ray import start_ray, stop_ray

    sched = SCHEDULE_BY_NAME["async-k1"]
    setup = replace(setup, max_batch=MAX_BATCH, workload="measured")
    k, b = sched.max_staleness, setup.groups_per_step
    checks: dict[str, tuple[bool, bool]] = {}
    fixed: dict[int, float] = {}
    seen: list[dict[str, Any]] = []
    start_ray(num_cpus=TRAIN_GPUS + max(PLAN) + 8)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncflow-elastic-") as tmp:
            short = replace(setup, steps=max(8, steps // 3))
            for n in sorted(set(PLAN)):
                g = replace(short, gpus=n + TRAIN_GPUS)
                res = run_schedule(sched, g, cal, Path(tmp) / f"fixed-{n}", n, deploy="ray")
                fixed[n] = analyse(res, g, n, TRAIN_GPUS)["samples_per_s"]
                checks[f"fixed {n}"] = _invariants(res, b, k)
                line(f"fixed {n} generator(s)", fixed[n], "samples/s")
            out = Path(tmp) / "elastic"
            done = threading.Event()
            scaler = threading.Thread(
                target=_scaler, args=(out, steps // 3, done, seen), daemon=True
            )
            scaler.start()
            g = replace(setup, steps=steps, gpus=PLAN[0] + TRAIN_GPUS)
            try:
                result = run_schedule(sched, g, cal, out, PLAN[0], deploy="ray")
            finally:
                done.set()
                scaler.join(timeout=60)
            checks["elastic"] = _invariants(result, b, k)
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            _plot(result, fixed, setup.time_scale, RESULTS_DIR / "rl_elastic.png")
    finally:
        stop_ray()
    table = phases(result.records, setup.time_scale)
    for ph in table:
        n = ph["instances"]
        if not ph["steady_steps"]:  # (a count passed on the way: scaling is one at a time)
            print(f"(passed through {n} generator(s) at step {ph['first_step']})")
            continue
        ph["fixed_samples_per_s"] = fixed.get(n)
        ph["over_fixed"] = ph["samples_per_s"] / fixed[n] if n in fixed else None
        line(
            f"elastic phase {n} generator(s), steps {ph['first_step']}-{ph['last_step']}",
            ph["samples_per_s"],
            "samples/s",
            fixed=fixed.get(n, float("nan")),
            ratio=ph["over_fixed"] if ph["over_fixed"] is not None else float("nan"),
            steady=ph["steady_steps"],
        )
    for c in seen:
        print(
            f"scale rollout={c['n']}: asked after step {c['asked_at_step']}, done after step "
            f"{c['done_at_step']} ({c['took_s']:.1f} s)"
        )
    for name, (once, bound) in checks.items():
        print(f"{name}: every group trained exactly once {once}; staleness <= {k} {bound}")
    if not all(once and bound for once, bound in checks.values()):
        raise SystemExit("an invariant failed (see above)")
    payload = {
        "command": " ".join(["python -m bench.rl", *sys.argv[1:]]),
        "setup": {**setup.__dict__, "steps": steps, "train_gpus": TRAIN_GPUS},
        "schedule": sched.name,
        "plan": list(PLAN),
        "fixed_samples_per_s": {str(n): v for n, v in fixed.items()},
        "phases": table,
        "scale_commands": seen,
        "steps": [
            {
                "step": r["step"],
                "time_s": r["time_s"],
                "instances": r["instances"]["rollout"],
                "samples_per_s": r["samples"] / float(r["step_s"]) * setup.time_scale,
            }
            for r in result.records
        ],
        "exactly_once": all(c[0] for c in checks.values()),
        "staleness_bound": all(c[1] for c in checks.values()),
    }
    write_json("rl_elastic", payload)
    return payload
