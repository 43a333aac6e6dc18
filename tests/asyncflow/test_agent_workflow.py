"""Agent episodes end to end: the workflow with ``rollout.agent`` on the tiny model.

An agent (:mod:`tests.asyncflow.agents`) calls the rollout's OpenAI-compatible endpoint with
the ``openai`` client; each of its calls is a turn of its episode. The invariants of the
environment seam hold the same (every group trained once and whole, the staleness bound on each
episode's oldest token, every token's version checked where it is trained by
:class:`tests.asyncflow.episodes.CheckingTrain`), and the train stage reads the agent's own
prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from asyncflow import EngineFactories, RunConfig, run
from engines.protocols import TrainBatch
from tests.asyncflow.agents import PREFIX
from tests.asyncflow.conftest import small_config
from tests.asyncflow.episodes import CheckingTrain, MaskCheckingTrainer, mask_checking_trainer


class PromptCheckingTrainer(MaskCheckingTrainer):
    """Also checks that every prompt it trains on is the agent's own (its first call's)."""

    def __init__(self, inner: Any, path: Path) -> None:
        super().__init__(inner)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        for p in batch.prompt_ids:
            text = self.tokenizer.decode(p.tolist())
            if PREFIX not in text:
                raise AssertionError(
                    f"the train stage got the row's prompt, not the agent's: {text!r}"
                )
        return super().forward_backward(batch, loss_scale)


def prompt_checking_trainer(cfg: RunConfig, path: Path, rank: int = 0) -> MaskCheckingTrainer:
    return PromptCheckingTrainer(mask_checking_trainer(cfg, path, rank).inner, path)


pytest.importorskip("openai")
pytest.importorskip("aiohttp")

AGENT = [
    "rollout.agent=tests.asyncflow.agents:check_twice",
    "rollout.max_turns=2",
    "rollout.max_new_tokens=3",
    "rollout.max_episode_tokens=48",
    "env.timeout_s=30",
]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_agent_episodes_keep_the_staleness_bound_and_every_token_version(
    out_dir: Path, k: int
) -> None:
    cfg = small_config(out_dir, *AGENT, f"train.max_staleness={k}", "train.steps=5")
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
