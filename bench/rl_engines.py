"""The simulated engines of one ``bench.rl`` schedule run, built the same way in either
deployment.

:class:`SimulatedRun` holds everything they are built from (picklable). ``deploy=local``
builds them in the driver (:func:`local_components`: one in-process sample store shared by the
generation instances); ``deploy=ray`` gives the workflow :func:`ray_factories`, module-level
functions bound to the spec with ``functools.partial``, which Ray pickles to each stage host
so that every generator, the trainer and the reward workers build their engine where they run,
from the same numbers, with the generators sharing one sample store actor
(:class:`~engines.simulated.RaySamples`). Same spec, same prompt stream: the same samples
(lengths, tokens, continuations of migrated samples) in both modes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncflow import Components
from asyncflow.build import EngineFactories
from asyncflow.config import RunConfig
from engines.simulated import (
    DecodeLatency,
    LengthModel,
    LocalSamples,
    RaySamples,
    SampleStore,
    SimulatedGenerationEngine,
    SimulatedReward,
    SimulatedTrainingEngine,
    TrainingCost,
)
from engines.tasks import Task, make_task
from engines.tiny import build_tokenizer

__all__ = ["SimulatedRun", "local_components", "ray_factories"]


@dataclass(frozen=True, kw_only=True)
class SimulatedRun:
    """The engines of one schedule on one split of the virtual GPUs."""

    latency: DecodeLatency
    """Iteration time of a (non-dedicated) generation instance."""
    lengths: LengthModel
    """Response lengths (moved onto the run's prompts)."""
    long_instances: int
    """The first ``long_instances`` generation instances are dedicated to the long tail."""
    long_max_batch: int
    """Sequences a dedicated long instance runs at once."""
    training: TrainingCost
    train_gpus: int
    time_scale: float
    sync_s: float
    vocab_size: int
    eos_token_id: int | None
    seed: int
    reward_s: float = 0.01
    """Modelled seconds per sample of the reward function."""
    success_rate: float = 0.5
    samples: RaySamples | None = None
    """The sample store the generators share across processes (``deploy=ray``)."""
    partial: bool = False
    """Interruptible generation: updates stop running sequences at a token boundary and they
    continue on the new weights (``rollout.partial``)."""


def generator(
    run: SimulatedRun,
    cfg: RunConfig | None,
    path: Path | None,
    index: int,
    samples: SampleStore | None = None,
) -> SimulatedGenerationEngine:
    """Generation instance ``index`` (the first ``long_instances`` run few sequences)."""
    cap = run.long_max_batch if index < run.long_instances else run.latency.max_batch
    return SimulatedGenerationEngine(
        replace(run.latency, max_batch=cap),
        run.lengths,
        time_scale=run.time_scale,
        sync_s=run.sync_s,
        vocab_size=run.vocab_size,
        eos_token_id=run.eos_token_id,
        seed=run.seed + index,
        version=0,
        samples=samples if samples is not None else run.samples,
        partial=run.partial,
    )


def trainer(
    run: SimulatedRun, cfg: RunConfig | None, path: Path | None, rank: int = 0
) -> SimulatedTrainingEngine:
    return SimulatedTrainingEngine(
        run.training, time_scale=run.time_scale, gpus=run.train_gpus, version=0
    )


def reward(run: SimulatedRun, cfg: RunConfig | None) -> SimulatedReward:
    return SimulatedReward(run.reward_s, time_scale=run.time_scale, success_rate=run.success_rate)


def task(run: SimulatedRun, cfg: RunConfig | None) -> Task:
    return make_task("countdown", seed=run.seed)


def no_model(cfg: RunConfig, task: Task) -> Path:
    """Simulated engines have no model folder; stage hosts get this placeholder."""
    return Path(".")


def tokenizer(path: Path) -> Any:
    """The tiny model's tokenizer (trained in well under a second, the same everywhere)."""
    return build_tokenizer()


def local_components(run: SimulatedRun, n_gen: int) -> Components:
    """Every engine in this process; the generators share one in-process sample store."""
    samples = LocalSamples()  # same samples whatever the routing
    generators = [generator(run, None, None, i, samples) for i in range(n_gen)]
    return Components(
        task=task(run, None),
        tokenizer=build_tokenizer(),
        trainer=trainer(run, None, None),
        generators=list(generators),
        reward_fn=reward(run, None),
        closers=[g.close for g in generators],
    )


def ray_factories(run: SimulatedRun) -> EngineFactories:
    """How each stage host builds its engine (``run.samples`` must be set: the store the
    generators share)."""
    if run.samples is None:
        raise ValueError("ray_factories needs SimulatedRun.samples (a RaySamples store)")
    return EngineFactories(
        task=functools.partial(task, run),
        model=no_model,
        tokenizer=tokenizer,
        trainer=functools.partial(trainer, run),
        generator=functools.partial(generator, run),
        reward=functools.partial(reward, run),
    )
