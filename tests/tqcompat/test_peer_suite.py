"""The peer's own test suite (TransferQueue 0.1.11's ``tests/``, from its wheel), unmodified, on
the facade: every test of the public API passes (``python -m bench.peer --compat``; the
excluded tests and why are in :data:`bench.peer_compat.EXCLUDED`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_compat import EXCLUDED

ROOT = Path(__file__).resolve().parents[2]


def test_every_exclusion_says_why() -> None:
    assert EXCLUDED and all(why.strip() for why in EXCLUDED.values())
    assert all(node.startswith("tests/") for node in EXCLUDED)


@pytest.mark.slow
@pytest.mark.ray
def test_the_peers_public_api_tests_pass_on_the_facade() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a head of its own
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bench.peer", "--compat"],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
        env=env,
    )
    summary = re.findall(r"^peer suite .*$", proc.stdout, re.M)
    assert proc.returncode == 0 and summary, proc.stdout[-8000:] + proc.stderr[-3000:]
    passed, public = map(int, re.findall(r"(\d+) / (\d+) public-API", summary[0])[0])
    assert passed == public > 100, summary[0]
