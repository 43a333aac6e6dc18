"""Run every benchmark behind the figures of ``docs/benchmarks.md``, one after the other.

    python -m bench              # controller, service throughput, weights, RL schedules (~16 min)
    python -m bench --quick      # smaller sizes (~4 min), for a smoke test

Each benchmark measures its baseline in the same run and prints ratios; JSON and plots go to
``bench/results/`` (``ASYNCFLOW_BENCH_DIR`` overrides). Run on an otherwise idle machine:
the timings are real.
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    extra = ["--quick"] if args.quick else []
    for module in ("bench.controller", "bench.throughput", "bench.weights", "bench.rl"):
        print(f"\n=== python -m {module} {' '.join(extra)}", flush=True)
        rc = subprocess.call([sys.executable, "-m", module, *extra])
        if rc:
            print(f"{module} failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
