"""Ray started for a run while the workflow imports (``asyncflow.deploy.ray_start``).

``asyncflow.run`` starts a cluster of the run's own on the main thread while a thread imports
the workflow; the deployment takes it over and shuts it down at its end; a run that fails
before a deployment takes it shuts it down too. Runs that join a cluster, run locally, or
find Ray running leave Ray alone. The real runs go in a fresh interpreter (this process's
tests share one Ray cluster).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncflow import load_config
from asyncflow.deploy.ray_start import cpus_asked, start_early, take_early
from tests.asyncflow.conftest import RAY_TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "overrides",
    [["deploy.mode=local"], ["deploy.mode=ray", "deploy.address=127.0.0.1:1"]],
    ids=["local", "given-cluster"],
)
def test_only_a_run_with_a_cluster_of_its_own_starts_ray_early(overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    assert start_early(cfg, ("json",)) is False
    assert take_early() is False  # nothing to own


def test_start_early_off_the_main_thread_does_nothing() -> None:
    """Ray must start on the main thread (its signal handlers, and the processes it starts
    die with the thread that started them)."""
    cfg = load_config(None, ["deploy.mode=ray"])
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(start_early(cfg, ())))
    t.start()
    t.join(30)
    assert got == [False] and take_early() is False


def test_the_cpus_a_config_asks_for() -> None:
    cfg = load_config(
        None,
        [
            "deploy.mode=ray",
            "rollout.instances=3",
            "rollout.placement.num_cpus=0.5",
            "reward.instances=2",
            "reward.placement.num_cpus=0.25",
            "train.placement.num_cpus=2",
        ],
    )
    assert cpus_asked(cfg) == 3 * 0.5 + 2 * 0.25 + cfg.train.dp_size * 2


_SCRIPT = """
import json, logging, sys
import ray
from asyncflow import EngineFactories, load_config, run

records = []
class Keep(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.basicConfig(level=logging.WARNING)
logging.getLogger("asyncflow.deploy.ray").setLevel(logging.INFO)
logging.getLogger("asyncflow.deploy.ray").addHandler(Keep())
out = sys.argv[1]
overrides = ["deploy.mode=ray", "train.max_staleness=0", "train.steps=2",
             f"output.dir={out}/run", "output.plot=false", "output.loggers=[jsonl]"]
result = run(load_config(None, overrides))
report = {"steps": len(result.records), "ray_after_run": ray.is_initialized(),
          "early": any("started with the imports" in m for m in records)}

def boom(cfg):
    raise RuntimeError("no task today")

try:
    run(load_config(None, [*overrides[:-3], f"output.dir={out}/failed"]),
        factories=EngineFactories(task=boom))
    report["failed"] = "no error"
except RuntimeError as e:
    report["failed"] = str(e)
report["ray_after_failure"] = ray.is_initialized()
print("REPORT " + json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.timeout(RAY_TEST_TIMEOUT_S)
def test_a_run_starts_ray_with_its_imports_and_shuts_it_down(tmp_path: Path) -> None:
    """A real run on a cluster of its own: it trains its steps on the cluster started with
    the imports (the deployment says so), and Ray is down afterwards; a run whose task
    fails before any deployment owns the cluster shuts it down as well."""
    pytest.importorskip("ray")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=RAY_TEST_TIMEOUT_S - 60,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORT "))
    report = json.loads(line[len("REPORT ") :])
    assert report == {
        "steps": 2,
        "ray_after_run": False,
        "early": True,
        "failed": "no task today",
        "ray_after_failure": False,
    }


def test_fewer_collections_inside_the_block_and_as_before_after_it() -> None:
    import gc

    from asyncflow.deploy.ray_start import START_GC_THRESHOLD, fewer_collections

    before = gc.get_threshold()
    with fewer_collections():
        assert gc.get_threshold() == START_GC_THRESHOLD
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError, match="an engine that failed"), fewer_collections():
        raise RuntimeError("an engine that failed")
    assert gc.get_threshold() == before  # (restored whatever the block raised)
