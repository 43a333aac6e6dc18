"""Starts a 3-node Ray cluster on this machine, deploys a workflow's stage hosts on it as a
config places them, and prints where each landed, as JSON: ``{stage: node label}``.

    python -m tests.asyncflow.placement_probe

Run in its own process by ``test_ray_workflow.py``: a process joins one Ray cluster only, and
the test session already has one.

| node  | resources            | what the config puts there                          |
|-------|----------------------|-----------------------------------------------------|
| a     | ``node_a`` (head)    | TransferQueue controller and units (custom resource) |
| b     | ``node_b``           | generators and reward workers (custom resource)      |
| c     | ``node_c``           | the trainer ranks (pinned by node id)                |
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    from asyncflow import load_config
    from asyncflow.deploy.ray import RayDeployment
    from asyncflow.metrics import Timeline

    loopback = {"node_ip_address": "127.0.0.1"}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"node_a": 10}, **loopback},
    )
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
            cfg = load_config(
                overrides=[
                    f"output.dir={out}",
                    "model.warm_start_steps=0",
                    "deploy.mode=ray",
                    "transferqueue.placement.resources={node_a: 0.01}",
                    "rollout.instances=2",
                    "rollout.placement.resources={node_b: 1}",
                    "reward.instances=2",
                    "reward.placement.resources={node_b: 1}",
                    "train.dp_size=2",
                    f"train.placement.node_id={node_c}",
                ]
            )

            async def deploy() -> dict[str, str]:
                async with RayDeployment(cfg, Timeline()) as dep:
                    return await dep.where()

            where = asyncio.run(deploy())
        json.dump({stage: labels[node] for stage, node in where.items()}, sys.stdout)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
