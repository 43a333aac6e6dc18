"""What trainer ranks do differently under ``train.strategy=fsdp`` (``deploy=ray``).

With ``ddp`` every rank holds the whole model, so rank 0 alone publishes weights, writes
checkpoints and saves the policy. With ``fsdp`` each rank holds a shard, and each of those is
a collective that every rank takes part in, driven by rank 0 (which runs the train stage)
through calls to the other ranks' actors:

| after a step         | rank 0                                  | ranks 1..                  |
|----------------------|-----------------------------------------|----------------------------|
| publish weights      | gathers bucket after bucket and hands   | gather the same buckets    |
|                      | each to the sender (``publish_stream``) | (:func:`take_part`)        |
| write a checkpoint   | ``write_trainer_part`` (its shards, the | ``engine.save``: their     |
|                      | gathered policy, trainer state, RNGs)   | shards                     |
| end of run           | ``save_policy`` (writes the folder)     | ``save_policy`` (gathers)  |

And each micro-batch: every rank makes as many ``forward_backward`` calls as the rank with
the most (a rank with fewer rows, or none, or fewer token-budget packs, makes empty calls),
because each call gathers parameters and reduce-scatters gradients with the others; the ranks
agree on the number first (:func:`calls_to_make`), before any call's collectives.

Resuming: the shards load into an already sharded model, so ranks restore *after* joining the
group (with ``ddp``, before). A checkpoint resumes with the ``dp_size`` that wrote it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.config import RunConfig
from asyncflow.transport import WeightSender, publish_stream
from engines.distributed import max_over_ranks
from engines.fsdp import FSDPConfig
from engines.protocols import ShardableEngine, TrainBatch, TrainingEngine

__all__ = ["Sharding", "calls_to_make", "empty_calls", "publish", "sharding", "take_part"]


@dataclass(frozen=True)
class Sharding:
    """A sharded trainer rank: its engine (as the role) and the sharding options."""

    engine: ShardableEngine
    config: FSDPConfig
    device: torch.device
    """Where the group's collectives take their tensors (the model's device)."""


def sharding(engine: object, cfg: RunConfig, device: torch.device) -> Sharding | None:
    """The rank's :class:`Sharding` under ``train.strategy=fsdp`` (None under ``ddp``);
    ``TypeError`` naming the role when the engine cannot shard itself."""
    if cfg.train.strategy != "fsdp":
        return None
    if not isinstance(engine, ShardableEngine):
        raise TypeError(
            f"train.strategy=fsdp needs a training engine that shards itself "
            f"(engines.protocols.ShardableEngine: shard, state_specs, state_buckets); "
            f"{type(engine).__name__} lacks them: use train.strategy=ddp"
        )
    return Sharding(engine, FSDPConfig(**cfg.train.strategy_options), device)


def _empty_batch() -> TrainBatch:
    return TrainBatch(
        prompt_ids=[],
        response_ids=[],
        behaviour_logprobs=[],
        advantages=torch.zeros(0),
        versions=torch.zeros(0, dtype=torch.int64),
    )


async def calls_to_make(s: Sharding, calls: int) -> int:
    """The number of ``forward_backward`` calls every rank makes for this micro-batch: the
    most any rank needs (this one: ``calls``). Collective; call it before the calls."""
    return await asyncio.to_thread(max_over_ranks, calls, s.device)


async def empty_calls(s: Sharding, count: int, loss_scale: float) -> None:
    """``count`` calls to ``forward_backward`` that add nothing to the gradients (each runs
    the passes that keep the collectives in step)."""
    engine = s.engine
    assert isinstance(engine, TrainingEngine)

    def run() -> None:
        for _ in range(count):
            engine.forward_backward(_empty_batch(), loss_scale)

    await asyncio.to_thread(run)


def take_part(engine: ShardableEngine, bucket_bytes: int) -> None:
    """Gather every bucket of the weights with the other ranks, and drop it (ranks 1..)."""
    for _ in engine.state_buckets(bucket_bytes):
        pass


async def publish(s: Sharding, sender: WeightSender, ranks: list[Any], version: int) -> None:
    """Rank 0: publish ``version`` a bucket at a time while ranks 1.. gather with it."""
    size = s.config.bucket_bytes
    others = [r.gather_weights.remote(size) for r in ranks]
    specs = s.engine.state_specs()
    mine = asyncio.to_thread(publish_stream, sender, specs, s.engine.state_buckets(size), version)
    results = await asyncio.gather(mine, *others, return_exceptions=True)
    for result in results:  # every rank finished its gathers before any error is raised
        if isinstance(result, BaseException):
            raise result
