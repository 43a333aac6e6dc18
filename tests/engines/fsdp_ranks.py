"""One trainer rank of the sharded-training tests (a module of its own, so that spawned rank
processes import it by name): the HF training engine on the tiny model, data-parallel
(``ddp``: whole replicas, gradients all-reduced) or sharded (``fsdp``), over a real gloo
group, training the same batches in either mode.

Each step trains 7 samples: rank 0 gets 3 and rank 1 gets 4, with micro-batches of at most 2
samples, so the ranks run 2 and 3 forward/backward passes and the sharded rank 0 must run an
empty one to stay in step. Rank 1 also splits its share into two ``forward_backward`` calls
(token-budget packs do that), so rank 0 makes an empty call to match
(``asyncflow.deploy.sharded.even_calls`` does the same in a run).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from engines.distributed import (
    all_reduce_gradients,
    broadcast_parameters,
    init_group,
    leave_group,
    max_over_ranks,
)
from engines.fsdp import FSDPConfig
from engines.hf import HFTrainingConfig, HFTrainingEngine
from engines.protocols import TrainBatch

STEP_SAMPLES = 7
RANK_SAMPLES = (slice(0, 3), slice(3, 7))
BUCKET_BYTES = 48 << 10  # several buckets for the tiny model (~1 MB of weights)


def step_batch(step: int, vocab: int) -> TrainBatch:
    """The samples of ``step`` (the same in every mode and run)."""
    g = torch.Generator().manual_seed(1000 + step)
    prompts, responses, behaviour = [], [], []
    for _ in range(STEP_SAMPLES):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = int(torch.randint(1, 5, (1,), generator=g))
        prompts.append(torch.randint(1, vocab, (p,), generator=g))
        responses.append(torch.randint(1, vocab, (r,), generator=g))
        behaviour.append(-torch.rand(r, generator=g) * 3)
    return TrainBatch(
        prompt_ids=prompts,
        response_ids=responses,
        behaviour_logprobs=behaviour,
        advantages=torch.randn(STEP_SAMPLES, generator=g),
        versions=torch.zeros(STEP_SAMPLES, dtype=torch.int64),
    )


def _part(batch: TrainBatch, rows: slice) -> TrainBatch:
    return TrainBatch(
        prompt_ids=batch.prompt_ids[rows],
        response_ids=batch.response_ids[rows],
        behaviour_logprobs=batch.behaviour_logprobs[rows],
        advantages=batch.advantages[rows],
        versions=batch.versions[rows],
    )


def run_rank(rank: int, port: int, model: str, out: str, job: dict[str, Any]) -> None:
    """Train ``job["steps"]`` (a range) in mode ``job["mode"]``; write ``rank{r}.pt`` with the
    per-step losses, grad norms and (rank 0) the full weights at the end. ``job["load"]``:
    resume from that checkpoint first; ``job["save_after"]``: save a checkpoint after that
    many steps into ``job["checkpoint"]``, write ``saved`` and wait to be killed."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    init_group(rank, 2, "127.0.0.1", port, backend="gloo", timeout_s=60)
    config = HFTrainingConfig(lr=1e-3, max_micro_batch_size=2)
    engine = HFTrainingEngine(model, config=config)
    sharded = job["mode"] == "fsdp"
    if sharded:
        engine.shard(FSDPConfig(bucket_bytes=BUCKET_BYTES))
    else:
        broadcast_parameters(engine.model)
    if job.get("load"):
        engine.load(job["load"])
    vocab = int(engine.model.config.vocab_size)
    losses, norms = [], []
    for step in job["steps"]:
        batch = step_batch(step, vocab)
        calls = [RANK_SAMPLES[0]] if rank == 0 else [slice(3, 5), slice(5, 7)]
        most = max_over_ranks(len(calls), torch.device("cpu"))  # agreed before any call
        calls += [slice(0, 0)] * (most - len(calls))  # empty calls: nothing but collectives
        loss = 0.0
        for rows in calls:
            loss += engine.forward_backward(_part(batch, rows), 1.0 / STEP_SAMPLES)["loss"]
        if not sharded:
            all_reduce_gradients(engine.model)
        losses.append(loss)
        norms.append(engine.optimizer_step()["grad_norm"])
        if job.get("save_after") == step + 1:
            engine.save(job["checkpoint"])
            Path(out, f"saved{rank}").touch()
            while True:  # the test kills this process now
                time.sleep(1)
    buckets = list(engine.state_buckets(BUCKET_BYTES))
    full = {k: v for b in buckets for k, v in b.items()}
    result = {
        "losses": losses,
        "norms": norms,
        "version": engine.version,
        "bucket_sizes": [
            sum(t.numel() * t.element_size() for t in set(b.values())) for b in buckets
        ],
        "largest": max(t.numel() * t.element_size() for t in full.values()),
    }
    if job.get("policy"):
        engine.save_policy(job["policy"])
    if rank == 0:
        result["state"] = full
    torch.save(result, Path(out) / f"rank{rank}.pt")
    leave_group()


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
