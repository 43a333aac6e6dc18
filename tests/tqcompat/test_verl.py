"""verl's V1 replay buffer on the facade: verl's own CPU test of it, unmodified, over verl
0.9.1's released module, with ``transfer_queue`` given to the facade by the shim.

Two pieces come from verl, neither is kept in this repository:

- its wheel (``pip download verl==0.9.1 --no-deps -d <cache>``; the cache is ``TQ_COMPAT_CACHE``,
  else ``bench/.peer-cache``): only the modules ``verl.trainer.ppo.v1.replay_buffer`` imports
  are extracted (:data:`VERL_MODULES`), with an empty ``verl/trainer/ppo/v1/__init__.py`` of
  ours so that the trainers (Ray, vLLM) are not imported;
- its test, ``tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py``, which is in verl's
  repository only (neither the wheel nor the sdist on PyPI ships it): ``VERL_REPO`` names a
  checkout of https://github.com/verl-project/verl (one whose ``replay_buffer.py`` matches
  0.9.1's: the test and the module change together).

Without either the test skips, saying what to fetch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tqcompat.alias import SHIM_PATH

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TQ_COMPAT_CACHE", ROOT / "bench" / ".peer-cache"))
VERSION = "0.9.1"
TEST_PATH = "tests/trainer/ppo/v1/test_replay_buffer_on_cpu.py"
EXPECTED_TESTS = 45  # what the test collects at verl 0.9.1 (all pass on the real peer)
VERL_MODULES = (
    "verl/__init__.py",
    "verl/base_config.py",
    "verl/plugin/__init__.py",
    "verl/plugin/platform/__init__.py",
    "verl/plugin/platform/platform_base.py",
    "verl/plugin/platform/platform_cuda.py",
    "verl/plugin/platform/platform_manager.py",
    "verl/plugin/platform/platform_npu.py",
    "verl/plugin/platform/platform_rocm.py",
    "verl/protocol.py",
    "verl/trainer/__init__.py",
    "verl/trainer/ppo/__init__.py",
    "verl/trainer/ppo/v1/replay_buffer.py",
    "verl/utils/__init__.py",
    "verl/utils/config.py",
    "verl/utils/device.py",
    "verl/utils/groupwise.py",
    "verl/utils/import_utils.py",
    "verl/utils/logging_utils.py",
    "verl/utils/metric/__init__.py",
    "verl/utils/metric/utils.py",
    "verl/utils/py_functional.py",
    "verl/utils/skip/__init__.py",
    "verl/utils/skip/base_skip.py",
    "verl/utils/skip/config.py",
    "verl/utils/skip/rollout_skip.py",
    "verl/utils/skip/skip_manager.py",
    "verl/utils/tensordict_utils.py",
    "verl/utils/tokenizer/__init__.py",
    "verl/utils/tokenizer/tokenizer.py",
    "verl/utils/torch_functional.py",
    "verl/utils/transferqueue_utils.py",
)
"""The files of verl 0.9.1 that ``import verl.trainer.ppo.v1.replay_buffer`` loads."""


def _verl_sources(tmp: Path) -> Path:
    """A folder with verl's modules and its test (in ``tests/``), or a skip naming what to
    fetch."""
    wheel = next(CACHE.glob(f"verl-{VERSION}-*.whl"), None)
    if wheel is None:
        pytest.skip(
            f"verl {VERSION}'s wheel is not in {CACHE}: "
            f"pip download verl=={VERSION} --no-deps -d {CACHE}"
        )
    repo = os.environ.get("VERL_REPO")
    test = Path(repo) / TEST_PATH if repo else None
    if test is None or not test.is_file():
        pytest.skip(
            f"verl's {TEST_PATH} is in its repository only (not in the wheel or the sdist): "
            "git clone https://github.com/verl-project/verl and set VERL_REPO to it"
        )
    with zipfile.ZipFile(wheel) as zf:
        present = set(zf.namelist())
        for name in VERL_MODULES:
            assert name in present, f"{name} is not in {wheel.name}: update VERL_MODULES"
            zf.extract(name, tmp / "site")
        for name in present:  # data files next to them (verl/version/version)
            if name.startswith("verl/version/"):
                zf.extract(name, tmp / "site")
    (tmp / "site" / "verl" / "trainer" / "ppo" / "v1" / "__init__.py").write_text("")
    (tmp / "tests").mkdir()
    (tmp / "tests" / test.name).write_bytes(test.read_bytes())
    (tmp / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
    return tmp


@pytest.mark.slow
def test_verls_replay_buffer_test_passes_on_the_facade(tmp_path: Path) -> None:
    here = _verl_sources(tmp_path)
    path = os.pathsep.join((SHIM_PATH, str(ROOT), str(here / "site")))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=here,
        env={**os.environ, "PYTHONPATH": path},
    )
    passed = re.findall(r"^PASSED (\S+)", proc.stdout, re.M)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
    print(f"verl {VERSION} replay buffer on the facade: {len(passed)}/{len(passed) + len(failed)}")
    assert not failed and len(passed) == EXPECTED_TESTS, proc.stdout[-6000:] + proc.stderr[-2000:]
