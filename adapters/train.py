"""``TrainAdapter``: whole GRPO groups in, optimizer steps out.

| consumes                                                  | produces                  |
|-----------------------------------------------------------|---------------------------|
| prompt_ids, response_ids, behaviour_logprobs, reward      | nothing (acks the rows);  |
| (+ ref_logprobs with a reference stage)                   | a step report per step    |

Step ``t`` trains on exactly the groups admitted for it: group ids ``t*B .. (t+1)*B - 1``
(``B = groups_per_step``; the prompt feeder numbers groups in admission order). It takes them
with the ``group`` sampler ordered by group id and ``max_group`` set to the end of the step's
window, a micro-batch of whole groups at a time, in whatever order they complete, and calls
``forward_backward`` on each as it arrives (streaming: training starts before the last group
of the step is generated). After the last group of the step, ``optimizer_step``.

Advantages are group-normalized rewards: ``(r - mean(group)) / (std(group) + eps)``. A sample
whose reward is NaN (the reward function gave no verdict) gets advantage 0 and is left out of
its group's statistics.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from adapters.base import Adapter, StageOutput
from engines.protocols import TrainBatch, TrainingEngine
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column

__all__ = ["StepReport", "TrainAdapter", "group_advantages", "make_train_batch"]


def group_advantages(
    rewards: torch.Tensor, groups: np.ndarray, *, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: rewards normalized within each group; NaN rewards give 0."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in np.unique(groups).tolist():
        idx = torch.from_numpy(np.flatnonzero(groups == g))
        r = rewards[idx].float()
        ok = ~r.isnan()
        if int(ok.sum()) < 2:
            continue
        mean = r[ok].mean()
        std = r[ok].std(unbiased=False)
        vals = torch.where(ok, (r - mean) / (std + eps), torch.zeros_like(r))
        adv[idx] = vals
    return adv


def make_train_batch(
    meta: BatchMeta, cols: dict[str, Column], advantages: torch.Tensor, use_reference: bool
) -> TrainBatch:
    """The engine's view of a micro-batch read from TransferQueue (advantages computed by the
    caller, over whole groups)."""
    prompts, responses = cols["prompt_ids"], cols["response_ids"]
    blp = cols["behaviour_logprobs"]
    if not (
        isinstance(prompts, Ragged) and isinstance(responses, Ragged) and isinstance(blp, Ragged)
    ):
        raise TypeError("train needs ragged prompt_ids, response_ids and behaviour_logprobs")
    ref = None
    if use_reference:
        ref_col = cols["ref_logprobs"]
        if not isinstance(ref_col, Ragged):
            raise TypeError("train needs a ragged ref_logprobs column with a reference stage")
        ref = ref_col.unbind()
    return TrainBatch(
        prompt_ids=[p.long() for p in prompts.unbind()],
        response_ids=[r.long() for r in responses.unbind()],
        behaviour_logprobs=blp.unbind(),
        advantages=advantages,
        versions=torch.from_numpy(meta.versions.copy()),
        ref_logprobs=ref,
    )


@dataclass
class StepReport:
    """One optimizer step: what was trained and how."""

    step: int  # 0-based index of the step just taken
    version: int  # policy version after the step (= step + 1 on a fresh run)
    samples: int
    tokens: int
    reward_mean: float
    reward_std: float
    staleness: list[int]  # per trained sample: step - generating version
    sample_versions: list[int]
    groups: list[int]
    metrics: dict[str, float] = field(default_factory=dict)


class TrainAdapter(Adapter):
    """Training engine as the train stage (see the module docstring)."""

    task = "train"
    sampler = "group"

    def __init__(
        self,
        engine: TrainingEngine,
        *,
        group_size: int,
        groups_per_step: int,
        micro_batch_groups: int = 1,
        use_reference: bool = False,
        on_step: Callable[[StepReport], Awaitable[None]] | None = None,
        first_step: int = 0,
    ) -> None:
        if group_size < 1 or groups_per_step < 1 or micro_batch_groups < 1:
            raise ValueError(
                "group_size, groups_per_step and micro_batch_groups must be >= 1, got "
                f"{group_size}, {groups_per_step}, {micro_batch_groups}"
            )
        self.engine = engine
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.micro_batch_groups = min(micro_batch_groups, groups_per_step)
        self.use_reference = use_reference
        self.on_step = on_step
        fields = ["prompt_ids", "response_ids", "behaviour_logprobs", "reward"]
        if use_reference:
            fields.append("ref_logprobs")
        self.input_fields = tuple(fields)
        self.sampler_options = {"group_size": group_size, "order": "group"}
        self.batch_size = self.micro_batch_groups * group_size
        self.step = first_step
        self._groups_done = 0
        self._acc: dict[str, list[Any]] = self._new_acc()
        self._report: StepReport | None = None  # a finished step, reported after its batch

    @staticmethod
    def _new_acc() -> dict[str, list[Any]]:
        return {"rewards": [], "versions": [], "groups": [], "tokens": [], "metrics": []}

    def request(self) -> dict[str, Any]:
        left = self.groups_per_step - self._groups_done
        return {
            "batch_size": min(self.micro_batch_groups, left) * self.group_size,
            "max_group": (self.step + 1) * self.groups_per_step - 1,
        }

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        reward = cols["reward"]
        if not isinstance(reward, torch.Tensor):
            raise TypeError(f"train needs a dense reward column, got {type(reward).__name__}")
        window = range(self.step * self.groups_per_step, (self.step + 1) * self.groups_per_step)
        if not all(int(g) in window for g in meta.groups):
            raise RuntimeError(
                f"step {self.step} got groups {sorted(set(meta.groups.tolist()))} outside its "
                f"window {window.start}..{window.stop - 1}; group ids must be admission indexes"
            )
        advantages = group_advantages(reward, meta.groups)
        scale = 1.0 / (self.groups_per_step * self.group_size)
        metrics, tokens = await self.train_batch(meta, cols, advantages, scale)
        acc = self._acc
        acc["rewards"].append(reward)
        acc["versions"] += meta.versions.tolist()
        acc["groups"] += meta.groups.tolist()
        acc["tokens"].append(tokens)
        acc["metrics"].append((len(meta), metrics))
        self._groups_done += len(meta) // self.group_size
        if self._groups_done >= self.groups_per_step:
            await self._finish_step()
        return StageOutput(tokens=tokens)

    async def train_batch(
        self,
        meta: BatchMeta,
        cols: dict[str, Column],
        advantages: torch.Tensor,
        loss_scale: float,
    ) -> tuple[dict[str, float], int]:
        """Accumulate the gradients of one micro-batch; returns the engine's metrics and the
        response tokens trained. Override to train elsewhere (data-parallel ranks)."""
        batch = make_train_batch(meta, cols, advantages, self.use_reference)
        metrics = await asyncio.to_thread(self.engine.forward_backward, batch, loss_scale)
        return metrics, batch.num_tokens

    async def optimizer_step(self) -> dict[str, float]:
        """Step the optimizer once the step's micro-batches are in (override with
        :meth:`train_batch`)."""
        return await asyncio.to_thread(self.engine.optimizer_step)

    async def _finish_step(self) -> None:
        step_metrics = await self.optimizer_step()
        acc = self._acc
        rewards = torch.cat(acc["rewards"]).float()
        valid = rewards[~rewards.isnan()]
        merged: dict[str, float] = {}
        total = sum(n for n, _ in acc["metrics"])
        for n, m in acc["metrics"]:
            for k, v in m.items():
                merged[k] = merged.get(k, 0.0) + float(v) * n / total
        merged.update({k: float(v) for k, v in step_metrics.items()})
        report = StepReport(
            step=self.step,
            version=self.engine.version,
            samples=len(acc["versions"]),
            tokens=int(sum(acc["tokens"])),
            reward_mean=float(valid.mean()) if valid.numel() else math.nan,
            reward_std=float(valid.std(unbiased=False)) if valid.numel() else math.nan,
            staleness=[self.step - v for v in acc["versions"]],
            sample_versions=list(acc["versions"]),
            groups=sorted(set(acc["groups"])),
            metrics=merged,
        )
        self.step += 1
        self._groups_done = 0
        self._acc = self._new_acc()
        self._report = report

    async def after_batch(self) -> None:
        """Report the step the last batch finished (its time now in the stage timeline)."""
        report, self._report = self._report, None
        if report is not None and self.on_step is not None:
            await self.on_step(report)
