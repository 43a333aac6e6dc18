"""``asyncflow`` command line.

asyncflow run [CONFIG.yaml] [section.field=value ...]    # one training run
asyncflow run --resume DIR [overrides ...]                # continue from DIR's newest checkpoint
asyncflow config [CONFIG.yaml] [overrides ...]            # check and print the resolved config,
                                                          # each value with where it came from
asyncflow run --help                                      # every config field, type, default, doc
asyncflow scale OUTPUT_DIR rollout=N [reward=M]           # a running deploy.mode=ray job's
                                                          # rollout to N generators, its
                                                          # reward to M workers
asyncflow status OUTPUT_DIR [--watch [SECONDS]]           # what a run's stages hold and wait
                                                          # for, from its progress.json

Both commands load and check the config the same way (:func:`asyncflow.config.check.
resolve_config`); a bad config, a missing file or malformed YAML prints one line
``asyncflow: bad config: ...`` naming the field and the fix, and exits with status 2; an
exception a task, dataset, environment or reward raises as the check builds it is one such
line too, with the option and the library's own message. ``--debug`` prints the traceback
under it (the library's frames included) and logs a run at DEBUG rather than WARNING.
``--resume DIR`` is the override ``resume=DIR``. ``asyncflow config`` prints the config as
YAML with a comment after every value naming its source: ``default``, ``environment NAME`` or
``task NAME`` (their recipes), ``file PATH`` or ``command line``. A finished run prints where
its trained policy is and the one line that loads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from asyncflow.config.check import resolve_config_sources
from asyncflow.config.help import fields_help
from asyncflow.config.sources import annotated_yaml

BAD_CONFIG_EXIT = 2


def _split(args: list[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _parser(with_fields: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="asyncflow", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    epilog = fields_help() if with_fields else None  # read from the source: only for --help
    for name, text in (
        ("run", "train: GRPO through TransferQueue"),
        (
            "config",
            "check the config as run does and print it resolved, as YAML, each value with "
            "where it came from (default, environment, task, file, command line)",
        ),
    ):
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=epilog,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.field=value ...]")
        p.add_argument(
            "--resume",
            metavar="DIR",
            help="continue from the newest checkpoint in DIR (an output dir, its checkpoints "
            "folder or one checkpoint), with that run's config under the overrides",
        )
        p.add_argument(
            "--debug",
            action="store_true",
            help="a bad config's traceback under its one line; the run's log at DEBUG",
        )
    p = sub.add_parser(
        "scale",
        help="change a running deploy.mode=ray job's rollout or reward instances",
        description="change the number of rollout instances (generators) or reward workers of "
        "the run writing OUTPUT_DIR while it runs (new generators load the newest weights; "
        "removed ones finish their calls; a removed reward worker finishes the batches it "
        "holds, within deploy.drain_grace_s, and hands back the rest; reward=M needs "
        "reward.colocate=false)",
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the running job's output.dir")
    p.add_argument("counts", nargs="+", metavar="STAGE=N", help="rollout=N and/or reward=M (>= 1)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the run")
    p.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="the run's key directory, for a run whose control channel listens beyond "
        "loopback (deploy.control_host; default: TRANSFERQUEUE_KEYS)",
    )
    p = sub.add_parser(
        "status",
        help="what a run's stages hold and wait for, read from its output folder",
        description="print a table of the run writing (or that wrote) OUTPUT_DIR from its "
        "progress.json and metrics.jsonl: steps, each stage host's process, silence, what each "
        "stage holds or waits for, the stalls so far",
    )
    p.add_argument("output_dir", metavar="OUTPUT_DIR", help="the run's output.dir")
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="print it again every SECONDS (2) until the run ends, its files stop changing "
        "(--stale) or Ctrl-C",
    )
    p.add_argument(
        "--stale",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--watch stops once progress.json has not changed for this long (60)",
    )
    return ap


def status(output_dir: str, every_s: float | None, stale_s: float) -> int:
    """``asyncflow status``: the run's table (once, or ``--watch``); a folder without a run
    status is one line ``asyncflow: no run status: ...`` and returns 2."""
    from pathlib import Path

    from asyncflow.status import StatusError, watch
    from asyncflow.status import status as show

    try:
        if every_s is None:
            return show(Path(output_dir))
        if not every_s > 0 or not stale_s > 0:
            raise StatusError(f"--watch {every_s:g} and --stale {stale_s:g} must be > 0 seconds")
        return watch(Path(output_dir), every_s, stale_s)
    except StatusError as e:
        print(f"asyncflow: no run status: {e}", file=sys.stderr)
        return BAD_CONFIG_EXIT


def scale(
    output_dir: str, counts: list[str], timeout_s: float = 600.0, keys: str | None = None
) -> int:
    """``asyncflow scale``: ask the run writing ``output_dir`` to scale each stage; prints
    its answer, or one line ``asyncflow: cannot scale: ...`` and returns 2."""
    from pathlib import Path

    from asyncflow.control import SCALABLE, ControlError, ask, parse_scale

    try:
        wanted = parse_scale(counts, SCALABLE)
        for stage, n in wanted.items():
            request = {"op": "scale", "stage": stage, "n": n}
            reply = ask(Path(output_dir), request, timeout_s, keys)
            if not reply.get("ok"):
                raise ControlError(str(reply.get("error")))
            print(f"asyncflow: {stage} scaled from {reply['was']} to {reply['n']} instances")
    except ControlError as e:
        print(f"asyncflow: cannot scale: {e}", file=sys.stderr)
        return BAD_CONFIG_EXIT
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    ns = _parser(with_fields=bool({"-h", "--help"} & set(args))).parse_args(args)
    if ns.cmd == "scale":
        return scale(ns.output_dir, ns.counts, ns.timeout, ns.keys)
    if ns.cmd == "status":
        return status(ns.output_dir, ns.watch, ns.stale)
    path, overrides = _split(ns.args)
    if ns.resume is not None:
        overrides = [*overrides, f"resume={json.dumps(ns.resume)}"]  # a YAML string, always
    try:
        cfg, sources = resolve_config_sources(path, overrides)
    except (ValueError, TypeError) as e:  # ConfigError and the sections' own checks
        message = " ".join(str(e).split())  # one line, whatever the source wrote
        if ns.debug:
            traceback.print_exception(e, file=sys.stderr)
        print(f"asyncflow: bad config: {message}", file=sys.stderr)
        return BAD_CONFIG_EXIT
    if ns.cmd == "config":
        print(annotated_yaml(cfg, sources), end="")
        return 0
    logging.basicConfig(level=logging.DEBUG if ns.debug else logging.WARNING)
    from asyncflow.launch import run

    result = run(cfg)
    first, last = result.reward_first_last()
    resumed = len(result.records) - len(result.reports)
    since = f" ({len(result.reports)} after resuming at step {resumed})" if resumed else ""
    print(
        f"asyncflow: {len(result.records)} steps{since} in {result.wall_s:.1f} s; mean reward "
        f"first 10% {first:.3f} -> last 10% {last:.3f}; outputs in {result.output_dir}"
    )
    if result.policy_dir is not None:
        print(f"asyncflow: trained policy in {result.policy_dir}; load it with:")
        print(load_command(result.policy_dir))
    return 0


def load_command(policy: object) -> str:
    """One shell line that loads a saved policy and its tokenizer with transformers."""
    where = repr(str(policy))
    return (
        'python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; '
        f"model = AutoModelForCausalLM.from_pretrained({where}); "
        f'tokenizer = AutoTokenizer.from_pretrained({where})"'
    )


if __name__ == "__main__":
    raise SystemExit(main())
