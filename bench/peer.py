"""Ours against the TransferQueue we set out to beat (PyPI ``transferqueue`` 0.1.11), one run.

    python -m bench.peer --setup     # once: builds bench/.peer-venv with the peer pinned
    python -m bench.peer             # full sizes, 3 alternating rounds x 2 reps (~9 min)
    python -m bench.peer --quick     # small sizes, 1 round: a smoke test (~2 min)
    python -m bench.peer --cases multimodal   # some cases only (their own JSON, see below)
    python -m bench.peer --compat    # the peer's own tests on our facade (bench/peer_compat.py)

The peer installs top-level ``tests``, ``scripts``, ``recipe`` and ``tutorial`` packages and
needs Ray, so it lives in a virtualenv of its own (``bench/.peer-venv``, git-ignored; a plain
run builds it first when it is missing). Each system is driven by a runner subprocess, the
client process, whose servers are processes of their own: ours ``bench/peer_ours.py`` (a
local service: controller and units as processes), the peer ``bench/peer_runner.py`` in its
virtualenv (controller and SimpleStorage units as Ray actors). Both build the same bytes
from the same seeds (checked by digest) and speak JSON lines (``bench/peer_cases.py``).

For 1 and 4 storage units, the systems are started side by side; each first runs every put +
get case once with its result checked bit for bit against what was put (untimed), then
``--rounds`` rounds alternate which system goes first, each system running ``--reps`` timed
reps of each case per round. The meta case runs after, each system alone on the machine (its
runner started for it once the CPUs are idle, the others closed; ``--rounds`` rounds of it in
a row): a call of a few hundred microseconds is bound by the CPU's caches, and the idle
daemons of the other runners' Ray clusters took 40-50 us of each of ours when they ran beside
it (257 -> 301 us, while the bare round trip stayed at 117 us):

- ``dense``: float32 [1024, 8192] x 9 fields (302 MB, the peer's own "Small" case);
- ``ragged``: 256 sequences of 128-4096 int32 token ids plus a float32 logprob per token
  (~4.5 MB), packed (values + offsets) for ours, jagged nested tensors for the peer;
- ``multimodal``: a vision-language RL batch of 64 rows (~80 MB): per row an image
  ``[3, H, W]`` uint8, H and W drawn from 224-1024 (seeded), 256-2048 int32 token ids, and
  three scalars (reward, advantage, version). Ours puts the images as a ``Shaped`` column
  (one buffer, per-row shapes), the ids as ``Ragged``; the peer takes a strided nested tensor
  of the images and a jagged one of the ids, as its users would;
- ``meta``: ``get_meta`` of 64 rows from a partition of 1k / 100k / 1M rows (refilled before
  half are taken), after the put + get rounds. The ratio compares the hand-out (``get_meta``
  alone: the peer marks rows consumed there, ours leases them); ours with its ``ack`` (a
  second round trip, for exactly-once delivery) is printed beside it. At 1k rows our
  runner also times a bare ZeroMQ round trip of the same shape (``bench/bare.py``: a DEALER
  in the runner, a ROUTER in a process of its own, msgpack both ways, 64 indexes back),
  before ours in one round and after it in the next; the line ``ratio ours/bare round
  trip`` divides our ``get_meta`` by it (goal: <= 2x).

A third column, ``facade``, runs the peer's own runner (``bench/peer_runner.py``, the peer's
calls: ``tq.init``, ``put``/``get_meta``/``get_data`` with TensorDicts, ``clear_samples``)
unchanged in our virtualenv under ``python -m tqcompat``: ``transfer_queue`` is our facade,
so the same calls run on our store (its Ray deployment, as the runner starts Ray). Its ratio
to the peer is printed beside ours (goal: >= 3x).

GB/s = 2 x payload / (put + get_meta + get_data). Prints medians and ratios ours / peer (goal:
>= 5x on every case), writes ``bench/results/peer.json`` and ``bench/results/peer.png``
(with ``--cases``, a subset: ``peer-<cases>.json`` and ``.png``, e.g. ``peer-multimodal``).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, line, write_json

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
PEER_VENV = BENCH_DIR / ".peer-venv"
# torch first, pinned: anything that asks for an unpinned torch before it is present pulls a
# multi-GB CUDA build. Ray is pinned to the release our own Ray deployment is tested with.
PEER_PINS = (
    ("torch==2.13.0",),
    ("transferqueue==0.1.11", "ray[default]==2.60.0", "tensordict==0.15.3"),
)
CASE_NAMES = ("dense", "ragged", "multimodal", "meta")
SYSTEMS = ("ours", "peer", "facade")
GOAL = 5.0  # ours / peer, every case
WIRE_GOAL = 2.0  # ours get_meta of 64 from 1k rows / a bare ZeroMQ round trip (bench/bare.py)
FACADE_GOAL = 3.0  # the peer's calls through tqcompat on our store / peer, every case
_CALL_TIMEOUT_S = 1800.0  # one command (a million-row fill of the peer takes ~30 s)


# -- the peer's virtualenv -------------------------------------------------------------------
def peer_python() -> Path:
    return PEER_VENV / "bin" / "python"


def setup(force: bool = False) -> Path:
    """Build the peer's virtualenv once (it installs top-level ``tests``, ``scripts``,
    ``recipe`` and ``tutorial`` packages, so it never shares ours)."""
    marker = PEER_VENV / ".complete"
    if marker.exists() and not force:
        print(f"peer virtualenv ready: {PEER_VENV}", flush=True)
        return peer_python()
    venv.EnvBuilder(with_pip=True, clear=True).create(PEER_VENV)
    for pins in PEER_PINS:
        cmd = [str(peer_python()), "-m", "pip", "install", "-q", *pins]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, timeout=3600)
    check = (
        "import transfer_queue, ray, torch; print(transfer_queue.__version__, torch.__version__)"
    )
    out = subprocess.run(
        [str(peer_python()), "-c", check], check=True, capture_output=True, text=True, timeout=600
    )
    print(f"peer virtualenv built: {PEER_VENV} (transferqueue, torch: {out.stdout.strip()})")
    marker.write_text(out.stdout)
    return peer_python()


# -- runners ---------------------------------------------------------------------------------
class Runner:
    """One system's runner subprocess (its client process), spoken to in JSON lines."""

    def __init__(
        self, name: str, python: Path | str, module: str, args: list[str], phase: str = ""
    ) -> None:
        self.name = name
        env = dict(os.environ)
        if name in ("ours", "facade"):
            env["PYTHONPATH"] = os.pathsep.join([str(REPO_DIR), env.get("PYTHONPATH", "")])
        else:  # nothing of ours on the peer's path but bench/ (found from the working dir)
            env.pop("PYTHONPATH", None)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = RESULTS_DIR / f"peer-{name}-{args[-1]}units{phase}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [str(python), "-m", module, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO_DIR,
            env=env,
        )
        self.hello = self._read(600.0)

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        raw = self.proc.stdout.readline() if ready else ""
        if not raw:
            self.close()
            why = "no answer" if not ready else f"exited ({self.proc.returncode})"
            raise RuntimeError(f"{self.name} runner: {why}; see {self.log_path}")
        reply = json.loads(raw)
        if not reply.get("ok"):
            raise RuntimeError(
                f"{self.name} runner: {reply.get('error')}\n{reply.get('trace', '')}"
            )
        return reply

    def call(self, timeout_s: float = _CALL_TIMEOUT_S, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def start_runner(name: str, scale: str, units: int, phase: str = "") -> Runner:
    """System ``name``'s runner: ``ours``, ``peer`` (in its virtualenv) or ``facade`` (the
    peer's runner, unchanged, with ``transfer_queue`` = our facade, tqcompat)."""
    args = ["--scale", scale, "--units", str(units)]
    if name == "ours":
        return Runner(name, sys.executable, "bench.peer_ours", args, phase)
    if name == "peer":
        return Runner(name, peer_python(), "bench.peer_runner", args, phase)
    return Runner(name, sys.executable, "tqcompat", ["-m", "bench.peer_runner", *args], phase)


def start_runners(scale: str, units: int) -> dict[str, Runner]:
    runners: dict[str, Runner] = {}
    try:
        for name in SYSTEMS:
            runners[name] = start_runner(name, scale, units)
    except BaseException:
        for r in runners.values():
            r.close()
        raise
    return runners


# -- the run ---------------------------------------------------------------------------------
def run_units(units: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every case on every system with ``units`` storage units: the put + get cases with the
    three runners side by side, rounds alternating; then the meta case, each system alone."""
    scale = "quick" if args.quick else "full"
    out: dict[str, Any] = {"init_s": {}, "describe": {}, "first": {}, "cycles": {}, "meta": {}}
    if any(c != "meta" for c in args.cases):
        _run_cycles(units, scale, args, out)
    if "meta" in args.cases:
        # Each system alone on the machine (the others' runners closed): the idle daemons
        # of a Ray cluster (the peer's, the facade's) cost a call of ~250 us some 40-50 us
        # when they run beside it, and the bare round trip nothing. Which system goes first
        # alternates with the number of units.
        for name in SYSTEMS if units % 2 else SYSTEMS[::-1]:
            _run_meta_alone(name, units, scale, args, out)
    return out


def _run_cycles(units: int, scale: str, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The put + get cases, every system's runner alive, rounds alternating who goes first."""
    runners = start_runners(scale, units)
    systems = list(runners)
    try:
        for name, r in runners.items():
            out["init_s"][name] = r.hello["init_s"]
            out["describe"][name] = r.call(op="describe")
        d = out["describe"]
        if any(
            d[name]["digests"] != d["peer"]["digests"] or d[name]["nbytes"] != d["peer"]["nbytes"]
            for name in systems
        ):
            raise RuntimeError(f"the two runners built different payloads: {d}")
        cases = [c for c in d["ours"]["nbytes"] if c in args.cases]
        for case in cases:  # untimed first rep, checked bit for bit
            for name in systems:
                out["first"].setdefault(case, {})[name] = runners[name].call(
                    op="cycle", case=case, reps=1, verify=True
                )
        print(f"  {units} unit(s): every system's data bit-exact on the first rep", flush=True)
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for case in cases:
                for name in order:
                    got = runners[name].call(op="cycle", case=case, reps=args.reps)
                    per = out["cycles"].setdefault(case, {}).setdefault(name, [])
                    per += [
                        {"put_s": p, "get_meta_s": m, "get_data_s": g}
                        for p, m, g in zip(
                            got["put_s"], got["get_meta_s"], got["get_data_s"], strict=True
                        )
                    ]
            print(f"  {units} unit(s): put+get round {rnd + 1}/{args.rounds} done", flush=True)
    finally:
        for r in runners.values():
            r.close()


def _run_meta_alone(
    name: str, units: int, scale: str, args: argparse.Namespace, out: dict[str, Any]
) -> None:
    """The meta rounds of system ``name``, its runner the only one alive; ours also times
    the bare round trip at the fewest rows, before its own calls in one round and after
    them in the next."""
    waited = wait_quiet()  # (the last runner's Ray daemons take seconds to go)
    runner = start_runner(name, scale, units, "-meta")
    fewest = min(args.meta_live)
    try:
        out["init_s"].setdefault(f"{name} (meta)", runner.hello["init_s"])
        out.setdefault("quiet_wait_s", {})[name] = waited
        for rnd in range(args.rounds):
            for live in args.meta_live:
                if name == "ours" and live == fewest and rnd % 2 == 0:
                    _bare(runner, args, out)
                got = runner.call(
                    op="meta", live=live, batch=args.meta_batch, seconds=args.meta_seconds
                )
                out["meta"].setdefault(str(live), {}).setdefault(name, []).append(got)
                if name == "ours" and live == fewest and rnd % 2 == 1:
                    _bare(runner, args, out)
        print(f"  {units} unit(s): {name} get_meta rounds done, alone", flush=True)
    finally:
        runner.close()


def _cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def wait_quiet(idle: float = 0.9, most_s: float = 30.0) -> float:
    """Wait until the CPUs were at least ``idle`` idle over half a second (what the last
    runner left behind has exited), for at most ``most_s``; the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < most_s:
        b0, t_0 = _cpu_busy()
        time.sleep(0.5)
        b1, t_1 = _cpu_busy()
        if t_1 > t_0 and (b1 - b0) / (t_1 - t_0) <= 1 - idle:
            break
    return time.perf_counter() - t0


def _bare(ours: Runner, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """One timing of the bare ZeroMQ round trip in our runner's process (bench/bare.py)."""
    got = ours.call(op="bare", batch=args.meta_batch, seconds=args.meta_seconds)
    out.setdefault("bare_s", []).append(got["seconds_per_call"])


def summarize(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Medians per system and case, and the ratios ours / peer."""
    summary: dict[str, Any] = {
        "GBps": {},
        "meta_samples_per_s": {},
        "ratios": {},
        "ratios_with_ack": {},
        "ratios_facade": {},
        "wire": {},
    }
    for units, res in raw.items():
        nbytes = res["describe"].get("ours", {}).get("nbytes", {})  # (none: meta only)
        for case, per in res["cycles"].items():
            med = {}
            for name, reps in per.items():
                rates = [
                    2 * nbytes[case] / (r["put_s"] + r["get_meta_s"] + r["get_data_s"]) / 1e9
                    for r in reps
                ]
                med[name] = statistics.median(rates)
                summary["GBps"].setdefault(f"{case} {units}u", {})[name] = {
                    "median": med[name],
                    "best": max(rates),
                    "worst": min(rates),
                    "put_ms": 1e3 * statistics.median(r["put_s"] for r in reps),
                    "get_meta_ms": 1e3 * statistics.median(r["get_meta_s"] for r in reps),
                    "get_data_ms": 1e3 * statistics.median(r["get_data_s"] for r in reps),
                }
            summary["ratios"][f"{case} {units}u"] = med["ours"] / med["peer"]
            if "facade" in med:
                summary["ratios_facade"][f"{case} {units}u"] = med["facade"] / med["peer"]
        for live, per in res["meta"].items():
            med = {n: statistics.median(x["samples_per_s"] for x in v) for n, v in per.items()}
            med["ours_with_ack"] = statistics.median(x["samples_per_s_whole"] for x in per["ours"])
            summary["meta_samples_per_s"][f"{live} {units}u"] = med
            summary["ratios"][f"meta {live} {units}u"] = med["ours"] / med["peer"]
            summary["ratios_with_ack"][f"meta {live} {units}u"] = med["ours_with_ack"] / med["peer"]
            if "facade" in med:
                summary["ratios_facade"][f"meta {live} {units}u"] = med["facade"] / med["peer"]
        if res.get("bare_s"):  # ours get_meta at the fewest rows against the bare round trip
            live = str(min(int(k) for k in res["meta"]))
            ours_s = statistics.median(
                args.meta_batch / x["samples_per_s"] for x in res["meta"][live]["ours"]
            )
            bare_s = statistics.median(res["bare_s"])
            summary["wire"][f"{units}u"] = {
                "live": int(live),
                "bare_us": 1e6 * bare_s,
                "ours_us": 1e6 * ours_s,
                "ratio": ours_s / bare_s,
            }
    return summary


def report(summary: dict[str, Any], raw: dict[str, Any]) -> None:
    for key, per in summary["GBps"].items():
        case, units = key.split()
        nbytes = next(iter(raw.values()))["describe"]["ours"]["nbytes"][case]
        for name, s in per.items():
            line(
                f"{name} {case} ({nbytes / 1e6:.1f} MB) {units}",
                s["median"],
                "GB/s",
                put_ms=s["put_ms"],
                get_data_ms=s["get_data_ms"],
            )
    for key, per in summary["meta_samples_per_s"].items():
        live, units = key.split()
        for name, v in per.items():
            what = "get_meta+ack" if name == "ours_with_ack" else "get_meta"
            who = name.removesuffix("_with_ack")
            line(f"{who} {what} 64 of {int(live):,} rows {units}", v, "samples/s")
    for key, ratio in summary["ratios"].items():
        extra = {}
        if key in summary["ratios_with_ack"]:
            extra["with_ack"] = summary["ratios_with_ack"][key]
        line(f"ratio ours/peer {key}", ratio, "x", target=f">={GOAL:g}", **extra)
    for key, ratio in summary["ratios_facade"].items():
        line(f"ratio facade/peer {key}", ratio, "x", target=f">={FACADE_GOAL:g}")
    for units, w in summary["wire"].items():
        line(f"bare ZeroMQ round trip ({units})", w["bare_us"], "us/call")
        line(f"ours get_meta 64 of {w['live']:,} rows ({units})", w["ours_us"], "us/call")
        line(f"ratio ours/bare round trip {units}", w["ratio"], "x", target=f"<={WIRE_GOAL:g}")
    if not summary["ratios"]:
        return
    worst = min(summary["ratios"].values())
    print(f"worst ratio {worst:.2f}x (goal >= {GOAL:g}x on every case)", flush=True)
    if summary["ratios_facade"]:
        worst = min(summary["ratios_facade"].values())
        print(f"worst facade ratio {worst:.2f}x (goal >= {FACADE_GOAL:g}x)", flush=True)
    if summary["wire"]:
        worst = max(w["ratio"] for w in summary["wire"].values())
        print(f"worst get_meta / bare round trip {worst:.2f}x (goal <= {WIRE_GOAL:g}x)", flush=True)


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = list(summary["GBps"])
    if not keys:  # (a run of the meta case only)
        ax1.set_visible(False)
    x = np.arange(len(keys))
    bars = [
        (name, label)
        for name, label in (
            ("ours", "ours"),
            ("facade", "peer's calls on ours (tqcompat)"),
            ("peer", "transferqueue 0.1.11"),
        )
        if all(name in summary["GBps"][key] for key in keys)
    ]
    width = 0.8 / max(len(bars), 1)
    for k, (name, label) in enumerate(bars):
        vals = [summary["GBps"][key][name]["median"] for key in keys]
        ax1.bar(x + (k - (len(bars) - 1) / 2) * width, vals, width, label=label)
    ax1.set_xticks(x, [k.replace("u", " unit(s)") for k in keys], fontsize=8)
    ax1.set_ylabel("2 x payload / (put + get_meta + get_data), GB/s")
    ax1.set_title("put + get, medians", fontsize=10)
    top = max((v["median"] for per in summary["GBps"].values() for v in per.values()), default=1)
    ax1.set_ylim(0, top * 1.3)
    ax1.legend(loc="upper center", ncol=max(len(bars), 1), fontsize=8)
    meta = summary["meta_samples_per_s"]
    if not meta:  # (a run of some cases only)
        ax2.set_visible(False)
    styles = (("ours", "-o"), ("ours_with_ack", ":o"), ("facade", "-.^"), ("peer", "--s"))
    for name, style in styles:
        if not all(name in v for v in meta.values()):
            continue
        for units in sorted({k.split()[1] for k in meta}):
            pts = sorted((int(k.split()[0]), v[name]) for k, v in meta.items() if k.endswith(units))
            label = f"{name.replace('_with_ack', ' +ack')} {units.replace('u', ' unit(s)')}"
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("rows in the partition")
    ax2.set_ylabel("samples/s (get_meta of 64)")
    ax2.set_title("get_meta rate, medians", fontsize=10)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="build the peer's virtualenv and exit")
    ap.add_argument("--quick", action="store_true", help="small sizes, one round")
    ap.add_argument(
        "--compat",
        action="store_true",
        help="run the peer's own tests/ on the transfer_queue facade and exit",
    )
    ap.add_argument("-k", dest="keyword", default=None, help="with --compat: pytest's -k")
    ap.add_argument("--units", type=int, nargs="+", default=[1, 4])
    ap.add_argument(
        "--cases",
        nargs="+",
        choices=CASE_NAMES,
        default=list(CASE_NAMES),
        help="cases to run (default: all)",
    )
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed reps per round (default 2)")
    ap.add_argument("--meta-live", type=int, nargs="+", default=None)
    ap.add_argument("--meta-batch", type=int, default=64)
    ap.add_argument("--meta-seconds", type=float, default=None)
    args = ap.parse_args()
    if args.compat:
        from bench.peer_compat import run as run_compat

        return run_compat(["-k", args.keyword] if args.keyword else None)
    if args.setup:
        setup()
        return 0
    if not (PEER_VENV / ".complete").exists():
        setup()
    quick = args.quick
    args.rounds = args.rounds or (1 if quick else 3)
    args.reps = args.reps or (1 if quick else 2)
    args.meta_live = args.meta_live or ([1_000, 20_000] if quick else [1_000, 100_000, 1_000_000])
    args.meta_seconds = args.meta_seconds or (0.5 if quick else 2.0)
    t0 = time.perf_counter()
    raw: dict[str, Any] = {}
    for units in args.units:
        print(f"== {units} storage unit(s)", flush=True)
        raw[str(units)] = run_units(units, args)
    summary = summarize(raw, args)
    report(summary, raw)
    subset = args.cases != list(CASE_NAMES)
    name = "peer-" + "-".join(args.cases) if subset else "peer"
    command = "python -m bench.peer" + (" --quick" if quick else "")
    if subset:
        command += " --cases " + " ".join(args.cases)
    if args.units != [1, 4]:
        command += " --units " + " ".join(map(str, args.units))
    results = {
        "command": command,
        "settings": {k: v for k, v in vars(args).items() if k != "setup"},
        "goal_ratio": GOAL,
        "facade_goal_ratio": FACADE_GOAL,
        **summary,
        "raw": raw,
        "wall_s": time.perf_counter() - t0,
    }
    write_json(name, results)
    plot(summary, RESULTS_DIR / f"{name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
