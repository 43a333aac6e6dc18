"""Environments and a train stage for the multi-turn workflow tests.

They live in an importable module (not a test module) so that Ray actors can build them from
their import paths (``env.name=tests.asyncflow.episodes:FlakyEnv``, ``adapters=``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from adapters import TrainAdapter
from asyncflow import RunConfig
from asyncflow.build import build_trainer
from engines.envs import EnvError, StepResult
from engines.envs.guess_number import GuessNumberEnv
from engines.protocols import TrainBatch, TrainingEngine
from transferqueue import BatchMeta, Ragged
from transferqueue.schema import Column


class FlakyEnv(GuessNumberEnv):
    """Guess the number on a flaky game server: the step of a secret that is 1 mod 4 always
    fails (the server is gone for it: its episodes end ``env_error`` and their group is
    dropped); every third environment this process builds fails once (a dropped session:
    retried, then played); the step of a secret that is 2 mod 4 is slow (async, 0.3 s: past
    the tests' ``env.episode_timeout_s``: those episodes end ``timeout``, the policy's)."""

    built = 0

    def __init__(self) -> None:
        super().__init__()
        FlakyEnv.built += 1
        self.transient = FlakyEnv.built % 3 == 0

    def reset(self, row: Mapping[str, Any]) -> None:
        super().reset(row)
        self.secret = int(row["answer"])

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        if self.secret % 4 == 1:
            raise ConnectionError("the game server went away")
        if self.transient:
            raise EnvError("the server closed the session")
        if self.secret % 4 == 2:
            await asyncio.sleep(0.3)
        return super().step(action)


class SlowEnv(GuessNumberEnv):
    """Guess the number with an environment that takes ``delay_s`` per step (async)."""

    def __init__(self, *, delay_s: float = 0.2) -> None:
        super().__init__()
        self.delay_s = delay_s

    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(self.delay_s)
        return super().step(action)


class CheckingTrain(TrainAdapter):
    """The built-in train stage, also reading every episode's per-token versions and checking,
    for each row it trains at step ``t`` with ``max_staleness = k`` (from the row's
    ``min_gen_version`` bound: ``t - k``):

    - ``token_versions`` is -1 exactly off the loss mask, and within ``[t - k, t]`` on it;
    - the row's header version is its oldest token's;
    - the mask covers one span per turn, starting at each ``turn_offsets`` entry.

    A violation raises (the run fails naming it). ``versions_checked`` (1.0) and
    ``multi_version_episodes`` (the share of episodes whose tokens carry several versions) go
    into each step's record.
    """

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        more = ("token_versions", "turn_offsets", "min_gen_version")
        self.input_fields = (*self.input_fields, *(f for f in more if f not in self.input_fields))

    async def train_batch(
        self, meta: BatchMeta, cols: dict[str, Column], advantages: torch.Tensor, loss_scale: float
    ) -> tuple[dict[str, float], int]:
        versions, mask, offsets = cols["token_versions"], cols["loss_mask"], cols["turn_offsets"]
        bound = cols["min_gen_version"]
        assert isinstance(versions, Ragged) and isinstance(mask, Ragged)
        assert isinstance(offsets, Ragged) and isinstance(bound, torch.Tensor)
        multi = 0
        rows = zip(
            meta.versions.tolist(),
            versions.unbind(),
            mask.unbind(),
            offsets.unbind(),
            bound.tolist(),
            strict=True,
        )
        for header, v, m, off, low in rows:
            m = m.bool()
            if not torch.equal(v[~m], torch.full_like(v[~m], -1)):
                raise AssertionError(f"tokens off the loss mask carry versions {v[~m].tolist()}")
            sampled = v[m]
            if sampled.numel() and int(sampled.min()) != header:
                raise AssertionError(f"header version {header} != oldest token {sampled.min()}")
            if sampled.numel() and not (
                low <= int(sampled.min()) and int(sampled.max()) <= self.step
            ):
                raise AssertionError(
                    f"step {self.step}: token versions {sorted(set(sampled.tolist()))} outside "
                    f"[{low}, {self.step}]"
                )
            starts = torch.nonzero(m & ~torch.cat([torch.zeros(1, dtype=torch.bool), m[:-1]]))
            if starts.flatten().tolist() != [o for o in off.tolist() if o < m.numel() and m[o]]:
                raise AssertionError(f"turn starts {starts.flatten().tolist()} != {off.tolist()}")
            multi += int(sampled.unique().numel() > 1)
        metrics, tokens = await super().train_batch(meta, cols, advantages, loss_scale)
        metrics = {**metrics, "versions_checked": 1.0, "multi_version_episodes": multi / len(meta)}
        return metrics, tokens


class MaskCheckingTrainer:
    """The run's training engine, checking that every batch it trains carries the episodes'
    loss masks (one per sample, the response's shape) and reporting the share of response
    tokens they cover (``loss_mask_frac``: below 1 where observations are in the sequence)."""

    def __init__(self, inner: TrainingEngine) -> None:
        self.inner = inner

    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def model(self) -> Any:
        return getattr(self.inner, "model", None)

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        if batch.loss_mask is None:
            raise AssertionError("a batch reached the trainer without its loss mask")
        for mask, resp in zip(batch.loss_mask, batch.response_ids, strict=True):
            if mask.shape != resp.shape or mask.dtype != torch.bool:
                raise AssertionError(f"loss mask {mask.shape} {mask.dtype} for {resp.shape}")
        covered = sum(int(m.sum()) for m in batch.loss_mask)
        total = sum(int(r.numel()) for r in batch.response_ids)
        metrics = self.inner.forward_backward(batch, loss_scale)
        return {**metrics, "loss_mask_frac": covered / max(total, 1)}

    def optimizer_step(self) -> dict[str, float]:
        return self.inner.optimizer_step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def save_policy(self, directory: str | os.PathLike[str]) -> None:
        saving: Any = self.inner  # the HF engine: a CheckpointableEngine too
        saving.save_policy(directory)


def mask_checking_trainer(cfg: RunConfig, path: Path, rank: int = 0) -> MaskCheckingTrainer:
    return MaskCheckingTrainer(build_trainer(cfg, path, rank))
