"""RL schedules compared on the real workflow with simulated engines (and one real pair).

    python -m bench.rl                      # the schedule matrix + the real sync/async pair
    python -m bench.rl --quick              # fewer steps (smoke test)
    python -m bench.rl --workload measured  # SmolLM2's measured lengths instead of long-tail
    python -m bench.rl --workload agentic   # multi-turn episodes, long-tailed environment
    python -m bench.rl --deploy both --quick --gpus 12 --gen-gpus 4 --real-steps 0
                                            # every stage instance a Ray actor vs one process
    python -m bench.rl --elastic            # 2 -> 4 -> 1 generators in one run (rl_elastic.py)

Every schedule runs the real asyncflow workflow (TransferQueue, adapters, stage runners,
admission control, weight sync) on the same resources and the same prompt stream; only the
engines' compute is simulated (``engines/simulated``: decode iterations, training time per
token and weight loads calibrated on this machine by ``bench/calibrate.py``), each modelled
second taking ``time_scale`` real seconds.

| schedule       | GPUs (gen / train)  | staleness | train starts on        | dispatch            |
|----------------|---------------------|-----------|------------------------|---------------------|
| colocated-sync | all / all, shared   | 0         | the whole step's batch | least loaded        |
| disagg-sync    | split               | 0         | the whole step's batch | least loaded        |
| streaming      | split               | 0         | each micro-batch       | least loaded        |
| async-k1/k2    | split               | 1 / 2     | each micro-batch       | least loaded        |
| async-k*-skew  | split               | 1 / 2     | each micro-batch       | ranker: longest     |
|                |                     |           |                        | first, long prompts |
|                |                     |           |                        | and samples past    |
|                |                     |           |                        | the p90 length on   |
|                |                     |           |                        | own instances       |
| async-k2-      | split               | 2 (oldest | each micro-batch       | as async-k2 /       |
| (skew-)partial |                     | token)    |                        | async-k2-skew       |

The ``-partial`` schedules generate with partial rollouts (``rollout.partial``): a weight
update stops the running sequences at a token boundary, loads (the modelled ``sync_s``) and
they go on with the new weights, so an update never waits for a running sample; they take
every update at once (``eager``), since it costs one load and no drain. For them the table
adds the pause of each update (modelled seconds, mean and max), the tokens the updates kept
per step (what aborting the running samples and generating them again would have thrown away,
and their share of the step's tokens) and the share of trained samples that spanned versions.

Every other schedule uses the same weight-sync policy (``on_demand``, ``asyncflow.weights``). The
disaggregated schedules run on three splits of the GPUs (the split that balances decode at full
batch against training, and two with more generation GPUs) and keep their best: with long
tails the best split depends on the schedule, and each is compared at its own best. The
skew-aware schedules dedicate a quarter of their generation instances (at least one) to the
long tail, at most 8 sequences each; samples still decoding after the workload's 90th
percentile length migrate there (``rollout.migrate_after``). The ``agentic`` workload
(``bench/rl_agentic.py``) makes every sample a multi-turn episode with a simulated
environment of long-tailed latency; its episodes never migrate.

``--deploy ray`` runs each schedule with every stage instance a Ray actor (the engines built
in the actors, ``bench/rl_engines.py``; a local cluster of its own, ``bench/rl_ray.py``);
``--deploy both`` runs both deployments alternately on every split and prints ray / local per
schedule (also in ``rl.json`` under ``deploy``, and the plot ``rl_deploy.png``).

Writes ``bench/results/rl.json`` (``rl_agentic.json`` for the agentic workload, whose plots
are named alike) and the plots ``rl_throughput.png``, ``rl_gantt.png`` and
``rl_real_reward.png``, and prints a table: samples/s and tokens/s (modelled time), ratio to
colocated-sync, idle fraction per stage, and the generation GPUs' idle time split into the
pipeline bubble (every generator idle: waiting on training or weights) and the skewness
bubble (some idle while others still decode the long tail).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from asyncflow import RunResult, load_config, run
from asyncflow.metrics import merge_intervals
from bench.common import RESULTS_DIR, line, write_json
from bench.rl_agentic import AgenticWorkload, failure_comparison, failure_counts
from bench.rl_engines import SimulatedRun, local_components, ray_factories
from bench.rl_ray import deploy_plot, ray_samples, start_ray, stop_ray
from engines.simulated import Calibration, LognormalLengths, calibrated
from engines.simulated.environment import forget_failures
from engines.tasks import make_task
from engines.tiny import build_tokenizer


@dataclass(frozen=True)
class Schedule:
    name: str
    colocated: bool = False
    max_staleness: int = 0
    stream: bool = True
    skew_aware: bool = False
    partial: bool = False
    weight_sync: str = ""
    """The weight-sync policy ("": the setup's)."""
    agent: bool = False
    """Agentic workload: the episodes through the agent seam (``engines.simulated.agent``:
    the same environment, driven over the OpenAI-compatible endpoint) instead of the
    environment seam."""


SCHEDULES = [
    Schedule("colocated-sync", colocated=True, stream=False),
    Schedule("disagg-sync", stream=False),
    Schedule("streaming"),
    Schedule("async-k1", max_staleness=1),
    Schedule("async-k2", max_staleness=2),
    Schedule("async-k1-skew", max_staleness=1, skew_aware=True),
    Schedule("async-k2-skew", max_staleness=2, skew_aware=True),
    Schedule("async-k2-partial", max_staleness=2, partial=True, weight_sync="eager"),
    Schedule(
        "async-k2-skew-partial",
        max_staleness=2,
        skew_aware=True,
        partial=True,
        weight_sync="eager",
    ),
]


@dataclass(frozen=True)
class Setup:
    gpus: int = 8
    groups_per_step: int = 32
    group_size: int = 8
    steps: int = 8
    time_scale: float = 0.01
    workload: str = "long-tail"
    long_instances: int = 0
    """Dedicated long instances of the skew-aware schedules (0: a quarter of the generation
    instances, at least one)."""
    seed: int = 0
    max_batch: int = 0
    """Sequences a (non-dedicated) generation instance runs at once; 0: the calibrated."""
    long_max_batch: int = 8
    """Sequences a dedicated long instance runs at once."""
    migrate_after: int = -1
    """Skew-aware schedules: tokens after which a sample migrates to a long instance (-1: the
    workload's 90th percentile, rounded up to 128; 0: no migration)."""
    weight_sync: str = "on_demand"
    """When generators take new weights (``asyncflow.weights``), the same for every schedule."""
    env_failure_rate: float = 0.0
    """Agentic workload: the share of episode tries whose environment fails (``EnvError``)."""
    env_retries: int | None = None
    """Tries of a failed episode after the first (None: ``env.retries``'s default)."""


AGENTIC = AgenticWorkload()


def _lengths(setup: Setup, cal: Calibration, prompts: list[Any]) -> Any:
    """The workload's response lengths, moved onto this run's prompts.

    ``measured``: SmolLM2's measured lengths replayed (cap 1024). ``long-tail``: the measured
    shape (per-sample spread, share of runaway samples that run to the cap, share of the
    variance the prompt explains) at reasoning-task scale: median 300 tokens, cap 8192.
    """
    if setup.workload == "measured":
        return cal.empirical_lengths(prompts, prompt_share=cal.prompt_share, seed=setup.seed)
    if setup.workload == "agentic":  # per turn: the prompt is the conversation so far
        return AGENTIC.turn_lengths(cal, setup.seed)
    fit = cal.lengths
    base = LognormalLengths(
        median=300,
        sigma=fit.sigma,
        max_len=8192,
        overlong_p=fit.overlong_p,
        overlong_slope=fit.overlong_slope,
        prompt_scale=0.0,
        seed=setup.seed,
    )
    return base.adapted(prompts, prompt_share=cal.prompt_share)


def split_gpus(setup: Setup, cal: Calibration, mean_len: float, prompt_len: float) -> int:
    """Generation GPUs of a disaggregated split: balance decode and training throughput."""
    samples = setup.groups_per_step * setup.group_size
    best, best_t = 1, math.inf
    for g in range(1, setup.gpus):
        decode = samples * mean_len / (g * cal.latency.tokens_per_s(cal.latency.max_batch))
        train = cal.training.forward_backward_s(
            int(samples * (mean_len + prompt_len)), samples, setup.gpus - g
        )
        t = max(decode, train)
        if t < best_t:
            best, best_t = g, t
    return best


def run_schedule(
    sched: Schedule,
    setup: Setup,
    cal: Calibration,
    out: Path,
    gen_gpus: int,
    deploy: str = "local",
) -> RunResult:
    """One schedule on one split, its stages in this process (``local``) or each stage
    instance a Ray actor (``ray``: the cluster :func:`bench.rl_ray.start_ray` started)."""
    tokenizer = build_tokenizer()
    task = make_task("countdown", seed=setup.seed)
    from engines.hf.text import encode_prompts

    sample_prompts = encode_prompts(tokenizer, [task.item(i).prompt for i in range(512)])
    lengths = _lengths(setup, cal, sample_prompts)
    n_gen = setup.gpus if sched.colocated else gen_gpus
    n_train = setup.gpus if sched.colocated else setup.gpus - gen_gpus
    long = (setup.long_instances or max(1, n_gen // 4)) if sched.skew_aware else 0
    cap = setup.max_batch or cal.latency.max_batch
    spec = SimulatedRun(
        latency=replace(cal.latency, max_batch=cap),
        lengths=lengths,
        long_instances=long,
        long_max_batch=setup.long_max_batch,
        training=cal.training,
        train_gpus=n_train,
        time_scale=setup.time_scale,
        sync_s=cal.sync_s,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        seed=setup.seed,
        partial=sched.partial,
    )
    b, n = setup.groups_per_step, setup.group_size
    # groups in flight per instance: enough to fill its batch and to hand out every admitted
    # group at once (a group whose sample migrated holds its worker until that sample ends)
    window = (sched.max_staleness + 1) * b
    per_instance = max(-(-cap // n), -(-window // n_gen)) + 2
    overrides = [
        f"output.dir={out}",
        "output.progress=false",
        "output.loggers=[jsonl]",
        "output.plot=false",
        f"train.steps={setup.steps}",
        f"train.groups_per_step={b}",
        f"train.micro_batch_groups={2 if sched.stream else b}",
        f"train.max_staleness={sched.max_staleness}",
        f"rollout.group_size={n}",
        "rollout.micro_batch_groups=1",
        f"rollout.concurrency={per_instance}",
        f"rollout.instances={n_gen}",
        f"rollout.max_new_tokens={lengths.max_len}",
        "rollout.engine=simulated",
        f"rollout.weight_sync={sched.weight_sync or setup.weight_sync}",
        f"rollout.partial={str(sched.partial).lower()}",
        "reward.batch_size=64",
    ]
    if sched.skew_aware:
        overrides += [
            "rollout.ranker=true",
            "rollout.longest_first=true",
            f"rollout.long_instances={long}",
            f"rollout.long_capacity={setup.long_max_batch}",
            f"rollout.migrate_after={setup.migrate_after}",
        ]
    if setup.workload == "agentic":
        overrides += AGENTIC.overrides(
            setup.time_scale, lengths.max_len, setup.env_failure_rate, agent=sched.agent
        )
        if setup.env_retries is not None:
            overrides.append(f"env.retries={setup.env_retries}")
    if deploy == "local":
        return run(load_config(overrides=overrides), local_components(spec, n_gen))
    overrides += ["deploy.mode=ray", "deploy.start_timeout_s=900"]
    with ray_samples() as samples:
        factories = ray_factories(replace(spec, samples=samples))
        return run(load_config(overrides=overrides), factories=factories)


def analyse(result: RunResult, setup: Setup, n_gen: int, n_train: int) -> dict[str, Any]:
    """Steady-state throughput (modelled time) and the bubble breakdown."""
    recs = result.records
    t0, t1 = recs[0]["time_s"], recs[-1]["time_s"]
    span = max(t1 - t0, 1e-9)
    samples = sum(r["samples"] for r in recs[1:])
    tokens = sum(r["tokens"] for r in recs[1:])
    scale = setup.time_scale
    lanes = result.timeline.intervals
    gen_lanes = [k for k in lanes if k.startswith("rollout/")]
    grid = np.linspace(t0, t1, 4000)
    busy = np.zeros((max(len(gen_lanes), 1), grid.size), dtype=bool)
    for i, lane in enumerate(gen_lanes):
        for s, e in merge_intervals(lanes[lane], t0, t1):
            busy[i] |= (grid >= s) & (grid < e)
    n_busy = busy.sum(axis=0)
    idle = ~busy
    pipeline = float((idle & (n_busy == 0)[None, :]).mean()) if gen_lanes else 0.0
    skew = float((idle & (n_busy > 0)[None, :]).mean()) if gen_lanes else 0.0
    stages = result.timeline.summary(t0, t1)
    train_busy = stages.get("train", {}).get("busy", 0.0)
    gen_busy = 1.0 - pipeline - skew
    return {
        "samples_per_s": samples / span / (1 / scale),
        "tokens_per_s": tokens / span / (1 / scale),
        "step_s": span / max(len(recs) - 1, 1) / scale,
        "gen_gpus": n_gen,
        "train_gpus": n_train,
        "gen_busy": gen_busy,
        "pipeline_bubble": pipeline,
        "skew_bubble": skew,
        "stage_idle": {k: v["idle"] for k, v in stages.items()},
        "train_busy": train_busy,
        "staleness_max": max(r["staleness_max"] for r in recs),
        "reward_first": recs[0]["reward"],
        "ranker_error": result.extra.get("ranker_error"),
        "window_real_s": [t0, t1],
        **versions_and_syncs(recs[1:], scale, tokens),
    }


def versions_and_syncs(recs: list[dict[str, Any]], scale: float, tokens: int) -> dict[str, Any]:
    """Over the measured steps: the weight syncs' pause and transfer times (modelled
    seconds), the tokens partial updates kept (per step, and as a share of the tokens
    trained), the share of samples that spanned versions, the staleness split."""
    syncs = [s for r in recs for s in r["weight_syncs"]]
    pause = [s["pause_s"] / scale for s in syncs] or [0.0]
    transfer = [s["transfer_s"] / scale for s in syncs] or [0.0]
    kept = sum(s["kept_tokens"] for s in syncs)
    samples = sum(r["samples"] for r in recs) or 1

    def mean(key: str) -> float:
        return sum(r[key] * r["samples"] for r in recs) / samples

    return {
        "syncs": len(syncs),
        "pause_s_mean": sum(pause) / len(pause),
        "pause_s_max": max(pause),
        "transfer_s_mean": sum(transfer) / len(transfer),
        "kept_tokens_per_step": kept / max(len(recs), 1),
        "kept_share": kept / max(tokens, 1),
        "spanned_share": mean("spanned_share"),
        "span_max": max(r["span_max"] for r in recs),
        "staleness_gen_mean": mean("staleness_gen_mean"),
        "staleness_queue_mean": mean("staleness_queue_mean"),
    }


def gantt(results: dict[str, tuple[RunResult, dict[str, Any]]], path: Path, scale: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.6 + 1.1 * len(names)), sharex=True)
    colors = {"rollout": "tab:blue", "reward": "tab:green", "train": "tab:red"}
    for ax, name in zip(np.atleast_1d(axes), names, strict=True):
        res, stats = results[name]
        t0, t1 = stats["window_real_s"]
        lanes = sorted(res.timeline.intervals, key=lambda k: (k.split("/")[0] != "rollout", k))
        lanes = [k for k in lanes if not k.startswith("reward/")]
        for y, lane in enumerate(lanes):
            spans = merge_intervals(res.timeline.intervals[lane], t0, t1)
            ax.broken_barh(
                [((s - t0) / scale, (e - s) / scale) for s, e in spans],
                (y, 0.8),
                color=colors.get(lane.split("/")[0], "gray"),
            )
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    np.atleast_1d(axes)[-1].set_xlabel(
        "modelled seconds (steady state; blue: generation instances, red: training)"
    )
    fig.suptitle("Stage activity per schedule (busy = colored)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def bars(table: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    base = table[names[0]]["samples_per_s"]
    vals = [table[k]["samples_per_s"] / base for k in names]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar(names, vals, color=["gray", "gray", "tab:orange"] + ["tab:blue"] * (len(names) - 3))
    for i, v in enumerate(vals):
        ax.text(i, v + 0.03, f"{v:.2f}x", ha="center", fontsize=9)
    ax.set_ylabel("samples/s relative to colocated-sync")
    ax.set_title("RL schedules on the same simulated resources (higher is better)")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def real_pair(steps: int, out: Path) -> dict[str, Any]:
    """The real tiny-model GRPO, synchronous (k=0) vs asynchronous (k=1), same seed."""
    from asyncflow.metrics import plot_rewards

    runs: dict[str, RunResult] = {}
    for k in (0, 1):
        cfg = load_config(
            overrides=[
                f"output.dir={out / f'real-k{k}'}",
                "output.progress=false",
                "output.loggers=[jsonl]",
                f"train.steps={steps}",
                f"train.max_staleness={k}",
            ]
        )
        runs[f"max_staleness={k}"] = run(cfg)
    summary = {}
    for name, res in runs.items():
        first, last = res.reward_first_last()
        summary[name] = {
            "wall_s": res.wall_s,
            "reward_first10": first,
            "reward_last10": last,
            "steps": len(res.records),
        }
        line(f"real tiny GRPO {name}: wall", res.wall_s, "s", reward=f"{first:.3f}->{last:.3f}")
    path = RESULTS_DIR / "rl_real_reward.png"
    plot_rewards(
        {k: v.records for k, v in runs.items()},
        path,
        f"Tiny-model GRPO: synchronous vs asynchronous ({steps} steps)",
    )
    print(f"wrote {path}")
    return summary


def _print_line(name: str, stats: dict[str, Any], base: float, tried: dict[int, float]) -> None:
    line(
        name,
        stats["samples_per_s"],
        "samples/s",
        ratio=stats["samples_per_s"] / base,
        gen=stats["gen_gpus"],
        tok_s=round(stats["tokens_per_s"]),
        gen_busy=round(stats["gen_busy"], 3),
        pipeline=round(stats["pipeline_bubble"], 3),
        skew=round(stats["skew_bubble"], 3),
        train_idle=round(1 - stats["train_busy"], 3),
        stale=stats["staleness_max"],
        pause=round(stats["pause_s_mean"], 2),
        pause_max=round(stats["pause_s_max"], 2),
        kept_per_step=round(stats["kept_tokens_per_step"]),
        spanned=round(stats["spanned_share"], 3),
        splits=" ".join(f"{g}:{v:.2f}" for g, v in tried.items()),
    )


def _print_table(table: dict[str, dict[str, Any]]) -> None:
    base = next(iter(table.values()))["samples_per_s"]
    print(
        "\n| schedule | samples/s | tokens/s | vs first | gen busy | pipeline "
        "bubble | skew bubble | train idle | pause mean / max (s) | kept tokens/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in table.items():
        print(
            f"| {name} | {s['samples_per_s']:.2f} | {s['tokens_per_s']:.0f} | "
            f"{s['samples_per_s'] / base:.2f}x | {s['gen_busy']:.2f} | "
            f"{s['pipeline_bubble']:.2f} | {s['skew_bubble']:.2f} | {1 - s['train_busy']:.2f} | "
            f"{s['pause_s_mean']:.2f} / {s['pause_s_max']:.2f} | "
            f"{s['kept_tokens_per_step']:.0f} ({s['kept_share']:.1%}) |"
        )
    if "async-k2" in table:
        for name in ("async-k2-partial", "async-k2-skew-partial"):
            if name in table:
                ratio = table[name]["samples_per_s"] / table["async-k2"]["samples_per_s"]
                line(f"{name} / async-k2 (best splits)", ratio, "x")


def _compare(tables: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per schedule: ray / local samples/s (each at its best split), and the same ratio at
    every split both modes ran."""
    local, ray = tables["local"], tables["ray"]
    out: dict[str, dict[str, float]] = {}
    print("\n| schedule | local samples/s | ray samples/s | ray / local | ray / local per split |")
    print("|---|---|---|---|---|")
    for name in local:
        if name not in ray:
            continue
        ratio = ray[name]["samples_per_s"] / local[name]["samples_per_s"]
        per_split = {
            g: ray[name]["splits_tried"][g] / v
            for g, v in local[name]["splits_tried"].items()
            if g in ray[name]["splits_tried"] and v > 0
        }
        out[name] = {"ray_over_local": ratio, **{f"split_{g}": r for g, r in per_split.items()}}
        print(
            f"| {name} | {local[name]['samples_per_s']:.2f} | {ray[name]['samples_per_s']:.2f} | "
            f"{ratio:.2f}x | {' '.join(f'{g}:{r:.2f}' for g, r in per_split.items())} |"
        )
    return out


SCHEDULE_BY_NAME = {s.name: s for s in SCHEDULES}


def failures(
    chosen: list[Schedule], setup: Setup, cal: Calibration, gen: int, rate: float, rounds: int
) -> None:
    """``--env-failure-rate``: each schedule without and with environment failures on one
    split (:func:`bench.rl_agentic.failure_comparison`); writes ``rl_agentic_failures``."""
    by_name = {s.name: s for s in chosen}
    with tempfile.TemporaryDirectory(prefix="asyncflow-bench-") as tmp:

        def one_run(name: str, r: float, tag: str) -> dict[str, Any]:
            sched = by_name[name]
            g = setup.gpus if sched.colocated else gen
            run_setup = replace(setup, env_failure_rate=r)
            forget_failures()  # every run meets the same failures
            res = run_schedule(sched, run_setup, cal, Path(tmp) / f"{name}-{tag}", g)
            stats = analyse(res, run_setup, g, setup.gpus if sched.colocated else setup.gpus - g)
            return {**stats, "failures": failure_counts(res.records)}

        table = failure_comparison(list(by_name), rounds, one_run, rate)
    write_json("rl_agentic_failures", {"setup": setup.__dict__, "rate": rate, "schedules": table})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and groups")
    ap.add_argument("--workload", choices=["long-tail", "measured", "agentic"], default="long-tail")
    ap.add_argument("--gpus", type=int, default=24, help="virtual GPUs per schedule")
    ap.add_argument("--time-scale", type=float, default=0.01, help="real s per modelled s")
    ap.add_argument("--schedules", default="", help="comma-separated subset of names")
    ap.add_argument("--gen-gpus", type=int, default=0, help="one split instead of three")
    ap.add_argument("--max-batch", type=int, default=0, help="sequences per instance")
    ap.add_argument("--long-instances", type=int, default=0, help="0: a quarter, at least 1")
    ap.add_argument("--long-max-batch", type=int, default=8, help="sequences per long instance")
    ap.add_argument("--migrate-after", type=int, default=-1, help="-1: p90 of the lengths")
    ap.add_argument("--weight-sync", choices=["eager", "on_demand"], default="on_demand")
    ap.add_argument(
        "--real-steps", type=int, default=None, help="0 skips the real pair (agentic: default 0)"
    )
    ap.add_argument(
        "--agents",
        action="store_true",
        help="agentic: run each schedule through the agent seam (HTTP) too, and print the ratio",
    )
    ap.add_argument(
        "--deploy",
        choices=["local", "ray", "both"],
        default="local",
        help="stages in this process, each stage instance a Ray actor, or both alternately",
    )
    ap.add_argument(
        "--env-failure-rate",
        type=float,
        default=0.0,
        help="agentic: share of episode tries whose environment fails; runs each schedule\n"
        "(default async-k2) without and with them, prints the throughput ratio",
    )
    ap.add_argument("--env-retries", type=int, default=None, help="env.retries (default 2)")
    ap.add_argument("--rounds", type=int, default=1, help="pairs per schedule (failures)")
    ap.add_argument("--steps", type=int, default=0, help="training steps (0: 10, --quick 5)")
    ap.add_argument("--groups", type=int, default=0, help="groups per step (0: 32, --quick 16)")
    ap.add_argument(
        "--elastic",
        action="store_true",
        help="one Ray run scaled 2 -> 4 -> 1 generators against fixed runs of each size\n"
        "(bench/rl_elastic.py; --steps: its steps, default 45; --groups: default 32)",
    )
    args = ap.parse_args()
    if args.env_failure_rate and args.workload != "agentic":
        ap.error("--env-failure-rate needs --workload agentic")
    setup = Setup(
        gpus=args.gpus,
        steps=args.steps or (5 if args.quick else 10),
        groups_per_step=args.groups or (16 if args.quick else 32),
        time_scale=args.time_scale,
        workload=args.workload,
        max_batch=args.max_batch,
        long_instances=args.long_instances,
        long_max_batch=args.long_max_batch,
        migrate_after=args.migrate_after,
        weight_sync=args.weight_sync,
        env_retries=args.env_retries,
    )
    cal = calibrated()
    if args.elastic:
        from bench.rl_elastic import elastic

        elastic(replace(setup, groups_per_step=args.groups or 32), cal, args.steps or 45)
        return
    tokenizer = build_tokenizer()
    task = make_task("countdown", seed=setup.seed)
    from engines.hf.text import encode_prompts

    prompts = encode_prompts(tokenizer, [task.item(i).prompt for i in range(512)])
    lengths = _lengths(setup, cal, prompts)
    draws = [lengths.length(p, i) for i, p in enumerate(prompts)]
    mean_len, prompt_len = float(np.mean(draws)), float(np.mean([p.numel() for p in prompts]))
    sample_len = mean_len  # what one sample decodes and trains on
    if setup.workload == "agentic":  # an episode: its turns and the observations between
        sample_len = AGENTIC.mean_turns() * (mean_len + AGENTIC.observation_tokens)
        setup = replace(setup, migrate_after=0)  # episodes keep their instance
    balanced = split_gpus(setup, cal, sample_len, prompt_len)
    splits = [args.gen_gpus] if args.gen_gpus else [balanced, balanced + 2, balanced + 4]
    splits = sorted({g for g in splits if 0 < g < setup.gpus})
    if setup.migrate_after < 0:  # the long tail: past where 90% of the responses have ended
        setup = replace(setup, migrate_after=int(np.ceil(np.percentile(draws, 90) / 128) * 128))
    modes = ["local", "ray"] if args.deploy == "both" else [args.deploy]
    stem = "rl_agentic" if setup.workload == "agentic" else "rl"  # results and plots
    per_turn = " per turn" if setup.workload == "agentic" else ""
    print(
        f"calibration {cal.profile} ({cal.source}); workload {setup.workload}: mean response "
        f"{mean_len:.0f} tokens{per_turn}, p90 {np.percentile(draws, 90):.0f}, p99 "
        f"{np.percentile(draws, 99):.0f}, max {max(draws)}; {setup.gpus} GPUs; disaggregated "
        f"schedules run on each of the splits {splits} generation GPUs (balanced decode vs "
        f"training: {balanced}) and keep their best; migration after {setup.migrate_after} "
        f"tokens; deploy {' and '.join(modes)}"
    )
    chosen = [s for s in SCHEDULES if not args.schedules or s.name in args.schedules.split(",")]
    if args.env_failure_rate:
        failures(
            chosen if args.schedules else [SCHEDULE_BY_NAME["async-k2"]],
            setup,
            cal,
            splits[0] if args.gen_gpus else balanced,
            args.env_failure_rate,
            args.rounds,
        )
        return  # fmt: skip
    if args.agents:
        if setup.workload != "agentic":
            raise SystemExit("--agents needs --workload agentic")
        chosen = [t for s in chosen for t in (s, replace(s, name=f"{s.name}-agent", agent=True))]
    results: dict[str, dict[str, tuple[RunResult, dict[str, Any]]]] = {m: {} for m in modes}
    if "ray" in modes:  # slots for the largest schedule's actors: generators, trainer, reward
        start_ray(num_cpus=setup.gpus + 8)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncflow-bench-") as tmp:
            for sched in chosen:
                tried: dict[str, dict[int, float]] = {m: {} for m in modes}
                best: dict[str, tuple[RunResult, dict[str, Any]]] = {}
                for g in [setup.gpus] if sched.colocated else splits:
                    n_train = setup.gpus if sched.colocated else setup.gpus - g
                    for mode in modes:  # alternately, so that both see the same machine load
                        out = Path(tmp) / f"{sched.name}-{g}-{mode}"
                        res = run_schedule(sched, setup, cal, out, g, deploy=mode)
                        stats = analyse(res, setup, g, n_train)
                        tried[mode][g] = stats["samples_per_s"]
                        if (
                            mode not in best
                            or stats["samples_per_s"] > best[mode][1]["samples_per_s"]
                        ):
                            best[mode] = (res, stats)
                for mode in modes:
                    best[mode][1]["splits_tried"] = tried[mode]
                    results[mode][sched.name] = best[mode]
                    base = next(iter(results[mode].values()))[1]["samples_per_s"]
                    name = sched.name if len(modes) == 1 else f"{sched.name} [{mode}]"
                    _print_line(name, best[mode][1], base, tried[mode])
                if len(modes) > 1:
                    r = best["ray"][1]["samples_per_s"] / best["local"][1]["samples_per_s"]
                    line(f"{sched.name} ray/local", r, "x")
            tables = {m: {k: v[1] for k, v in results[m].items()} for m in modes}
            first = modes[0]
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            if len(tables[first]) > 1:
                bars(tables[first], RESULTS_DIR / f"{stem}_throughput.png")
                gantt(results[first], RESULTS_DIR / f"{stem}_gantt.png", setup.time_scale)
            if len(modes) > 1:
                deploy_plot(tables, RESULTS_DIR / "rl_deploy.png")
            real_steps = args.real_steps if args.real_steps is not None else 300
            if setup.workload == "agentic" and args.real_steps is None:
                real_steps = 0  # the real pair is one-turn arithmetic: run it with --real-steps
            real = real_pair(real_steps, Path(tmp)) if real_steps else {}
    finally:
        if "ray" in modes:
            stop_ray()
    for mode in modes:
        if len(modes) > 1:
            print(f"\ndeploy={mode}:")
        _print_table(tables[mode])
        table = tables[mode]
        for name in [n for n in table if f"{n}-agent" in table]:
            ratio = table[f"{name}-agent"]["samples_per_s"] / table[name]["samples_per_s"]
            line(f"{name} agent seam / environment seam [{mode}]", ratio, "x")
        if "async-k2" in table and "colocated-sync" in table:
            ratio = table["async-k2"]["samples_per_s"] / table["colocated-sync"]["samples_per_s"]
            line(f"{setup.workload} async-k2 / colocated-sync [{mode}]", ratio, "x")
    compared = _compare(tables) if len(modes) > 1 else {}
    write_json(
        stem,
        {
            "setup": setup.__dict__,
            "calibration": {"profile": cal.profile, "source": cal.source},
            "workload": {"mean_len": mean_len, "prompt_len": prompt_len, "max": max(draws)},
            "schedules": tables[first],
            "deploy": {"modes": modes, "tables": tables, "ray_over_local": compared},
            "real": real,
        },
    )


if __name__ == "__main__":
    main()
