"""The custom agent of docs/agents.md runs as written, with its command's options."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from asyncflow import load_config, run

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "agents.md"


def _block(text: str, marker: str) -> str:
    """The fenced block right after ``marker``."""
    rest = text[text.index(marker) + len(marker) :]
    return rest.split("```")[1].split("\n", 1)[1]


def test_the_custom_agent_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = PAGE.read_text()
    code = _block(text, "<!-- custom-agent -->")
    assert len(code.strip().splitlines()) <= 40  # the page promises a short one
    (tmp_path / "my_agents.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # what PYTHONPATH=. does
    (command,) = _block(text, "<!-- custom-agent-command -->").splitlines()
    words = shlex.split(command)
    assert words[0] == "PYTHONPATH=." and words[1].endswith("asyncflow") and words[2] == "run"
    cfg = load_config(
        overrides=[
            *words[3:],
            f"output.dir={tmp_path / 'run'}",
            "output.progress=false",
            "output.loggers=[jsonl]",
            "output.plot=false",
            "train.steps=2",  # the page's run, shortened
            "train.groups_per_step=2",
            "rollout.group_size=4",
            "model.warm_start_steps=0",
        ]
    )
    assert cfg.rollout.agent == "my_agents:double_check"
    result = run(cfg)
    assert [r["step"] for r in result.records] == [0, 1]
    for r in result.records:
        reasons = r["episode_end_reasons"]
        assert sum(reasons.values()) == 8 and set(reasons) <= {"done", "max_tokens"}
        assert r["turns_mean"] == 2.0  # both calls of every episode, one trajectory each
    sys.modules.pop("my_agents", None)


def test_the_verifiers_environment_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("verifiers", reason="the verifiers extra")
    text = PAGE.read_text()
    (tmp_path / "my_envs.py").write_text(_block(text, "<!-- verifiers-env -->"))
    monkeypatch.syspath_prepend(str(tmp_path))
    (command,) = _block(text, "<!-- verifiers-command -->").splitlines()
    words = shlex.split(command)
    assert words[0] == "PYTHONPATH=." and words[1].endswith("asyncflow") and words[2] == "run"
    cfg = load_config(
        overrides=[
            *words[3:],
            f"output.dir={tmp_path / 'run'}",
            "output.progress=false",
            "output.loggers=[jsonl]",
            "output.plot=false",
            "train.steps=2",  # the page's run, shortened
            "train.groups_per_step=2",
            "rollout.group_size=4",
            "model.warm_start_steps=0",
        ]
    )
    result = run(cfg)
    assert [r["step"] for r in result.records] == [0, 1]
    for r in result.records:
        assert r["episode_end_reasons"] == {"done": 8} and r["turns_mean"] == 1.0
        assert 0.0 <= r["reward"] <= 1.0  # the rubric's: right or not
    sys.modules.pop("my_envs", None)
