"""``bench.rl --deploy ray|both``: the Ray cluster the benchmark starts, the generators'
shared sample store, and the comparison of the two deployments.

The benchmark starts a local cluster of its own (``address="local"``: never a cluster another
process started on this machine) with enough logical CPU slots for the largest schedule's
actors (Ray does not check slots against cores; the simulated engines sleep), and shuts it
down at the end. Every schedule run then creates its stage hosts on it
(``asyncflow.deploy.ray``) and one :class:`~engines.simulated.SampleBook` actor its
generators share, killed when the run ends.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engines.simulated import RaySamples, start_ray_samples

__all__ = ["deploy_plot", "ray_samples", "start_ray", "stop_ray"]

ROOT = Path(__file__).resolve().parents[1]


def start_ray(num_cpus: int) -> None:
    """A local Ray cluster with ``num_cpus`` logical CPU slots whose workers import this
    checkout (its engines are built in the actors)."""
    import ray

    for key in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED"):
        os.environ.setdefault(key, "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        # no idle workers started ahead for the logical slots: on a few cores they only cost
        # start-up CPU (every actor gets a worker of its own anyway); niceness 0: the actors
        # get the driver's share of the cores (Ray's default of 15 starves them)
        _system_config={
            "enable_worker_prestart": False,
            "prestart_worker_first_driver": False,
            "worker_niceness": 0,
        },
    )


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextlib.contextmanager
def ray_samples() -> Iterator[RaySamples]:
    """A sample store actor for one run's generators (killed when the run ends)."""
    import ray

    store, handle = start_ray_samples(f"bench-rl-samples-{uuid.uuid4().hex[:8]}")
    try:
        yield store
    finally:
        with contextlib.suppress(Exception):
            ray.kill(handle)


def deploy_plot(tables: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Samples/s per schedule, one bar per deployment, ray/local written over each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(tables)
    names = [n for n in tables[modes[0]] if all(n in t for t in tables.values())]
    x = np.arange(len(names))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(10, 4))
    colors = {"local": "tab:gray", "ray": "tab:blue"}
    for j, mode in enumerate(modes):
        vals = [tables[mode][n]["samples_per_s"] for n in names]
        ax.bar(
            x + (j - (len(modes) - 1) / 2) * width,
            vals,
            width,
            label=f"deploy={mode}",
            color=colors.get(mode),
        )
    if {"local", "ray"} <= set(modes):
        for i, n in enumerate(names):
            ratio = tables["ray"][n]["samples_per_s"] / tables["local"][n]["samples_per_s"]
            top = max(tables[m][n]["samples_per_s"] for m in modes)
            ax.text(i, top * 1.02, f"{ratio:.2f}x", ha="center", fontsize=9)
    ax.set_xticks(x, names)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    ax.set_ylabel("samples/s (modelled time)")
    ax.set_title("RL schedules: every stage in one process vs every stage instance a Ray actor")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
