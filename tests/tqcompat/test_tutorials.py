"""TransferQueue 0.1.11's own tutorials, unmodified, run on the facade (``python -m tqcompat``)
and print what they print on the peer (``expected/``, see :mod:`tq011_tutorials`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tq011_tutorials import EXPECTED, RUNNABLE, fetch_tutorials, normalize

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tutorials(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = Path(os.environ.get("TQ_COMPAT_CACHE", tmp_path_factory.mktemp("tq011")))
    return fetch_tutorials(cache)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.parametrize("name", RUNNABLE)
def test_a_peer_tutorial_runs_unmodified(name: str, tutorials: Path, ray_cluster: None) -> None:
    import ray

    env = {
        **os.environ,
        # the session's cluster: the tutorial's ray.init() joins it (never a second cluster)
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tqcompat", str(tutorials / "tutorial" / f"{name}.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tutorials,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = normalize((EXPECTED / f"{name}.txt").read_text(encoding="utf-8"))
    assert normalize(proc.stdout) == expected
