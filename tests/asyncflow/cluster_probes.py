"""What the multi-node probes share (``placement_probe``, ``node_loss_probe``): a Ray
``Cluster`` on loopback whose head declares ``node_a``, and running a probe in a process of
its own (a process joins one Ray cluster only, and a test session already has one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"node_ip_address": "127.0.0.1"}


def head_cluster() -> Any:
    """A ``ray.cluster_utils.Cluster`` with its head node (2 CPUs, ``node_a``) on loopback."""
    from ray.cluster_utils import Cluster

    return Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 10},
            "_system_config": {"worker_niceness": 0},  # (tests/conftest.py: ray_cluster)
            **LOOPBACK,
        },
    )


def run_probe(module: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m module`` from the repository root; its report (the JSON of its last
    line of output), or an AssertionError with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report
