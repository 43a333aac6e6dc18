"""Engines that fail on purpose, for the workflow's error tests.

They live in an importable module (not a test module) so that Ray actors can build them from
:class:`asyncflow.EngineFactories` of these module-level functions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncflow import RunConfig
from asyncflow.build import build_generator
from engines.protocols import Generation, GenerationEngine, RewardFn, SamplingParams


def _raising_reward(*args: Any, **kwargs: Any) -> list[float | None]:
    raise ValueError("reward model exploded")


def raising_reward_factory(cfg: RunConfig) -> RewardFn:
    return _raising_reward


class DyingEngine:
    """A generation engine that fails on its third call."""

    def __init__(self, inner: GenerationEngine) -> None:
        self.inner = inner
        self.calls = 0

    @property
    def version(self) -> int:
        return int(self.inner.version)

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("generator lost its device")
        return list(await self.inner.generate(prompts, params))

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await self.inner.update_weights(state, version)


class BadWeights(DyingEngine):
    """A generation engine whose weight updates fail."""

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        return list(await self.inner.generate(prompts, params))

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("weights do not fit the model")


class NeverUpdates(DyingEngine):
    """A generation engine whose weight updates never finish (its version stays put)."""

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        return list(await self.inner.generate(prompts, params))

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        await asyncio.Event().wait()  # until the run ends and cancels the follower


class StallsOnce(DyingEngine):
    """A generation engine whose third call takes :attr:`stall_s` longer (an engine call stuck
    for a while: a swapping host, a slow collective), then goes on as usual."""

    stall_s = 4.0

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        if self.calls == 3:
            await asyncio.sleep(self.stall_s)
        return list(await self.inner.generate(prompts, params))


class SlowGenerate(DyingEngine):
    """A generation engine whose every call takes :attr:`delay_s` longer: the rollout holds a
    lease on its prompts most of the time (a fault test that freezes it then finds it
    holding rows)."""

    delay_s = 0.5

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        await asyncio.sleep(self.delay_s)
        return list(await self.inner.generate(prompts, params))


def slow_generator(cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    """Every instance's calls take :attr:`SlowGenerate.delay_s` longer."""
    return SlowGenerate(build_generator(cfg, path, index))  # type: ignore[return-value]


class NeverReturns(DyingEngine):
    """A generation engine whose third call never returns (a deadlocked engine thread, a
    collective that never completes)."""

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        if self.calls == 3:
            await asyncio.Event().wait()  # (until the run ends and cancels the call)
        return list(await self.inner.generate(prompts, params))


class _StallsOnceInRun(StallsOnce):
    """:class:`StallsOnce` whose stall happens once per run, not once per incarnation (a
    restarted host builds its engine again): the first to stall leaves ``marker``."""

    stall_s = 30.0

    def __init__(self, inner: GenerationEngine, marker: Path) -> None:
        super().__init__(inner)
        self.marker = marker

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        if self.calls == 3 and not self.marker.exists():
            self.marker.touch()
            await asyncio.sleep(self.stall_s)
        return list(await self.inner.generate(prompts, params))


def stalling_generator_once(cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    """Instance 0's third call hangs for 30 s, once in the run (a marker in ``output.dir``)."""
    engine = build_generator(cfg, path, index)
    if index != 0:
        return engine
    marker = Path(cfg.output.dir) / "generator-stalled"
    return _StallsOnceInRun(engine, marker)  # type: ignore[return-value]


def lagging_second_generator(cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    """Instance 1 never takes new weights; instance 0 is a plain generator."""
    engine = build_generator(cfg, path, index)
    return NeverUpdates(engine) if index == 1 else engine  # type: ignore[return-value]


def wrapped_generator(wrapper: type, cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    return wrapper(build_generator(cfg, path, index))  # type: ignore[no-any-return]


class SlowReward:
    """The math reward, taking at least ``delay_s`` per batch (a reward model's latency), so
    that a run lasts long enough for a killed host to be restarted while it goes on."""

    def __init__(self, delay_s: float) -> None:
        from engines.rewards import make_reward

        self.delay_s = delay_s
        self.inner = make_reward("math")

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        import time

        time.sleep(self.delay_s)
        return list(self.inner(prompts, completions, **columns))


def slow_reward_factory(cfg: RunConfig, delay_s: float = 0.4) -> RewardFn:
    return SlowReward(delay_s)


HANG_REWARD = "hang-reward"
"""Marker file in ``output.dir``: :class:`HangingReward`'s worker hangs on its next batch, and
writes ``HUNG_REWARD`` there when it does."""
HUNG_REWARD = "reward-hung"


class HangingReward(SlowReward):
    """:class:`SlowReward` that, in the reward worker whose Ray actor name ends with
    ``-reward-<index>``, sleeps ``hang_s`` in a batch once :data:`HANG_REWARD` exists (a batch
    its worker cannot finish within ``deploy.drain_grace_s``)."""

    def __init__(self, cfg: RunConfig, index: int, delay_s: float = 0.4, hang_s: float = 120.0):
        import ray

        super().__init__(delay_s)
        self.out = Path(cfg.output.dir)
        self.hang_s = hang_s
        name = ray.get_runtime_context().get_actor_name() or ""
        self.hangs = name.endswith(f"-reward-{index}")

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Any
    ) -> list[float | None]:
        import time

        if self.hangs and (self.out / HANG_REWARD).exists():
            (self.out / HUNG_REWARD).touch()
            time.sleep(self.hang_s)
        return super().__call__(prompts, completions, **columns)


def second_worker_hanging_reward_factory(cfg: RunConfig) -> RewardFn:
    """:class:`HangingReward` hanging in reward worker 1 (the first one a scale-up adds)."""
    return HangingReward(cfg, 1)


def train_leased(controller_stats: Mapping[str, Any]) -> int:
    """Rows the ``train`` task holds leased now, over every partition (from the controller's
    ``stats``). A unit killed while this is 0 takes only rows the train stage has not read:
    each is in the train task's loss log, so its group must be regenerated (a row the
    stage had read and then acknowledged is consumed, lost or not)."""
    parts = controller_stats["partitions"].values()
    return sum(int(p["tasks"]["train"]["leased"]) for p in parts if "train" in p["tasks"])


def _kill_myself() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def rank1_dying_trainer_factory(where: str) -> Any:
    """A trainer factory whose rank 1 SIGKILLs its own process once, at version 3: in its
    second ``forward_backward`` of that step (``where="forward_backward"``: rank 0 then has
    two parts of the step to have trained again) or in its ``optimizer_step``, after the
    gradient all-reduce (``where="optimizer_step"``: rank 0 steps, its replacement takes the
    stepped state). A marker file in ``output.dir`` keeps the replacement alive."""
    return _DYING[where]


def rank0_dying_trainer_factory(where: str) -> Any:
    """:func:`rank1_dying_trainer_factory` for trainer rank 0: in its second
    ``forward_backward`` of step 3 (rank 1 has not stepped: the step is trained again from its
    rows) or in its ``optimizer_step`` after the all-reduce (rank 1 steps: the replacement
    takes the stepped state and the step's rows are reported, not trained again)."""
    return _DYING_RANK0[where]


def _dying(where: str, cfg: RunConfig, path: Path, rank: int, target: int = 1) -> Any:
    from asyncflow.build import build_trainer

    engine = build_trainer(cfg, path, rank)
    marker = Path(cfg.output.dir) / f"rank{rank}-killed"
    if rank != target or marker.exists():
        return engine
    real = getattr(engine, where)
    calls: dict[int, int] = {}

    def dying(*args: Any, **kwargs: Any) -> Any:
        version = int(engine.version)
        calls[version] = calls.get(version, 0) + 1
        due = 2 if where == "forward_backward" else 1
        if version == 3 and calls[version] == due:
            marker.touch()
            _kill_myself()
        return real(*args, **kwargs)

    setattr(engine, where, dying)
    return engine


def _dying_in_forward_backward(cfg: RunConfig, path: Path, rank: int) -> Any:
    return _dying("forward_backward", cfg, path, rank)


def _dying_in_optimizer_step(cfg: RunConfig, path: Path, rank: int) -> Any:
    return _dying("optimizer_step", cfg, path, rank)


_DYING = {
    "forward_backward": _dying_in_forward_backward,
    "optimizer_step": _dying_in_optimizer_step,
}


def _rank0_dying_in_forward_backward(cfg: RunConfig, path: Path, rank: int) -> Any:
    return _dying("forward_backward", cfg, path, rank, target=0)


def _rank0_dying_in_optimizer_step(cfg: RunConfig, path: Path, rank: int) -> Any:
    return _dying("optimizer_step", cfg, path, rank, target=0)


_DYING_RANK0 = {
    "forward_backward": _rank0_dying_in_forward_backward,
    "optimizer_step": _rank0_dying_in_optimizer_step,
}
