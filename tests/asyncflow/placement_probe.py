"""Starts a 3-node Ray cluster on this machine, runs a short workflow on it with its stage
hosts placed as a config says, and prints, as JSON, where each landed (``{stage: node
label}``), the weight transport the run chose and what each step trained.

    python -m tests.asyncflow.placement_probe

Run in its own process by ``test_ray_workflow.py``: a process joins one Ray cluster only, and
the test session already has one.

| node  | resources            | what the config puts there                          |
|-------|----------------------|-----------------------------------------------------|
| a     | ``node_a`` (head)    | TransferQueue controller and units (custom resource) |
| b     | ``node_b``           | generators and reward workers (custom resource)      |
| c     | ``node_c``           | the trainer ranks (pinned by node id)                |

The trainer and the generators are on different nodes, so the weights go by ``broadcast``
(a gloo link from the trainer's rank 0 to each generator), the path of a multi-node run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from tests.asyncflow.cluster_probes import LOOPBACK, head_cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
MAX_STALENESS = 1


def main() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from asyncflow import run
    from tests.asyncflow.conftest import RAY_START, small_config

    loopback = LOOPBACK
    cluster = head_cluster()
    try:
        for label in ("node_b", "node_c"):
            cluster.add_node(num_cpus=4, resources={label: 10}, **loopback)
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        labels = {
            n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_"))
            for n in ray.nodes()
            if n["Alive"]
        }
        node_c = next(i for i, lab in labels.items() if lab == "node_c")
        with tempfile.TemporaryDirectory() as out:
            cfg = small_config(
                Path(out),
                "deploy.mode=ray",
                "transferqueue.placement.resources={node_a: 0.01}",
                "transferqueue.num_units=2",
                "rollout.instances=2",
                "rollout.placement.resources={node_b: 1}",
                "reward.instances=2",
                "reward.placement.resources={node_b: 1}",
                "train.dp_size=2",
                f"train.placement.node_id={node_c}",
                f"train.steps={STEPS}",
                f"train.max_staleness={MAX_STALENESS}",
                RAY_START,
            )
            result = run(cfg)
        report = {
            "where": {stage: labels[node] for stage, node in result.extra["nodes"].items()},
            "weight_transport": result.extra["weight_transport"],
            "weight_updates": result.extra["weight_updates"],
            "groups_per_step": cfg.train.groups_per_step,
            "steps": [
                {
                    "step": r.step,
                    "groups": r.groups,
                    "staleness": r.staleness,
                    "sample_versions": r.sample_versions,
                }
                for r in result.reports
            ],
        }
        json.dump(report, sys.stdout)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
