"""``asyncflow`` command line.

asyncflow run [CONFIG.yaml] [section.field=value ...]    # one training run
asyncflow config [CONFIG.yaml] [overrides ...]            # print the resolved config
"""

from __future__ import annotations

import argparse
import logging
import sys

import yaml

from asyncflow.config import config_to_dict, load_config


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="asyncflow", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="train: GRPO through TransferQueue")
    run_p.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.field=value ...]")
    cfg_p = sub.add_parser("config", help="print the resolved config as YAML")
    cfg_p.add_argument("args", nargs="*")
    ns = ap.parse_args(argv)
    path, overrides = _split(ns.args)
    try:
        cfg = load_config(path, overrides)
    except (ValueError, TypeError) as e:
        print(f"asyncflow: bad config: {e}", file=sys.stderr)
        return 2
    if ns.cmd == "config":
        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return 0
    logging.basicConfig(level=logging.WARNING)
    from asyncflow.workflow import run

    result = run(cfg)
    first, last = result.reward_first_last()
    print(
        f"asyncflow: {len(result.records)} steps in {result.wall_s:.1f} s; mean reward "
        f"first 10% {first:.3f} -> last 10% {last:.3f}; outputs in {result.output_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
