"""The stages of the GRPO graph, built from a config the same way in every deployment.

    rollout:   prompt_ids, min_gen_version -> response_ids, behaviour_logprobs, finish_reason
    reward:    prompt, response_ids, answer (+ the task's extra columns) -> reward
    reference: prompt_ids, response_ids -> ref_logprobs              (optional)
    train:     whole groups of the step's window -> an optimizer step (acks the rows)

A deployment (``asyncflow.deploy``) decides where each stage runs and what it talks to; these
functions decide what each stage *is*, so that ``deploy=local`` and ``deploy=ray`` run the same
adapters with the same options.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from adapters import (
    Adapter,
    LengthAwareRouter,
    LengthRanker,
    ReferenceAdapter,
    RewardAdapter,
    RolloutAdapter,
    StepReport,
    TrainAdapter,
)
from adapters.rollout import GenerationInstance
from asyncflow.config import RunConfig
from asyncflow.metrics import Timeline
from asyncflow.stage import StageRunner
from engines.protocols import RewardFn, SamplingParams, ScoringEngine, TrainingEngine
from engines.tasks import task_columns
from transferqueue import AsyncClient

__all__ = [
    "ADAPTERS",
    "PARTITION",
    "adapter_classes",
    "reference_adapter",
    "reward_adapter",
    "rollout_adapter",
    "runner",
    "sampling_params",
    "tasks",
    "train_adapter",
]

PARTITION = "train"

ADAPTERS: dict[str, type[Adapter]] = {
    "rollout": RolloutAdapter,
    "reward": RewardAdapter,
    "reference": ReferenceAdapter,
    "train": TrainAdapter,
}


def adapter_classes(overrides: dict[str, type[Adapter]] | None) -> dict[str, type[Adapter]]:
    """The adapter class per role, with a user's subclasses (same constructor arguments)."""
    unknown = set(overrides or {}) - set(ADAPTERS)
    if unknown:
        raise ValueError(
            f"unknown adapter roles {sorted(unknown)}; roles: rollout, reward, reference, train"
        )
    return {**ADAPTERS, **(overrides or {})}


def tasks(cfg: RunConfig) -> list[str]:
    """TransferQueue consumer tasks of the graph (rows are freed once all have acked)."""
    return ["rollout", "reward", *(["reference"] if cfg.reference.enabled else []), "train"]


def sampling_params(cfg: RunConfig) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
    )


def rollout_adapter(
    cls: type[Adapter],
    instances: Sequence[GenerationInstance],
    cfg: RunConfig,
    *,
    on_demand: Callable[[int], None] | None,
    on_done: Callable[[], None] | None = None,
    ranker: LengthRanker | None = None,
) -> Adapter:
    """The rollout over every generation instance (engines here, or proxies of engine hosts)."""
    rc, n, b = cfg.rollout, cfg.rollout.group_size, cfg.train.groups_per_step
    router = (
        LengthAwareRouter(range(rc.long_instances), long_capacity=rc.long_capacity or 2 * n)
        if rc.long_instances
        else None
    )
    kwargs: dict[str, Any] = {
        "batch_size": rc.micro_batch_groups * n,
        "router": router,
        "migrate_after": rc.migrate_after,
        "on_demand": on_demand,
        "on_done": on_done,
        "ranker": ranker,
        "sampler": "group" if rc.longest_first else "fifo",
        "sampler_options": (
            {"group_size": n, "order": "length", "window": b} if rc.longest_first else None
        ),
        "version_field": "min_gen_version",
    }
    return cls(list(instances), sampling_params(cfg), **kwargs)  # type: ignore[call-arg]


def reward_adapter(
    cls: type[Adapter], reward_fn: RewardFn, tokenizer: Any, cfg: RunConfig
) -> Adapter:
    columns = task_columns(cfg.task.name, **cfg.task.options)  # the row's answer and extras
    return cls(  # type: ignore[call-arg]
        reward_fn, tokenizer, columns=columns, batch_size=cfg.reward.batch_size
    )


def reference_adapter(cls: type[Adapter], engine: ScoringEngine, cfg: RunConfig) -> Adapter:
    return cls(engine, batch_size=cfg.reference.batch_size)  # type: ignore[call-arg]


def train_adapter(
    cls: type[Adapter],
    trainer: TrainingEngine,
    cfg: RunConfig,
    on_step: Callable[[StepReport], Awaitable[None]],
    **extra: Any,
) -> Adapter:
    return cls(  # type: ignore[call-arg]
        trainer,
        group_size=cfg.rollout.group_size,
        groups_per_step=cfg.train.groups_per_step,
        micro_batch_groups=cfg.train.micro_batch_groups,
        use_reference=cfg.reference.enabled,
        on_step=on_step,
        first_step=trainer.version,
        **extra,
    )


def runner(
    name: str,
    adapter: Adapter,
    client: AsyncClient,
    timeline: Timeline,
    cfg: RunConfig,
    *,
    concurrency: int = 1,
) -> StageRunner:
    return StageRunner(
        name,
        adapter,
        client,
        timeline,
        concurrency=concurrency,
        partition=PARTITION,
        lease_s=cfg.transferqueue.lease_s,
    )
