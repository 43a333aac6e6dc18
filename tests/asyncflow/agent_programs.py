"""Agents for the workflow tests, written as anyone writes one against the ``openai`` client.

(Not named ``agents``: the tests' folder is on ``sys.path``, and a module ``agents`` there would
hide the ``agents`` package of openai-agents, which verifiers imports.)

They live in an importable module (not a test module) so that the rollout, wherever it runs,
imports them by path (``rollout.agent=tests.asyncflow.agent_programs:check_twice``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from transformers import AutoTokenizer

from asyncflow import RunConfig
from engines.protocols import TrainBatch
from tests.asyncflow.episodes import MaskCheckingTrainer, mask_checking_trainer

PREFIX = "Question: "
"""The agent's own wording of the row's prompt (the train stage must see it)."""


async def check_twice(row: dict[str, Any], client: AsyncOpenAI) -> float:
    """Ask, have the model check its answer once, reward 1 if the last answer has the number."""
    messages: list[Any] = [{"role": "user", "content": f"{PREFIX}{row['prompt']}"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message, {"role": "user", "content": "Are you sure?"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return float(str(row["answer"]) in (reply.choices[0].message.content or ""))


class PromptCheckingTrainer(MaskCheckingTrainer):
    """The run's trainer, checking every batch's loss masks (:class:`MaskCheckingTrainer`) and
    that every prompt it trains on is the agent's own (its first call's), not the row's."""

    def __init__(self, inner: Any, path: Path) -> None:
        super().__init__(inner)
        self.tokenizer = AutoTokenizer.from_pretrained(path)

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        for p in batch.prompt_ids:
            text = self.tokenizer.decode(p.tolist())
            if PREFIX not in text:
                raise AssertionError(f"the train stage got the row's prompt: {text!r}")
        return super().forward_backward(batch, loss_scale)


def prompt_checking_trainer(cfg: RunConfig, path: Path, rank: int = 0) -> MaskCheckingTrainer:
    return PromptCheckingTrainer(mask_checking_trainer(cfg, path, rank).inner, path)
