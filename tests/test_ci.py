"""The CI scripts: `.ci/run` fails on any non-zero exit (pytest's 5 included), runs the slow test
tier after the README's (fast) test command and builds the documentation site strictly between
lint and the vLLM part; `.ci/soak` runs a command N times in
a row from fresh clones under busy loops and stops at the first failure."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tomllib
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


# ---- .ci/run's parts, on a stand-in repository whose programs record their calls ---------------


def _ci_repo(tmp_path: Path, failing: str = "") -> tuple[Path, Path]:
    """A copy of .ci/run beside a README whose commands only echo, and stand-ins for the
    virtualenv's python, ruff, mypy, pip and mkdocs that record their arguments (``failing``
    exits 1)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "run").write_bytes(CI.read_bytes())
    (repo / "README.md").write_text(
        "<!-- test-command -->\n```bash\necho tests ran\n```\n"
        "<!-- vllm-command -->\n```bash\necho vllm ran\n```\n"
    )
    calls = tmp_path / "calls"
    bin_dir = repo / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "ruff", "mypy", "pip", "mkdocs"):
        rc = 1 if name == failing else 0
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit {rc}\n')
        (bin_dir / name).chmod(0o755)
    return repo, calls


def _ci(repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, timeout=60
    )


def test_ci_builds_the_docs_strictly_after_lint_and_before_the_vllm_part(tmp_path: Path) -> None:
    repo, calls = _ci_repo(tmp_path)
    proc = _ci(repo)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [c.strip() for c in calls.read_text().splitlines()[-3:]] == [
        "mypy",
        "pip install -q -e .[docs]",  # the docs extra, into the virtualenv the tests built
        "mkdocs build --strict --site-dir site",
    ]
    parts = [line.split()[2] for line in proc.stdout.splitlines() if line.startswith("CI part ")]
    assert parts == ["tests", "slow", "lint", "docs", "vllm"]
    slow = "python -m pytest -q -n 2 --dist loadgroup -m slow and not (vllm or smollm2)"
    assert calls.read_text().splitlines()[0] == slow  # the slow tier, in that virtualenv


def test_a_failing_docs_build_fails_ci_before_the_vllm_part(tmp_path: Path) -> None:
    repo, _ = _ci_repo(tmp_path, failing="mkdocs")
    proc = _ci(repo)
    assert proc.returncode == 1
    assert "CI failed: exit code 1 from: .venv/bin/mkdocs build --strict" in proc.stderr
    assert "vllm ran" not in proc.stdout


def test_the_docs_extra_holds_what_ci_builds_the_site_with() -> None:
    pyproject = tomllib.loads((CI.parents[1] / "pyproject.toml").read_text())
    docs = pyproject["project"]["optional-dependencies"]["docs"]
    names = {re.split(r"[<>=\[]", d)[0] for d in docs}
    assert names == {"mkdocs", "mkdocs-material", "mkdocstrings"}
    assert any(d.startswith("mkdocstrings[python]") for d in docs)  # the python handler


# ---- .ci/soak: the suite N times in a row from fresh clones, under busy loops ----------------

SOAK = CI.parent / "soak"


@pytest.fixture
def soak_repo(tmp_path: Path) -> Path:
    """A small git repository holding ``.ci/soak`` and a README whose test command passes."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / ".ci" / "soak").write_bytes(SOAK.read_bytes())
    (repo / "README.md").write_text(
        '# x\n\n<!-- test-command -->\n```bash\necho "5 passed, 2 skipped in 0.10s"\n```\n'
    )
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=repo,
            check=True,
            timeout=60,
        )
    return repo


def _soak(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / ".ci" / "soak"), "--dir", str(repo.parent / "soak"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_soak_runs_the_readme_command_in_fresh_clones_under_busy_loops(soak_repo: Path) -> None:
    proc = _soak(soak_repo, "--runs", "2", "--hogs", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (soak_repo.parent / "soak" / "summary.txt").read_text()
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=soak_repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    for i in (1, 2):  # the README's command ran, each time at the commit
        assert f"run {i}/2 {head} rc=0 wall=" in summary
    assert summary.count(": 5 passed, 2 skipped in 0.10s") == 2
    assert summary.splitlines()[-1] == "soak: 2 run(s) in a row passed"
    assert summary == proc.stdout
    assert not (soak_repo.parent / "soak" / "run1").exists()  # a passing run's clone is removed


def test_soak_command_runs_in_a_clone_while_its_busy_loops_run_and_they_stop(
    soak_repo: Path,
) -> None:
    record = soak_repo.parent / "record"
    command = (
        f'echo "$SOAK_RUN $PWD" >> {record}; '
        f'for p in $SOAK_HOGS; do kill -0 "$p" && echo "hog $p" >> {record}; done'
    )
    proc = _soak(soak_repo, "--runs", "2", "--hogs", "2", "--command", command)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = record.read_text().splitlines()
    runs = [line for line in lines if not line.startswith("hog ")]
    assert runs == [f"{i} {soak_repo.parent / 'soak' / f'run{i}'}" for i in (1, 2)]
    hogs = [int(line.split()[1]) for line in lines if line.startswith("hog ")]
    assert len(hogs) == 4 and len(set(hogs)) == 4  # two live busy loops in each run
    for pid in hogs:  # all stopped once their run ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "no pytest summary line" in proc.stdout


def test_soak_stops_at_the_first_failing_run_and_keeps_its_clone(soak_repo: Path) -> None:
    command = 'echo "1 failed, 4 passed in 0.20s"; test "$SOAK_RUN" -lt 2'
    proc = _soak(soak_repo, "--runs", "3", "--hogs", "0", "--command", command)
    assert proc.returncode == 1
    out = proc.stdout
    assert "rc=0" in out and "rc=1" in out and "run 3/3" not in out
    assert "rc=1 wall=" in out and out.count(": 1 failed, 4 passed in 0.20s") == 2
    assert (soak_repo.parent / "soak" / "run2" / "README.md").exists()
    assert not (soak_repo.parent / "soak" / "run1").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runs", "two"], "--runs and --hogs take a whole number"),
        (["--commit", "no-such-ref"], "--commit no-such-ref is not a commit"),
        (["--rnus", "2"], "unknown argument '--rnus'"),
    ],
)
def test_soak_refuses_bad_arguments(soak_repo: Path, args: list[str], message: str) -> None:
    proc = _soak(soak_repo, *args)
    assert proc.returncode == 2
    assert message in proc.stderr


# ---- the two test tiers: the README's command runs the fast one, CI the slow one after it ----


def _marker_expression(command: str) -> str:
    """The ``-m "..."`` expression of a pytest command line."""
    match = re.search(r'-m "([^"]+)"', command)
    assert match is not None, command
    return match.group(1)


def test_every_test_runs_in_one_tier_and_ci_runs_the_slow_tier_after_the_fast_one() -> None:
    readme = (CI.parents[1] / "README.md").read_text()
    fast = readme[readme.index("<!-- test-command -->") :].split("```")[1].splitlines()[1]
    vllm = [x for x in readme[readme.index("<!-- vllm-command -->") :].split("```")[1].splitlines()]
    script = CI.read_text()
    slow_match = re.search(r"^slow_cmd='(.*)'$", script, re.M)
    assert slow_match is not None
    slow = slow_match.group(1)
    assert slow.startswith(".venv/bin/python -m pytest -q -n 2 --dist loadgroup ")
    assert (
        script.index('part tests "$test_cmd"')
        < script.index('part slow "$slow_cmd"')
        < script.index("part lint")
    )
    parts = {
        "fast": _marker_expression(fast),
        "slow": _marker_expression(slow),
        "vllm": _marker_expression(vllm[-1]),
    }
    for marks in itertools.product([False, True], repeat=3):
        names = dict(zip(("slow", "vllm", "smollm2"), marks, strict=True))
        runs = [p for p, expr in parts.items() if eval(expr, {}, names)]  # (and/or/not only)
        assert runs, f"a test marked {names} runs in no part of CI"
        if not (names["vllm"] or names["smollm2"]):
            assert runs == ["slow" if names["slow"] else "fast"], (names, runs)
