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


def test_readme_commands_are_the_ci_commands() -> None:
    text = README.read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        block = text[text.index(marker) :].split("```")[1]
        assert "torch==2.13.0" in block and block.index("torch==2.13.0") < block.index(
            "install -q -e"
        )
