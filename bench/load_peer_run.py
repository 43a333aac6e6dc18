"""``bench.load``'s clients against the peer, started from our side (standard library only).

:func:`run_peer_case` runs ``bench/load_peer.py`` in the peer's virtualenv (``python -m
bench.peer --setup`` builds it) as a subprocess: it starts the peer (Ray in that process, one
SimpleStorage unit), spreads ``n`` of the peer's async clients over ``procs`` worker
processes, runs ``bench.load``'s cycles (put -> get_meta -> get_data -> clear_samples, half
the clients on one shared partition, half on their own) phase by phase, checks each row was
read exactly once, and shuts the peer and its Ray down itself (``ray.shutdown``). Every wait
there is bounded; past this side's own bound the subprocess is asked to stop (SIGTERM, which
still shuts its Ray down) and only then killed.

    python -m bench.load_peer_run --clients 64,512 --seconds 8   # the peer alone, printed
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
PEER_PYTHON = BENCH_DIR / ".peer-venv" / "bin" / "python"
LOG_DIR = BENCH_DIR / "results"
# Ray's start and the peer's init, the clients' connects (a few ms each, serialized on the
# controller), the drain of every partition, Ray's shutdown: beyond the phases themselves
OVERHEAD_S = 240.0
CONNECT_S_PER_CLIENT = 0.1
STOP_GRACE_S = 120.0  # after SIGTERM, for the peer's close and ray.shutdown


class PeerLoadError(RuntimeError):
    """The peer's load run could not run or broke; the message says where (``stage``)."""


def peer_available() -> bool:
    """Whether the peer's virtualenv is built (``python -m bench.peer --setup``)."""
    return (BENCH_DIR / ".peer-venv" / ".complete").exists() and PEER_PYTHON.exists()


def run_peer_case(
    n: int, procs: int, batch: int, phases: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """``n`` of the peer's clients over ``procs`` worker processes, ``batch`` rows a call,
    one phase per entry of ``phases``: name -> (cycles/s per client, 0 for as fast as each
    can; seconds). Returns a result shaped like ``bench.load.run_case``'s with ``"deploy":
    "peer"``; where the peer broke (a client's call failed or timed out, a worker died or
    hung), the same dict with ``"error"`` and ``"stage"`` (``"start"``, ``"connect of N
    clients"``, ``"phase <name>"``, ``"drain"``) and whatever was measured before it.
    Raises :class:`PeerLoadError` when the peer's virtualenv is missing or its process gave
    no result at all."""
    if not peer_available():
        raise PeerLoadError(
            f"the peer's virtualenv is missing ({PEER_PYTHON}); build it with "
            "`python -m bench.peer --setup`"
        )
    spec = {name: [float(rate), float(seconds)] for name, (rate, seconds) in phases.items()}
    cmd = [str(PEER_PYTHON), "-m", "bench.load_peer", "--clients", str(n), "--procs", str(procs)]
    cmd += ["--batch", str(batch), "--phases", json.dumps(spec)]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # nothing of ours on the peer's path but bench/ (the cwd)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"load-peer-{n}.log"
    bound = OVERHEAD_S + CONNECT_S_PER_CLIENT * n + sum(s + 4 * 60.0 for _, s in phases.values())
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_DIR, env=env
        )
        try:
            out, _ = proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # it shuts its Ray down on the way out
            try:
                out, _ = proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=30)
                raise PeerLoadError(
                    f"the peer's load run with {n} clients gave no result within {bound:g} s "
                    f"and ignored SIGTERM for {STOP_GRACE_S:g} s (killed; its Ray may be "
                    f"left running); see {log_path}"
                ) from None
            res = _result(out, n, log_path)
            res.setdefault("error", f"no result within {bound:g} s (stopped)")
            return res
    return _result(out, n, log_path)


def run_peer_largest(
    counts: list[int], procs: int, batch: int, phases: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """The peer at the largest of ``counts`` it holds: tries them largest first and returns
    the first result without an error, with ``"broke_at"``: the larger counts' error entries
    (``[]`` when the largest held). Where none held, the smallest's error entry."""
    broke: list[dict[str, Any]] = []
    for n in sorted(counts, reverse=True):
        r = run_peer_case(n, procs, batch, phases)
        if "error" not in r:
            r["broke_at"] = broke
            return r
        broke.append({k: r.get(k) for k in ("clients", "stage", "error", "log")})
    return {**broke[-1], "deploy": "peer", "broke_at": broke[:-1]}


def _result(out: str, n: int, log_path: Path) -> dict[str, Any]:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if not lines:
        raise PeerLoadError(
            f"the peer's load run with {n} clients printed no result; see {log_path}"
        )
    res: dict[str, Any] = json.loads(lines[-1])
    res["log"] = str(log_path.relative_to(REPO_DIR))  # (the JSON is checked in: no local path)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", default="64,512,4096", help="comma-separated client counts")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--offered", type=float, default=100.0, help="paced cycles/s over all clients")
    args = ap.parse_args(argv)
    worst = 0
    for n in [int(c) for c in args.clients.split(",")]:
        phases = {"paced": (args.offered / n, args.seconds), "saturated": (0.0, args.seconds)}
        r = run_peer_case(n, args.procs, args.batch, phases)
        print(json.dumps(r), flush=True)
        worst = max(worst, 1 if "error" in r else 0)
    return worst


if __name__ == "__main__":
    sys.exit(main())
