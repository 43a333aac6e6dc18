"""The opt-in that gives ``transfer_queue`` to the facade: nothing without it, the facade with
it, and never a real TransferQueue hidden without being told (each case in a fresh
interpreter, so that no test sees another's ``sys.modules``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import transfer_queue as tq
from transfer_queue.metadata import BatchMeta
from transfer_queue.sampler import BaseSampler
import tqcompat
assert tq is tqcompat and BatchMeta is tqcompat.BatchMeta and BaseSampler is tqcompat.BaseSampler
print("facade", tq.__version__)
"""


def _run(
    args: list[str], tmp_path: Path, extra_path: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(str(p) for p in (extra_path, ROOT) if p is not None)
    full = {**os.environ, "PYTHONPATH": path, **env}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=full
    )


def test_the_name_is_given_only_by_the_opt_in(tmp_path: Path) -> None:
    script = tmp_path / "peer_code.py"
    script.write_text(SCRIPT)
    plain = _run([str(script)], tmp_path)
    assert plain.returncode != 0 and "No module named 'transfer_queue'" in plain.stderr
    switched = _run(["-m", "tqcompat", str(script)], tmp_path)
    assert switched.returncode == 0, switched.stderr
    assert switched.stdout.strip() == "facade 0.1.11"
    by_call = _run(["-c", "import tqcompat; tqcompat.install()\n" + SCRIPT], tmp_path)
    assert by_call.returncode == 0, by_call.stderr


def test_a_real_transfer_queue_is_never_hidden_silently(tmp_path: Path) -> None:
    real = tmp_path / "site"
    (real / "transfer_queue").mkdir(parents=True)
    (real / "transfer_queue" / "__init__.py").write_text("print('the real one')\n")
    script = tmp_path / "peer_code.py"
    script.write_text(SCRIPT)
    refused = _run(["-m", "tqcompat", str(script)], tmp_path, real)
    assert refused.returncode != 0
    assert "the real TransferQueue is installed" in refused.stderr
    assert "install(force=True)" in refused.stderr and "TQ_COMPAT_FORCE=1" in refused.stderr
    kept = _run(["-c", "import transfer_queue"], tmp_path, real)
    assert kept.stdout.strip() == "the real one"
    forced = _run(["-m", "tqcompat", str(script)], tmp_path, real, TQ_COMPAT_FORCE="1")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "facade 0.1.11"
    assert "transfer_queue -> tqcompat" in forced.stderr and str(real) in forced.stderr


def test_the_shim_path_switches_every_process_that_has_it(tmp_path: Path) -> None:
    shim = _run(["-m", "tqcompat", "--shim-path"], tmp_path).stdout.strip()
    script = tmp_path / "peer_code.py"
    script.write_text(SCRIPT)
    on_path = _run([str(script)], tmp_path, Path(shim))
    assert on_path.returncode == 0, on_path.stderr
    assert on_path.stdout.strip() == "facade 0.1.11" and on_path.stderr == ""
    real = tmp_path / "site"
    (real / "transfer_queue").mkdir(parents=True)
    (real / "transfer_queue" / "__init__.py").write_text("print('the real one')\n")
    both = _run([str(script)], tmp_path, Path(f"{shim}{os.pathsep}{real}"))
    assert both.returncode == 0, both.stderr
    assert both.stdout.strip() == "facade 0.1.11"
    assert "the real one at" in both.stderr and str(real) in both.stderr


def test_the_peers_module_paths_that_users_import_exist(tmp_path: Path) -> None:
    script = """
import logging
import tqcompat
tqcompat.install()
from transfer_queue.sampler.grpo_group_n_sampler import GRPOGroupNSampler
from transfer_queue.sampler.rank_aware_sampler import RankAwareSampler
from transfer_queue.sampler.seqlen_balanced_sampler import get_seqlen_balanced_partitions
from transfer_queue.sampler.sequential_sampler import SequentialSampler
from transfer_queue.dataloader.streaming_dataset import chunk_batch_fn
from transfer_queue.dataloader.streaming_dataloader import StreamingDataLoader
from transfer_queue.utils.logging_utils import get_logger
assert GRPOGroupNSampler is tqcompat.GRPOGroupNSampler
assert chunk_batch_fn.__module__ == "tqcompat.dataloader"
logger = get_logger("peer-demo", default_level="INFO")
assert logger.level == logging.INFO and logger.hasHandlers()
print("ok")
"""
    got = _run(["-c", script], tmp_path)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr
