"""Helpers shared by the benchmark scripts: timing, result lines, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(os.environ.get("ASYNCFLOW_BENCH_DIR", "bench/results"))


def timeit(fn: Callable[[], Any], *, warmup: int = 1, repeat: int = 5) -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeat`` times; seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": min(times), "median_s": statistics.median(times), "runs": repeat}


def machine() -> dict[str, Any]:
    import torch  # (here: a bench's child process that measures start-up imports it late)

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def line(case: str, value: float, unit: str, **extra: Any) -> str:
    bits = " ".join(
        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
    )
    text = f"{case:<48} {value:>12.4g} {unit:<10} {bits}"
    print(text, flush=True)
    return text


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {"machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}", flush=True)
    return path
