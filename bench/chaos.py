"""Chaos: random faults in a ``deploy=ray`` training run, the invariants checked, each fault's
cost measured.

    python -m bench.chaos                               # 200 steps, 6 faults
    python -m bench.chaos --steps 30 --faults 2         # the slow tier's short version
    python -m bench.chaos --targets generator,unit --kinds freeze

The run: the tiny model (64 new tokens, 8 groups of 4 a step), ``train.dp_size=2`` (ddp),
``rollout.instances=2``, one reward worker, TransferQueue on Ray with two storage units and
``replicas=2``, ``max_staleness=1``.
After a few steps a fault thread applies one fault at a time, each picked at random (seeded)
and each target hit at least once when there are as many faults as targets:

| kind   | what it does to the target's process                                          |
|--------|-------------------------------------------------------------------------------|
| freeze | SIGSTOP for ``--freeze-s``, then SIGCONT (if it is still there to wake)       |
| kill   | SIGKILL                                                                       |
| slow   | SIGSTOP and SIGCONT every half second for ``--freeze-s`` (a swapping host)    |

| target          | the Ray actor                                    |
|-----------------|--------------------------------------------------|
| rollout         | the rollout dispatcher (holds the prompts' leases)|
| generator       | a generation engine host (one of two)            |
| reward          | the reward worker                                |
| trainer rank 0  | rank 0 of the ddp group (runs the train stage)   |
| trainer rank 1  | rank 1 of the ddp group                          |
| unit            | a TransferQueue storage unit (one of two, each row on both) |

The faults are spread over the first three quarters of the run (the i-th once ``5 + i x (3
steps / 4 - 5) / faults`` steps are recorded), and one waits until the run has recorded
:data:`RECOVERY_STEPS` steps after the previous one ended. At the end it checks what must hold
whatever happened: the run completed, every group was trained exactly once and each step
trained exactly its own window of groups, whole (no partial group), within the staleness bound;
and it prints, per fault, when the stall watch named it (freezes), the slowest step from the
fault's start to the end of its recovery, and that over the run's median step. Exit status 1
when an invariant fails. The environment server of an external environment is not among the
targets (no environment here): ``tests/asyncflow/test_openenv_workflow.py`` freezes one mid-
run.

Results go to ``bench/results/chaos.json``; ``python -m bench.figures --update chaos`` puts
them in docs/transferqueue/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "chaos.json"

KINDS = ("freeze", "kill", "slow")
TARGETS = {
    "rollout": ("run", "-rollout"),
    "generator": ("run", "-instance{i}"),
    "reward": ("run", "-reward-0"),
    "trainer rank 0": ("run", "-train-rank0"),
    "trainer rank 1": ("run", "-train-rank1"),
    "unit": ("tq", "-unit{i}"),
}
"""A target's Ray actor: whose prefix (the run's stage hosts, or TransferQueue's servers) and
the end of its name (``{i}``: one of two, picked at random)."""
FIRST_STEP = 5
"""Steps recorded before the first fault."""
RECOVERY_STEPS = 3
"""Steps recorded after a fault ended before the next one starts."""
SLICE_S = 0.5
"""A slow process's stopped and running halves."""


@dataclass
class Fault:
    kind: str
    target: str
    actor: str = ""
    pid: int = 0
    start: float = 0.0
    end: float = 0.0
    steps_at_start: int = 0
    steps_at_recovery: int = 0
    named_after_s: float | None = None
    worst_step_s: float | None = None
    cost_s: float | None = None
    notes: list[str] = field(default_factory=list)


def plan(n: int, seed: int, kinds: list[str], targets: list[str]) -> list[Fault]:
    """``n`` faults: the targets in a random order (each once while faults remain, then
    again), each with a random kind."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < n:
        order += rng.sample(targets, len(targets))
    return [Fault(rng.choice(kinds), t) for t in order[:n]]


def _steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    with contextlib.suppress(OSError):
        return len(metrics.read_text().splitlines())
    return 0


def _until_steps(out: Path, n: int, stop: threading.Event, deadline_s: float = 900.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while not stop.is_set() and time.monotonic() < deadline:
        if _steps(out) >= n:
            return True
        time.sleep(0.2)
    return False


def _actor_pid(name: str, tq: bool) -> int:
    import ray

    actor: Any = ray.get_actor(name)
    if tq:
        return int(ray.get(actor.pid.remote(), timeout=60))
    return int(ray.get(actor.where.remote(), timeout=60)["pid"])


def _find(fault: Fault, tq_prefix: str, rng: random.Random) -> str:
    """The Ray actor name of ``fault``'s target now."""
    import ray

    whose, tail = TARGETS[fault.target]
    tail = tail.format(i=rng.randrange(2))
    actors: list[Any] = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] for a in actors]
    if whose == "tq":
        return f"{tq_prefix}{tail}"
    return max(n for n in names if n.startswith("asyncflow-") and n.endswith(tail))


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:  # (killed and replaced meanwhile)
        return False


def apply(fault: Fault, freeze_s: float, stop: threading.Event) -> None:
    """Do ``fault`` to its process (its pid found already)."""
    if fault.kind == "kill":
        _signal(fault.pid, signal.SIGKILL)
        return
    if fault.kind == "freeze":
        _signal(fault.pid, signal.SIGSTOP)
        stop.wait(freeze_s)
        if not _signal(fault.pid, signal.SIGCONT):
            fault.notes.append("gone before it was woken (replaced)")
        return
    deadline = time.monotonic() + freeze_s  # slow
    while time.monotonic() < deadline and not stop.is_set():
        if not _signal(fault.pid, signal.SIGSTOP):
            fault.notes.append("gone while slowed (replaced)")
            return
        time.sleep(SLICE_S)
        _signal(fault.pid, signal.SIGCONT)
        time.sleep(SLICE_S)


def chaos(
    out: Path,
    steps: int,
    faults: list[Fault],
    tq_prefix: str,
    freeze_s: float,
    seed: int,
    stop: threading.Event,
) -> None:
    """The fault thread: one fault at a time (see the module doc)."""
    rng = random.Random(seed + 1)
    # (over the first three quarters of the run: the last fault's recovery fits in it)
    gap = max(RECOVERY_STEPS, (3 * steps // 4 - FIRST_STEP) // max(1, len(faults)))
    after = FIRST_STEP
    for i, fault in enumerate(faults):
        after = max(after, FIRST_STEP + i * gap)  # (spread over the run)
        if not _until_steps(out, after, stop):
            fault.notes.append("not applied: the run ended first")
            return
        try:
            fault.actor = _find(fault, tq_prefix, rng)
            fault.pid = _actor_pid(fault.actor, TARGETS[fault.target][0] == "tq")
        except Exception as e:  # (a target restarting: counted as not applied)
            fault.notes.append(f"not applied: {e!r}")
            after = _steps(out) + 1
            continue
        fault.steps_at_start = _steps(out)
        fault.start = time.time()
        print(
            f"chaos: {fault.kind} {fault.target} ({fault.actor}, pid {fault.pid}) at step "
            f"{fault.steps_at_start}",
            flush=True,
        )
        apply(fault, freeze_s, stop)
        fault.end = time.time()
        after = _steps(out) + RECOVERY_STEPS
        fault.steps_at_recovery = after


class _Stalls(logging.Handler):
    """The stall watch's WARNINGs, with when they came."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.told: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("stall:"):
            self.told.append((record.created, message))


def measure(
    faults: list[Fault], records: list[dict[str, Any]], told: list[tuple[float, str]]
) -> float:
    """Each fault's named-after and cost (see the module doc); the median step."""
    step_s = [float(r["step_s"]) for r in records]
    median = statistics.median(step_s)
    for f in faults:
        if not f.start:
            continue
        last = min(len(step_s), max(f.steps_at_recovery, f.steps_at_start + 1))
        window = step_s[f.steps_at_start : last]
        if window:
            f.worst_step_s = max(window)
            f.cost_s = f.worst_step_s - median
        pid = f"pid {f.pid}"
        named = [t for t, m in told if t >= f.start and pid in m]
        if named:
            f.named_after_s = named[0] - f.start
    return median


def check(result: Any, cfg: Any) -> list[str]:
    """What must hold whatever happened: a list of what did not."""
    b, g, k = cfg.train.groups_per_step, cfg.rollout.group_size, cfg.train.max_staleness
    failed = []
    trained = [x for rep in result.reports for x in rep.groups]
    if trained != list(range(cfg.train.steps * b)):
        failed.append(f"groups not trained exactly once in order: {trained}")
    for rep in result.reports:
        if rep.groups != list(range(rep.step * b, (rep.step + 1) * b)):
            failed.append(f"step {rep.step} trained groups {rep.groups}, not its window")
        if rep.samples != b * g:
            failed.append(f"step {rep.step} trained {rep.samples} samples, not {b * g}")
        if rep.staleness and not (min(rep.staleness) >= 0 and max(rep.staleness) <= k):
            failed.append(f"step {rep.step} staleness {sorted(set(rep.staleness))} > {k}")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--faults", type=int, default=len(TARGETS), help="each target once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--freeze-s", type=float, default=15.0, help="a freeze's or slowdown's length")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    targets = [t.replace("_", " ") for t in args.targets.split(",")]
    bad = [k for k in kinds if k not in KINDS] + [t for t in targets if t not in TARGETS]
    if bad:
        ap.error(f"unknown kinds or targets {bad}; kinds: {list(KINDS)}, targets: {list(TARGETS)}")

    from asyncflow import load_config, run
    from bench.rl_ray import start_ray, stop_ray
    from transferqueue.deploy.ray import start_on_ray

    faults = plan(args.faults, args.seed, kinds, targets)
    start_ray(num_cpus=16)
    stalls = _Stalls()
    logging.getLogger("asyncflow").addHandler(stalls)
    tq_prefix = f"chaos-tq-{os.getpid()}"
    try:
        with (
            tempfile.TemporaryDirectory(prefix="chaos-") as tmp,
            start_on_ray(num_units=2, replicas=2, name_prefix=tq_prefix) as tq,
        ):
            out = Path(tmp) / "run"
            cfg = load_config(
                overrides=[
                    f"output.dir={out}",
                    "output.progress=false",
                    "output.loggers=[jsonl]",
                    "output.plot=false",
                    "deploy.mode=ray",
                    "deploy.start_timeout_s=300",
                    "transferqueue.mode=connect",
                    f"transferqueue.address={tq.address}",
                    f"train.steps={args.steps}",
                    "train.dp_size=2",
                    "train.groups_per_step=8",
                    "train.max_staleness=1",
                    "rollout.instances=2",
                    "rollout.group_size=4",
                    "rollout.micro_batch_groups=1",
                    "rollout.max_new_tokens=64",
                    "model.warm_start_steps=0",
                ]
            )
            stop = threading.Event()
            thread = threading.Thread(
                target=chaos,
                args=(out, args.steps, faults, tq_prefix, args.freeze_s, args.seed, stop),
                daemon=True,
            )
            thread.start()
            t0 = time.perf_counter()
            try:
                result = run(cfg)
            finally:
                stop.set()
                thread.join(timeout=args.freeze_s + 60)
            wall_s = time.perf_counter() - t0
            failed = check(result, cfg)
            median = measure(faults, result.records, stalls.told)
            restarts = dict(result.extra.get("restarts", {}))
    finally:
        logging.getLogger("asyncflow").removeHandler(stalls)
        stop_ray()
    applied = [f for f in faults if f.start]
    if len(applied) < len(faults):
        failed.append(f"{len(faults) - len(applied)} fault(s) not applied (the run ended first)")
    print(
        f"\n{args.steps} steps in {wall_s:.0f} s, median step {median:.2f} s; restarts {restarts}"
    )
    print(
        f"{'#':>2}  {'kind':6}  {'target':14}  {'step':>4}  {'named':>7}  {'worst':>7}  {'cost':>7}"
    )
    for i, f in enumerate(faults):
        named = "-" if f.named_after_s is None else f"{f.named_after_s:.1f} s"
        worst = "-" if f.worst_step_s is None else f"{f.worst_step_s:.1f} s"
        cost = "-" if f.cost_s is None else f"{f.cost_s:+.1f} s"
        note = f"  ({'; '.join(f.notes)})" if f.notes else ""
        print(
            f"{i:>2}  {f.kind:6}  {f.target:14}  {f.steps_at_start:>4}  {named:>7}  {worst:>7}  "
            f"{cost:>7}{note}"
        )
    print("invariants:", "held" if not failed else "FAILED")
    for why in failed:
        print("  " + why)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "argv": sys.argv[1:] if argv is None else argv,
                "steps": args.steps,
                "freeze_s": args.freeze_s,
                "wall_s": wall_s,
                "median_step_s": median,
                "restarts": restarts,
                "faults": [asdict(f) for f in faults],
                "failed": failed,
            },
            indent=1,
        )
    )
    print(f"results: {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
