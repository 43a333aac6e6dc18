"""The CI script's command runner: any non-zero exit fails CI, pytest's exit 5 included."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci" / "run"


def _run_in_ci_shell(command: str) -> subprocess.CompletedProcess[str]:
    """Calls .ci/run's own ``run`` function (cut out of the script) on ``command``."""
    script = CI.read_text()
    start = script.index("run() {")
    function = script[start : script.index("\n}\n", start) + 3]
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{function}\nrun {command!r}\necho after"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("command", "rc", "message"),
    [
        ("exit 5", 5, "pytest collected no tests (exit 5)"),  # was treated as success
        ("exit 3", 3, "exit code 3"),
    ],
)
def test_a_failing_command_stops_ci(command: str, rc: int, message: str) -> None:
    proc = _run_in_ci_shell(command)
    assert proc.returncode == rc
    assert message in proc.stderr
    assert "after" not in proc.stdout


def test_a_passing_command_goes_on() -> None:
    proc = _run_in_ci_shell("true")
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ["+ true", "after"]
