"""The workflow trains on rows of a file, scored by a user's reward named by import path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow import run
from asyncflow.config.check import check_config
from tests.asyncflow.conftest import small_config

USER_REWARD = """
from typing import Any

CALLS: list[tuple[Any, Any, Any]] = []


def exact(prompts: Any, completions: Any, *, answer: Any, level: Any, **_: Any) -> list[float]:
    CALLS.extend(zip(prompts, answer, level))
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
"""


@pytest.fixture
def user_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_reward_mod.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_reward_mod:exact"


def test_rows_of_a_file_reach_the_user_reward(
    out_dir: Path, tmp_path: Path, user_reward: str
) -> None:
    rows = [{"q": f"{a} + {a} =", "sum": 2 * a, "level": a % 3} for a in range(10)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = small_config(
        out_dir,
        "task.name=file",
        f"task.options={{path: {data}, prompt_key: q, answer_key: sum, extra_keys: [level], "
        "epochs: 2}",
        f"reward.functions=[{user_reward}]",
        "train.steps=5",  # 5 steps x 2 groups = the 10 rows, each once
    )
    check_config(cfg)
    result = run(cfg)
    assert len(result.records) == 5
    import user_reward_mod

    by_prompt = {r["q"]: (r["sum"], r["level"]) for r in rows}
    seen = {prompt for prompt, _, _ in user_reward_mod.CALLS}
    assert seen == set(by_prompt)  # one epoch's worth of groups: every row exactly once
    for prompt, answer, level in user_reward_mod.CALLS:
        assert by_prompt[prompt] == (answer, level)  # the row's own answer and extra column
    assert len(user_reward_mod.CALLS) == 10 * cfg.rollout.group_size


def test_the_reward_gets_every_column_of_the_task(out_dir: Path) -> None:
    # The countdown reward reads the row's "numbers" column besides its answer.
    cfg = small_config(out_dir, "task.name=countdown", "reward.functions=[countdown]")
    result = run(cfg)
    assert len(result.records) == cfg.train.steps
