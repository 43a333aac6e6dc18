"""``python -m bench.gpu``: where no GPU is visible it stops at once with a clear message
(status 2, nothing written); on a GPU its quick form runs every case and writes each ratio."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _run(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ASYNCFLOW_BENCH_DIR": str(tmp_path), **env},
    )


def test_without_a_gpu_it_says_so_and_stops(tmp_path: Path) -> None:
    done = _run(tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2, done.stderr
    assert "bench.gpu needs a CUDA device and this process sees none" in done.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quick_run_measures_every_ratio(tmp_path: Path) -> None:
    done = _run(tmp_path, "--quick", env={})
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "gpu.json").read_text())
    assert len(results["ratios"]) == 7
    assert all(v > 0 for v in results["ratios"].values()), results["ratios"]
    assert (tmp_path / "gpu.png").is_file()
