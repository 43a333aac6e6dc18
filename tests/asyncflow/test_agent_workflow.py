"""Agent episodes end to end: the workflow with ``rollout.agent`` on the tiny model.

An agent (:mod:`tests.asyncflow.agent_programs`) calls the rollout's OpenAI-compatible endpoint with
the ``openai`` client; each of its calls is a turn of its episode. The invariants of the
environment seam hold the same (every group trained once and whole, the staleness bound on each
episode's oldest token, every token's version checked where it is trained by
:class:`tests.asyncflow.episodes.CheckingTrain`), and the train stage reads the agent's own
prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow import EngineFactories, run
from tests.asyncflow.conftest import deploys_by_k, small_config

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

from tests.asyncflow.agent_programs import prompt_checking_trainer
from tests.asyncflow.episodes import CheckingTrain

AGENT = [
    "rollout.agent=tests.asyncflow.agent_programs:check_twice",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=3",
    "rollout.max_episode_tokens=48",
    "env.timeout_s=30",
]


@pytest.mark.parametrize(("deploy", "k"), deploys_by_k(ray_ks=(1,)), indirect=["deploy"])
def test_agent_episodes_keep_the_staleness_bound_and_every_token_version(
    out_dir: Path, deploy: list[str], k: int
) -> None:
    """In process, over the service, and on Ray (the agents run in the rollout actors)."""
    cfg = small_config(
        out_dir, *AGENT, f"train.max_staleness={k}", "train.steps=5", *deploy, "train.dp_size=1"
    )
    result = run(
        cfg,
        adapters={"train": CheckingTrain},
        factories=EngineFactories(trainer=prompt_checking_trainer),
    )
    b = cfg.train.groups_per_step
    trained: list[int] = []
    for rep in result.reports:
        assert min(rep.staleness) >= 0 and max(rep.staleness) <= k, rep.staleness
        assert rep.groups == list(range(rep.step * b, (rep.step + 1) * b))
        trained += rep.groups
    assert trained == list(range(cfg.train.steps * b))  # every episode once, none dropped
    for r in result.records:
        assert r["versions_checked"] == 1.0
        assert 0.0 < r["loss_mask_frac"] < 1.0  # the agent's second question is off the mask
        assert r["turns_mean"] == 2.0  # two calls per episode, one trajectory
        assert set(r["episode_end_reasons"]) <= {"done", "max_tokens"}
    if k == 0:
        assert all(set(rep.sample_versions) == {rep.step} for rep in result.reports)


def test_partial_rollouts_inside_agent_calls(out_dir: Path) -> None:
    """With ``rollout.partial``, weight updates land inside agent calls and episodes: their
    tokens carry several versions (checked token by token against the bound)."""
    cfg = small_config(
        out_dir,
        *AGENT,
        "rollout.max_new_tokens=24",
        "rollout.max_episode_tokens=96",
        "rollout.partial=true",
        "rollout.weight_sync=eager",
        "train.max_staleness=2",
        "train.steps=6",
    )
    result = run(
        cfg,
        adapters={"train": CheckingTrain},
        factories=EngineFactories(trainer=prompt_checking_trainer),
    )
    for rep in result.reports:
        assert max(rep.staleness) <= 2
        for oldest, newest in zip(rep.sample_versions, rep.newest_versions, strict=True):
            assert 0 <= oldest <= newest <= rep.step
    assert all(r["versions_checked"] == 1.0 for r in result.records)
    assert sum(r["multi_version_episodes"] for r in result.records) > 0


def test_a_missing_extra_or_a_bad_agent_fails_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    from asyncflow.config import ConfigError
    from asyncflow.config.check import resolve_config

    with pytest.raises(ConfigError, match="not_there"):
        resolve_config(None, ["rollout.agent=tests.asyncflow.agent_programs:not_there"])
    with pytest.raises(ValueError, match="both"):
        resolve_config(None, [*AGENT, "env.name=tool_use"])
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # what an absent package does
    with pytest.raises(ConfigError, match=r"pip install 'asyncflow\[agents\]'"):
        resolve_config(None, AGENT)


def test_the_endpoint_is_bounded_by_the_policys_context(tmp_path: Path) -> None:
    """The run's endpoint refuses what the policy cannot read: its limit is the model's
    ``max_position_embeddings`` (the tiny model's 512), or vLLM's ``max_model_len``."""
    from asyncflow.build import build_episodes, build_tokenizer, policy_context
    from asyncflow.config import load_config
    from engines.agents import AgentRunner
    from engines.tiny import build_tiny

    path = build_tiny(cache_dir=tmp_path)
    runner = build_episodes(load_config(overrides=AGENT), build_tokenizer(path))
    assert isinstance(runner, AgentRunner)
    assert runner.server.context_tokens == 512
    vllm = load_config(overrides=["rollout.engine=vllm"])
    assert policy_context(vllm, path) == 512  # its default max_model_len: the model's context
    short = load_config(
        overrides=["rollout.engine=vllm", "rollout.engine_options={max_model_len: 256}"]
    )
    assert policy_context(short, path) == 256
