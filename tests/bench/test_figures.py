"""The README's and docs/benchmarks.md's figures are the benchmarks' own output: each marked
block is what ``python -m bench.figures`` renders from ``docs/bench/*.json``, and a figure
edited by hand, or a JSON re-run without its text, fails CI here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import figures

ROOT = Path(__file__).resolve().parents[2]


def _copy_of_the_docs(tmp_path: Path) -> Path:
    for page in figures.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / page, tmp_path / page)
    shutil.copytree(ROOT / figures.DATA, tmp_path / figures.DATA)
    return tmp_path


def test_every_figures_block_matches_its_json() -> None:
    assert figures.stale_blocks(ROOT) == []
    names = {
        m.group(2)
        for page in figures.PAGES
        for m in figures.BLOCK.finditer((ROOT / page).read_text())
    }
    assert names == set(figures.RENDERERS)  # every renderer is used, each block known


def test_a_figure_edited_by_hand_fails_the_check(tmp_path: Path) -> None:
    root = _copy_of_the_docs(tmp_path)
    readme = root / "README.md"
    text = readme.read_text()
    block = figures.BLOCK.search(text[text.index("<!-- figures: readme-trl -->") :])
    assert block is not None and "1.38x" in block.group(3)
    readme.write_text(
        text.replace("**1.38x** with `max_staleness=1`", "**1.48x** with `max_staleness=1`")
    )
    assert figures.stale_blocks(root) == ["README.md: readme-trl"]


def test_a_json_rerun_without_its_text_fails_the_check_until_rendered(tmp_path: Path) -> None:
    root = _copy_of_the_docs(tmp_path)
    path = root / figures.DATA / "ray_overhead.json"
    data = json.loads(path.read_text())
    data["step_ms"]["overhead"] = 12.345
    path.write_text(json.dumps(data))
    assert figures.stale_blocks(root) == [
        "README.md: readme-ray-overhead",
        "docs/benchmarks.md: ray-overhead-table",
    ]
    for page, (_, new) in figures.render(root).items():
        (root / page).write_text(new)
    assert figures.stale_blocks(root) == []
    assert "**12.3 ms** more per step" in (root / "README.md").read_text()


def test_an_unknown_block_is_refused_with_the_known_names(tmp_path: Path) -> None:
    root = _copy_of_the_docs(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n<!-- figures: no-such -->\n<!-- /figures -->\n")
    with pytest.raises(ValueError, match=r"unknown figures block 'no-such'; known: .*readme-trl"):
        figures.render(root)
