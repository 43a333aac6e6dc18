"""Starts a 3-node Ray cluster on this machine, runs a ``deploy=ray`` GRPO run on it, removes
one worker node mid-run (every actor on it dies at once), adds a fresh node a few seconds
later, and prints, as JSON, what the run recorded (steps, where each host ended, when the
node went and came).

    python -m tests.asyncflow.node_loss_probe [OUTPUT_DIR]

Run in its own process by ``test_ray_node_loss.py``: a process joins one Ray cluster only,
and the test session may already have one.

| node      | resources                           | what lands there                          |
|-----------|-------------------------------------|-------------------------------------------|
| a (head)  | ``node_a``                          | the driver, trainer, coordinator, rollout |
|           |                                     | dispatcher, TransferQueue controller      |
| b, c      | ``gen: 1, unit: 1, rw: 1`` each     | one generator, one storage unit, one      |
|           |                                     | reward worker each                        |
| d (later) | as b                                | what Ray restarts of b's actors           |

One of each per worker node: the placement is fixed by the resources, not by Ray's choice.
With ``transferqueue.replicas=2`` every row has a copy on each unit, so b's unit takes no row
with it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.asyncflow.cluster_probes import LOOPBACK, head_cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 160
"""Long enough that a host restarted on the new node (about 25 s after the loss on 2 cores,
the run's steps about 0.45 s) takes batches before the end, with room for a slower machine."""
LOSS_STEP = 10
"""Steps recorded before node b is removed."""
JOIN_AFTER_S = 5.0
"""Seconds from the loss to node d joining."""
MAX_STALENESS = 1
WORKER = {"gen": 1, "unit": 1, "rw": 1}


def _steps(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _lose_and_join(
    cluster: Any, victim: Any, out: Path, seen: dict[str, Any], running: threading.Thread
) -> None:
    """Once ``LOSS_STEP`` steps are recorded, remove node b (no grace: its processes are
    killed, as when a machine goes), then add node d ``JOIN_AFTER_S`` later."""
    loopback = {"node_ip_address": "127.0.0.1"}
    deadline = time.monotonic() + 900
    while _steps(out) < LOSS_STEP:
        if time.monotonic() > deadline or not running.is_alive():
            return
        time.sleep(0.1)
    seen["lost_at_step"] = _steps(out)
    seen["lost_t"] = time.time()
    cluster.remove_node(victim, allow_graceful=False)
    time.sleep(JOIN_AFTER_S)
    seen["joined_at_step"] = _steps(out)
    seen["joined_t"] = time.time()
    cluster.add_node(num_cpus=2, resources={"node_d": 10, **WORKER}, **loopback)


def main() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray

    from asyncflow import run
    from tests.asyncflow.conftest import RAY_START, small_config

    loopback = LOOPBACK
    cluster = head_cluster()
    try:
        victim = cluster.add_node(num_cpus=2, resources={"node_b": 10, **WORKER}, **loopback)
        cluster.add_node(num_cpus=2, resources={"node_c": 10, **WORKER}, **loopback)
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
        )
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)  # (a folder to keep)
            cfg = small_config(
                out,
                "deploy.mode=ray",
                "transferqueue.num_units=2",
                "transferqueue.replicas=2",
                "transferqueue.placement.resources={unit: 1}",
                "rollout.instances=2",
                "rollout.placement.resources={gen: 1}",
                "reward.instances=2",
                "reward.placement.resources={rw: 1}",
                "train.placement.resources={node_a: 0.01}",
                f"train.steps={STEPS}",
                f"train.max_staleness={MAX_STALENESS}",
                # steps of about a second, so that the run outlasts a restarted host's start
                # on the new node (its process imports torch and loads the model)
                "rollout.max_new_tokens=64",
                "train.groups_per_step=4",
                RAY_START,
            )
            seen: dict[str, Any] = {}
            done: dict[str, Any] = {}

            def drive() -> None:
                try:
                    done["result"] = run(cfg)
                except BaseException as e:
                    done["error"] = e

            # the run in a thread: Ray adds a node only from the main thread (signal handlers)
            runner = threading.Thread(target=drive, daemon=True)
            t0 = time.time()
            runner.start()
            _lose_and_join(cluster, victim, out, seen, runner)
            runner.join()
            if "error" in done:
                raise done["error"]
            result = done["result"]
        labels = {
            n["NodeID"]: next(k for k in n["Resources"] if k.startswith("node_"))
            for n in ray.nodes()
            if n["Resources"]
        }
        report = {
            "where": {
                stage: labels.get(node, node) for stage, node in result.extra["nodes"].items()
            },
            "restarts": result.extra["restarts"],
            "groups_per_step": cfg.train.groups_per_step,
            "seen": {k: (v - t0 if k.endswith("_t") else v) for k, v in seen.items()},
            "lanes": {
                lane: [round(iv[0], 2) for iv in ivs]
                for lane, ivs in result.timeline.intervals.items()
                if lane.startswith(("rollout/", "reward", "train"))
            },
            "records": [
                {
                    k: r.get(k)
                    for k in ("step", "time_s", "step_s", "restarts", "restart_s", "rows_returned")
                }
                | {"instances": r["instances"]}
                for r in result.records
            ],
            "steps": [
                {"step": r.step, "groups": r.groups, "staleness": r.staleness}
                for r in result.reports
            ],
        }
        json.dump(report, sys.stdout)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
