"""The stages of the GRPO graph, built from a config the same way in every deployment.

    rollout:   prompt_ids, min_gen_version (+ the task's columns, with an environment)
                 -> an episode per row: response_ids, behaviour_logprobs, loss_mask,
                    token_versions, turns, rewards, end_reason (adapters.episodes)
    reward:    prompt, response_ids, answer (+ the task's extra columns, + episode_reward
                 with an environment) -> reward
    reference: prompt_ids, response_ids -> ref_logprobs              (optional)
    train:     whole groups of the step's window -> an optimizer step (acks the rows)

A stage is an adapter (``adapters``) driven by a :class:`~asyncflow.stage_runner.StageRunner`,
the loop that leases its rows and writes its output (:func:`runner` builds one). A deployment
(``asyncflow.deploy``) decides where each stage runs and what it talks to; these functions
decide what each stage *is*, so that ``deploy=local`` and ``deploy=ray`` run the same adapters
with the same options.

Validation (``eval.every_steps``) runs two more stages on their own partition, ``val``, over
the same generation instances and the same reward function: ``eval`` (a rollout adapter with
the evaluation's sampling parameters) and ``eval/reward``; the driver consumes their rows
(``asyncflow.evaluation``). Rows of ``val`` are never seen by the train stage and never
counted by admission control (see ``asyncflow.evaluation`` for why this cannot deadlock).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from adapters import (
    Adapter,
    FusedAdapter,
    LengthAwareRouter,
    LengthRanker,
    ReferenceAdapter,
    RewardAdapter,
    RolloutAdapter,
    StepReport,
    TrainAdapter,
)
from adapters.rollout import GenerationInstance
from asyncflow.build import build_episodes
from asyncflow.config import RunConfig
from asyncflow.metrics import Timeline
from asyncflow.stage_runner import StageRunner
from engines.protocols import RewardFn, SamplingParams, ScoringEngine, TrainingEngine
from engines.rewards import rollout_columns
from engines.tasks import task_columns
from transferqueue import AsyncClient

__all__ = [
    "ADAPTERS",
    "EVAL_PARTITION",
    "PARTITION",
    "adapter_classes",
    "colocated",
    "episode_options",
    "eval_reward_runner",
    "eval_rollout_adapter",
    "eval_rollout_runner",
    "eval_tasks",
    "reference_adapter",
    "reward_adapter",
    "rollout_adapter",
    "runner",
    "sampling_params",
    "tasks",
    "train_adapter",
]

PARTITION = "train"
EVAL_PARTITION = "val"

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
    """TransferQueue consumer tasks of the graph (rows are freed once all have acked); with
    ``reward.colocate`` the rollout stage writes the rewards, and no ``reward`` task reads."""
    reward = [] if cfg.reward.colocate else ["reward"]
    return ["rollout", *reward, *(["reference"] if cfg.reference.enabled else []), "train"]


def eval_tasks(cfg: RunConfig) -> list[str]:
    """Consumer tasks of the ``val`` partition (``eval``: the driver, reading the rewards)."""
    return ["rollout", "reward", "eval"]


def sampling_params(cfg: RunConfig) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
    )


def episode_options(cfg: RunConfig, tokenizer: Any, *, evaluation: bool = False) -> dict[str, Any]:
    """The rollout's episode arguments: none without an environment; with one, the episode
    runner and the row columns its ``reset`` reads (the task's prompt, answer and extras)."""
    runner = build_episodes(cfg, tokenizer)
    if runner is None:
        return {}
    name, options = cfg.task.name, cfg.task.options
    if evaluation:
        name, options = cfg.eval.task_spec(name, options)
    return {
        "episodes": runner,
        "row_columns": ("prompt", *task_columns(name, **options)),
        "turn_gather_s": cfg.rollout.turn_gather_s,
    }


def rollout_adapter(
    cls: type[Adapter],
    instances: Sequence[GenerationInstance],
    cfg: RunConfig,
    *,
    on_demand: Callable[[int], None] | None,
    on_done: Callable[[], None] | None = None,
    ranker: LengthRanker | None = None,
    tokenizer: Any = None,
    remote: bool = False,
) -> Adapter:
    """The rollout over every generation instance (engines here, or proxies of engine hosts:
    ``remote``). With an environment, every row is an episode of several turns: ``tokenizer``
    (the policy's) writes the observations between them. Remote instances that every publish
    updates (``rollout.weight_sync=eager``) take batches ahead of their weights
    (``RolloutAdapter``'s ``dispatch_ahead``)."""
    rc, n, b = cfg.rollout, cfg.rollout.group_size, cfg.train.groups_per_step
    router = (
        LengthAwareRouter(range(rc.long_instances), long_capacity=rc.long_capacity or 2 * n)
        if rc.long_instances
        else None
    )
    kwargs: dict[str, Any] = {
        # never more than a step's groups: at max_staleness=0 no more are admitted, and a
        # batch waiting for rows that cannot come would wait out the stage's poll each time
        "batch_size": min(rc.micro_batch_groups, b) * n,
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
        **episode_options(cfg, tokenizer),
    }
    if remote and rc.weight_sync == "eager":
        kwargs["dispatch_ahead"] = True
    return cls(list(instances), sampling_params(cfg), **kwargs)  # type: ignore[call-arg]


def eval_rollout_adapter(
    cls: type[Adapter],
    instances: Sequence[GenerationInstance],
    cfg: RunConfig,
    *,
    on_demand: Callable[[int], None] | None,
    on_done: Callable[[], None] | None = None,
    tokenizer: Any = None,
) -> Adapter:
    """The rollout of held-out prompts: the same instances, the evaluation's sampling
    parameters, each row given to an instance holding at least the version it evaluates (an
    episode with the run's environment, when it has one)."""
    ev, rc = cfg.eval, cfg.rollout
    params = SamplingParams(
        max_new_tokens=ev.max_new_tokens or rc.max_new_tokens,
        temperature=ev.temperature,
        top_p=ev.top_p,
    )
    return cls(  # type: ignore[call-arg]
        list(instances),
        params,
        batch_size=ev.batch_size,
        on_demand=on_demand,
        on_done=on_done,
        version_field="min_gen_version",
        **episode_options(cfg, tokenizer, evaluation=True),
    )


def reward_adapter(
    cls: type[Adapter],
    reward_fn: RewardFn,
    tokenizer: Any,
    cfg: RunConfig,
    *,
    evaluation: bool = False,
) -> Adapter:
    """The reward stage (``evaluation``: of the held-out task's rows, with its columns)."""
    name, options = cfg.task.name, cfg.task.options
    if evaluation:
        name, options = cfg.eval.task_spec(name, options)
    columns = task_columns(name, **options)  # the row's answer and extras
    if cfg.episodic():
        columns = (*columns, "episode_reward")  # what the ``episode`` reward reads
    # the rollout's columns the reward reads too (reasoning_gym: finish_reason)
    columns = (*columns, *(c for c in rollout_columns(reward_fn) if c not in columns))
    return cls(  # type: ignore[call-arg]
        reward_fn, tokenizer, columns=columns, batch_size=min(cfg.reward.batch_size, step_rows(cfg))
    )


def colocated(
    rollout: Adapter,
    cfg: RunConfig,
    reward_cls: type[Adapter],
    reward_fn: RewardFn,
    tokenizer: Any,
) -> Adapter:
    """What the rollout stage runs: with ``reward.colocate``, the rollout then the reward on
    each batch (:class:`~adapters.FusedAdapter`); else the rollout alone."""
    if not cfg.reward.colocate:
        return rollout
    return FusedAdapter(rollout, reward_adapter(reward_cls, reward_fn, tokenizer, cfg))


def reference_adapter(cls: type[Adapter], engine: ScoringEngine, cfg: RunConfig) -> Adapter:
    budget = cfg.reference.max_tokens_per_micro_batch
    if budget is None:
        budget = cfg.train.max_tokens_per_micro_batch
    return cls(  # type: ignore[call-arg]
        engine,
        batch_size=min(cfg.reference.batch_size, step_rows(cfg)),
        max_tokens_per_micro_batch=budget,
    )


def step_rows(cfg: RunConfig) -> int:
    """The rows of one training step (``train.groups_per_step * rollout.group_size``): the most
    a stage's batch should wait for (at ``max_staleness=0`` no more are admitted)."""
    return cfg.train.groups_per_step * cfg.rollout.group_size


def train_adapter(
    cls: type[Adapter],
    trainer: TrainingEngine,
    cfg: RunConfig,
    on_step: Callable[[StepReport], Awaitable[None]],
    *,
    on_filtered: Callable[[list[int]], Awaitable[None]],
    first_group: int | None = None,
    first_step: int | None = None,
    **extra: Any,
) -> Adapter:
    """The train stage from the trainer's version on (``first_group``: where a resumed run's
    window starts); ``on_filtered`` tells the registry the groups dynamic sampling filtered."""
    t = cfg.train
    return cls(  # type: ignore[call-arg]
        trainer,
        group_size=cfg.rollout.group_size,
        groups_per_step=t.groups_per_step,
        micro_batch_groups=t.micro_batch_groups,
        use_reference=cfg.reference.enabled,
        on_step=on_step,
        first_step=trainer.version if first_step is None else first_step,
        first_group=first_group,
        dynamic_sampling=t.dynamic_sampling,
        on_filtered=on_filtered,
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
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
    partition: str = PARTITION,
) -> StageRunner:
    return StageRunner(
        name,
        adapter,
        client,
        timeline,
        concurrency=concurrency,
        partition=partition,
        lease_s=cfg.transferqueue.lease_s,
    )


def eval_rollout_runner(
    cls: type[Adapter],
    instances: Sequence[GenerationInstance],
    client: AsyncClient,
    timeline: Timeline,
    cfg: RunConfig,
    *,
    on_demand: Callable[[int], None] | None,
    on_done: Callable[[], None] | None = None,
    tokenizer: Any = None,
) -> StageRunner:
    """The ``eval`` stage: held-out prompts of the ``val`` partition, one worker per instance
    (so an evaluation batch waits behind at most the training batches already on it)."""
    adapter = eval_rollout_adapter(
        cls, instances, cfg, on_demand=on_demand, on_done=on_done, tokenizer=tokenizer
    )
    return runner(
        "eval",
        adapter,
        client,
        timeline,
        cfg,
        concurrency=len(instances),
        partition=EVAL_PARTITION,
    )


def eval_reward_runner(
    cls: type[Adapter],
    reward_fn: RewardFn,
    tokenizer: Any,
    client: AsyncClient,
    timeline: Timeline,
    cfg: RunConfig,
) -> StageRunner:
    """The ``eval/reward`` stage: the run's reward function over the ``val`` partition."""
    adapter = reward_adapter(cls, reward_fn, tokenizer, cfg, evaluation=True)
    return runner("eval/reward", adapter, client, timeline, cfg, partition=EVAL_PARTITION)
