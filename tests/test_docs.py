"""The documentation site's config makes `mkdocs build --strict` (CI's docs part) fail on a
broken link, a broken anchor and an API reference to nothing. Needs the docs extra."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("transferqueue", "asyncflow", "engines", "adapters")


def test_a_broken_link_anchor_or_reference_fails_the_strict_build(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="needs the docs extra (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings")
    shutil.copy2(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    for package in PACKAGES:  # the API reference reads the docstrings from here
        (tmp_path / package).symlink_to(ROOT / package, target_is_directory=True)
    with (tmp_path / "docs" / "design.md").open("a") as page:
        page.write(
            "\n[gone](no-such-page.md), [off](benchmarks.md#no-such-section), "
            "[moved][transferqueue.NoSuchThing]\n"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "s")],
        cwd=tmp_path,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("WARNING")]
    assert proc.returncode != 0
    assert len(warnings) == 3, proc.stderr  # these three, and nothing else in the site
    for broken in ("'no-such-page.md'", "'#no-such-section'", "'transferqueue.NoSuchThing'"):
        assert any(broken in line for line in warnings), (broken, warnings)
