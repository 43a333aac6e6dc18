"""Record what the TransferQueue 0.1.11 tutorials print on the peer itself, into
``tests/tqcompat/expected/NAME.txt`` (their stdout, raw)::

    python -m bench.peer --setup                 # once: the peer's own virtualenv
    PYTHONPATH=. python tests/tqcompat/record_peer.py [NAME ...]   # default: every tutorial

Runs in the peer's virtualenv (``bench/.peer-venv``) against a Ray head of 8 logical CPUs
that this script starts and stops (the peer's actors ask for a CPU each: the tutorials'
default 2-CPU cluster never schedules them on a 2-core machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tq011_tutorials import EXPECTED, RUNNABLE, fetch_tutorials

ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = ROOT / "bench" / ".peer-venv" / "bin" / "python"

_DRIVER = """
import os, subprocess, sys, ray
ctx = ray.init(num_cpus=8, include_dashboard=False)
env = {**os.environ, "RAY_ADDRESS": ctx.address_info["address"]}
for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, path], stdout=f, env=env, timeout=600)
    if proc.returncode:
        sys.exit(f"{path} failed on the peer ({proc.returncode})")
ray.shutdown()
"""


def main() -> None:
    if not PEER_PYTHON.exists():
        sys.exit("no peer virtualenv: run `python -m bench.peer --setup` first")
    with tempfile.TemporaryDirectory() as tmp:
        root = fetch_tutorials(Path(tmp))
        EXPECTED.mkdir(exist_ok=True)
        names = sys.argv[1:] or list(RUNNABLE)
        unknown = sorted(set(names) - set(RUNNABLE))
        if unknown:
            sys.exit(f"unknown tutorials {unknown}; known: {list(RUNNABLE)}")
        args = []
        for name in names:
            args += [str(root / "tutorial" / f"{name}.py"), str(EXPECTED / f"{name}.txt")]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("PYTHONPATH", None)  # the peer's own packages only
        subprocess.run([str(PEER_PYTHON), "-c", _DRIVER, *args], check=True, env=env, cwd=tmp)
    print(f"recorded {len(names)} tutorials in {EXPECTED}")


if __name__ == "__main__":
    main()
