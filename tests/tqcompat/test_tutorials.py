"""TransferQueue 0.1.11's own tutorials, unmodified, run on the facade (``python -m tqcompat``)
and print what they print on the peer (``expected/``, see :mod:`tq011_tutorials`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tq011_tutorials import EXPECTED, RUNNABLE, fetch_tutorials, normalize, retrieved_by_worker

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
    recorded = (EXPECTED / f"{name}.txt").read_text(encoding="utf-8")
    assert normalize(proc.stdout) == normalize(recorded)
    if name == "06_streaming_dataloader":
        # which rows each group got depends on the producers' timing: the sharing is checked
        assert _groups(retrieved_by_worker(proc.stdout)) == _groups(retrieved_by_worker(recorded))


def _groups(retrieved: dict[tuple[int, int], list[list[int]]]) -> list[tuple[int, list[int]]]:
    """Tutorial 06's ranks by data-parallel group: every rank of a group got the same rows at
    each step, two groups never the same row. Returns, per group, its ranks and the shape of
    its steps (each step's rows numbered by first appearance: the peer's DataLoader workers
    each count ``batch_index`` from 0, so steps come in pairs)."""
    by_group: dict[int, list[list[list[int]]]] = {}
    for (_, dp_rank), steps in sorted(retrieved.items()):
        by_group.setdefault(dp_rank, []).append(steps)
    shapes = []
    seen: set[int] = set()
    for dp_rank, ranks in sorted(by_group.items()):
        assert all(steps == ranks[0] for steps in ranks), (dp_rank, ranks)
        rows = {i for step in ranks[0] for i in step}
        assert not rows & seen, f"group {dp_rank} got rows of another group: {rows & seen}"
        seen |= rows
        first: dict[tuple[int, ...], int] = {}
        shape = [first.setdefault(tuple(step), len(first)) for step in ranks[0]]
        shapes.append((len(ranks), shape))
    return shapes
