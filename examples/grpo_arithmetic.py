"""GRPO on arithmetic with a tiny model, every stage exchanging data through TransferQueue.

    python examples/grpo_arithmetic.py --output-dir runs/grpo

The default run (2 CPU cores, a few minutes) builds a 2-layer Llama with a tokenizer trained
locally (no download), warm-starts it on the answer format for a few seconds, then trains it
with asynchronous GRPO (max_staleness=1: generation of step t+1 overlaps training of step t)
and writes ``metrics.jsonl`` (one record per step), ``reward.png``, ``timeline.json`` and
TensorBoard logs into the output directory. Any config field can be overridden:

    python examples/grpo_arithmetic.py --output-dir runs/k0 train.max_staleness=0 train.steps=80
"""

from __future__ import annotations

import argparse

from asyncflow import load_config, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-dir", default="runs/grpo", help="where metrics and plots go")
    ap.add_argument("--config", default=None, help="a YAML config (defaults otherwise)")
    ap.add_argument("overrides", nargs="*", help="section.field=value ...")
    args = ap.parse_args()
    cfg = load_config(args.config, [*args.overrides, f"output.dir={args.output_dir}"])
    result = run(cfg)
    first, last = result.reward_first_last(0.1)
    print(
        f"{len(result.records)} steps in {result.wall_s:.0f} s with max_staleness="
        f"{cfg.train.max_staleness}: mean reward {first:.3f} (first 10% of steps) -> "
        f"{last:.3f} (last 10%); metrics in {result.output_dir / 'metrics.jsonl'}"
    )


if __name__ == "__main__":
    main()
