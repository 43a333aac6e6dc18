"""Validation on held-out prompts, through the rollout's own generation engines.

Every ``eval.every_steps`` steps (and after the last one) the driver puts the held-out
prompts, ``eval.n`` rows each, into TransferQueue's ``val`` partition, each row bound to the
policy version just published (``min_gen_version``); the ``eval`` stage (a rollout adapter
over the same generation instances, with the evaluation's sampling parameters: greedy by
default) generates them, the ``eval/reward`` stage scores them with the run's reward
function, and the driver reads the rewards back (consumer task ``eval``) and records

| key                | what                                                            |
|--------------------|-----------------------------------------------------------------|
| ``eval/reward``    | mean reward of the samples (no-verdict samples left out)        |
| ``eval/pass@1``,   | n > 1: the unbiased pass@k estimate (Chen et al. 2021) over the |
| ``eval/pass@n``    | prompts; a sample passes when its reward >= ``pass_threshold``  |
| ``eval/version``   | the oldest weights version that generated a sample (>= the step's)|
| ``eval/samples``, ``eval/seconds`` | rows scored, and the time from put to the last reward |

in that step's record (:class:`Evaluator`; the record is written once its evaluation is in).

**Why this cannot deadlock with admission control, nor stall training.** Evaluation rows live
in their own partition: the train stage never sees them, the feeder's bound counts only the
groups it admitted to ``train``, so they take no place in the staleness window. They need a
generator holding the version being evaluated, which is already published, so some generator
takes it (``eager``: at once; ``on_demand``: the waiting ``eval`` batch demands it, as a
waiting training batch would). The ``eval`` stage has one worker per instance: a generator
busy with training batches serves an evaluation batch after the ones already queued on it,
and training batches queue behind at most one evaluation batch. Nothing in training waits
for an evaluation: only the writing of that step's record (and a checkpoint due at that step)
does, so the run's end waits for the last evaluation, bounded by ``eval.timeout_s``.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncflow.config import RunConfig
from asyncflow.graph import EVAL_PARTITION
from engines.hf.text import encode_prompts
from engines.tasks import Task, make_task
from transferqueue import AsyncClient
from transferqueue.aio import within

__all__ = ["Evaluator", "eval_prompt_count", "make_eval_task", "pass_at_k"]

GENERATED_PROMPTS = 64
"""Held-out prompts of an endless (generated) task when ``eval.prompts`` is not given."""


def make_eval_task(cfg: RunConfig) -> Task:
    """The held-out task of ``cfg.eval`` (the training task's name and options by default,
    seeded with ``eval.seed``)."""
    name, options = cfg.eval.task_spec(cfg.task.name, cfg.task.options)
    return make_task(name, seed=cfg.eval.seed, **options)


def eval_prompt_count(cfg: RunConfig, task: Task) -> int:
    """Held-out prompts per evaluation: ``eval.prompts``, else every row of a file task, the
    items of a finite task, or :data:`GENERATED_PROMPTS`."""
    if cfg.eval.prompts is not None:
        return cfg.eval.prompts
    rows = getattr(task, "num_rows", None)
    if isinstance(rows, int):
        return rows
    return task.num_items() or GENERATED_PROMPTS


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``correct`` passed."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod((n - correct - i) / (n - i) for i in range(k))


@dataclass
class _Round:
    version: int
    started: float
    rewards: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: asyncio.Future[dict[str, float]] | None = None


class Evaluator:
    """The driver's side of validation: puts held-out rows, collects their rewards.

    The workflow calls :meth:`due` and :meth:`start` when a step report arrives, runs
    :meth:`collect` as a supervised job, and awaits :meth:`result` before writing the step's
    record. Round ``r`` uses group ids ``r * P .. r * P + P - 1`` (``P`` prompts).
    """

    def __init__(self, cfg: RunConfig, client: AsyncClient, tokenizer: Any) -> None:
        self.cfg = cfg
        self.client = client
        self.tokenizer = tokenizer
        self.task = make_eval_task(cfg)
        self.prompts = eval_prompt_count(cfg, self.task)
        self.n = cfg.eval.n
        self._items = [self.task.item(i) for i in range(self.prompts)]
        self._encoded: list[torch.Tensor] | None = None
        self._rounds: dict[int, _Round] = {}
        self._next = 0

    def due(self, steps_done: int) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and (steps_done % every == 0 or steps_done == self.cfg.train.steps)

    async def start(self, version: int) -> asyncio.Future[dict[str, float]]:
        """Put one round of held-out rows, each to be generated by weights of at least
        ``version``; the future gets the round's metrics."""
        if self._encoded is None:
            prompts = [it.prompt for it in self._items]
            encoded = await asyncio.to_thread(encode_prompts, self.tokenizer, prompts)
            self._encoded = [p.to(torch.int32) for p in encoded]
        r, n, p = self._next, self.n, self.prompts
        self._next += 1
        done: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        self._rounds[r] = _Round(version, time.perf_counter(), done=done)
        rows: dict[str, list[Any]] = {}
        for item in self._items:
            for k, v in item.row().items():
                rows.setdefault(k, []).extend([v] * n)
        ids = [t for t in self._encoded for _ in range(n)]
        groups = np.repeat(np.arange(r * p, (r + 1) * p, dtype=np.int64), n)
        lengths = np.repeat(np.array([int(t.numel()) for t in self._encoded]), n)
        await self.client.put(
            {
                "prompt_ids": ids,
                "min_gen_version": torch.full((p * n,), version, dtype=torch.int64),
                **rows,
            },
            group=groups,
            version=-1,
            length=lengths,
            partition=EVAL_PARTITION,
        )
        return done

    async def result(self, done: asyncio.Future[dict[str, float]], step: int) -> dict[str, float]:
        """A round's metrics, or ``TimeoutError`` naming the step after ``eval.timeout_s``."""
        timeout = self.cfg.eval.timeout_s
        try:
            return await within(asyncio.shield(done), timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the evaluation after step {step} did not finish within eval.timeout_s="
                f"{timeout}; raise it, or evaluate fewer prompts (eval.prompts)"
            ) from None

    async def collect(self) -> None:
        """Read scored held-out rows until cancelled; completes each round's future."""
        batch = max(self.prompts * self.n, 1)
        lease_s = self.cfg.transferqueue.lease_s
        while True:
            meta = await self.client.get_meta(
                "eval",
                ["reward"],
                batch_size=batch,
                partition=EVAL_PARTITION,
                timeout_s=1.0,
                lease_s=lease_s,
            )
            if not len(meta):
                continue
            cols = await self.client.get_data(meta, ["reward"])
            await self.client.ack(meta)
            reward = cols["reward"]
            assert isinstance(reward, torch.Tensor)
            for g, v, x in zip(
                meta.groups.tolist(), meta.versions.tolist(), reward.tolist(), strict=True
            ):
                rnd = self._rounds[g // self.prompts]
                rnd.groups.append(g)
                rnd.versions.append(v)
                rnd.rewards.append(float(x))
            for r, rnd in list(self._rounds.items()):
                if len(rnd.rewards) == self.prompts * self.n and rnd.done is not None:
                    rnd.done.set_result(self._metrics(rnd))
                    del self._rounds[r]

    def _metrics(self, rnd: _Round) -> dict[str, float]:
        rewards = np.array(rnd.rewards, dtype=np.float64)
        finite = rewards[np.isfinite(rewards)]
        out = {
            "reward": float(finite.mean()) if finite.size else math.nan,
            "version": float(min(rnd.versions)),
            "samples": float(len(rewards)),
            "seconds": time.perf_counter() - rnd.started,
        }
        if self.n > 1:
            passed = np.nan_to_num(rewards, nan=-math.inf) >= self.cfg.eval.pass_threshold
            per_group: dict[int, int] = {}
            for g, ok in zip(rnd.groups, passed.tolist(), strict=True):
                per_group[g] = per_group.get(g, 0) + int(ok)
            for k in sorted({1, self.n}):
                estimates = [pass_at_k(self.n, c, k) for c in per_group.values()]
                out[f"pass@{k}"] = float(np.mean(estimates))
        return out
