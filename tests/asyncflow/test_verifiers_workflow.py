"""verifiers environments train end to end: a single-turn environment with a rubric and a
multi-turn tool environment (:mod:`tests.asyncflow.vf_envs`, defined with the real library),
their datasets as the prompts, their rollouts driven through the rollout's endpoint, their
rubrics as the reward, on the tiny model for 10 steps each."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from asyncflow import EngineFactories, run
from tests.asyncflow.conftest import DEPLOYS, small_config

pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'asyncflow[verifiers]'")
pytest.importorskip("aiohttp")

from tests.asyncflow.episodes import CheckingTrain, mask_checking_trainer


def verifiers_run(env: str, *extra: str) -> list[str]:
    return [
        f"rollout.agent=verifiers:tests.asyncflow.vf_envs:{env}",
        "task.name=verifiers",
        f"task.options.environment=tests.asyncflow.vf_envs:{env}",
        "rollout.max_new_tokens=6",
        "rollout.max_episode_tokens=64",
        "rollout.max_turns=1",
        "env.timeout_s=30",
        "train.steps=10",
        *extra,
    ]


TOOL_CALLS = [
    # the tiny model learns to call the tool from the dataset's ``call`` column (100 supervised
    # steps, about 5 s): its calls are 55-65 tokens long
    "task.options.reference_key=call",
    "model.warm_start_steps=100",
    "rollout.max_new_tokens=72",
    "rollout.max_episode_tokens=200",
]
RUNS = {"single_turn": ["rollout.max_turns=1"], "tool_env": ["rollout.max_turns=2", *TOOL_CALLS]}


@pytest.mark.parametrize(
    "env",
    ["single_turn", pytest.param("tool_env", marks=pytest.mark.slow)],  # ~30 s
)
def test_a_verifiers_environment_trains_ten_steps(out_dir: Path, env: str) -> None:
    """Every group trained once, every token's version checked where it is trained, the
    rubric's reward in every step; the tool env's episodes call the tool: two calls of the
    model, the tool's result between them off the loss mask."""
    cfg = small_config(out_dir, *verifiers_run(env, *RUNS[env]))
    result = run(
        cfg,
        adapters={"train": CheckingTrain},
        factories=EngineFactories(trainer=mask_checking_trainer),
    )
    assert len(result.records) == 10
    b = cfg.train.groups_per_step
    assert [g for rep in result.reports for g in rep.groups] == list(range(10 * b))
    for r in result.records:
        assert r["versions_checked"] == 1.0  # every token's version checked where trained
        assert 0.0 < r["loss_mask_frac"] <= 1.0
        assert set(r["episode_end_reasons"]) <= {"done", "max_tokens", "max_turns"}
        # the rubric's reward: 1 for the right number, plus 0.5 / (1 + answer length) > 0
        assert math.isfinite(r["reward"]) and 0.0 < r["reward"] <= 2.5
    if env == "single_turn":
        assert all(r["turns_mean"] == 1.0 and r["loss_mask_frac"] == 1.0 for r in result.records)
    else:  # the warm-started policy calls the tool in (almost) every episode of its first step
        assert result.records[0]["turns_mean"] > 1.5
        assert result.records[0]["loss_mask_frac"] < 1.0


@pytest.mark.parametrize("deploy", [DEPLOYS[-1]], indirect=True)  # ray
def test_a_verifiers_environment_on_ray(out_dir: Path, deploy: list[str]) -> None:
    """The environment is loaded in the data loader and in each rollout actor (by its import
    path, off the main thread), and its episodes train as in one process."""
    cfg = small_config(out_dir, *verifiers_run("single_turn", "train.steps=3"), *deploy)
    result = run(cfg)
    assert [r["step"] for r in result.records] == [0, 1, 2]
    for r in result.records:
        assert sum(r["episode_end_reasons"].values()) == 8 and r["turns_mean"] == 1.0
        assert math.isfinite(r["reward"]) and 0.0 < r["reward"] <= 1.5


def test_a_verifiers_run_needs_its_task_and_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.config import ConfigError
    from asyncflow.config.check import resolve_config

    args = verifiers_run("single_turn")
    with pytest.raises(ConfigError, match=r"task\.name=verifiers"):
        resolve_config(None, [a for a in args if not a.startswith("task.")])
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError, match=r"pip install 'asyncflow\[verifiers\]'"):
        resolve_config(None, args)
