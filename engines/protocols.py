"""The engine roles of an RL loop, as small Protocols.

Engines know nothing of TransferQueue, adapters or the workflow: they take plain Python and
torch values and return plain values, so they can be used on their own. The adapters in
``adapters/`` turn columns read from TransferQueue into these calls and the results back into
columns.

Token sequences are 1-D integer tensors (``int32`` or ``int64``), one per sample, never padded
batches: engines pad internally however suits them.

Roles and who calls them:

| role                | methods                                   | called by                  |
|---------------------|-------------------------------------------|----------------------------|
| GenerationEngine    | generate, update_weights, version         | rollout adapter; weight sync |
| ScoringEngine       | logprobs                                  | reference adapter          |
| TrainingEngine      | forward_backward, optimizer_step,         | train adapter; weight sync |
|                     | state_dict, version                       |                            |
| CheckpointableEngine| save, load, save_policy (optional: what   | the trainer's host, between|
|                     | checkpoints and the saved policy need)    | steps and at the end       |
| ShardableEngine     | shard, state_specs, state_buckets         | every trainer rank         |
|                     | (optional: ``train.strategy=fsdp``)       | (collective)               |
| RewardFn            | __call__                                  | reward adapter             |

Generation is ``async`` because it is where requests from several micro-batches overlap (vLLM's
continuous batching, the simulated engine's batch-size-dependent latency). Scoring and training
are plain blocking calls; the adapters run them in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "CheckpointableEngine",
    "Generation",
    "GenerationEngine",
    "RewardFn",
    "SamplingParams",
    "ScoringEngine",
    "ShardableEngine",
    "TrainBatch",
    "TrainingEngine",
]


@dataclass(kw_only=True)
class SamplingParams:
    """How to sample one batch of prompts."""

    max_new_tokens: int = 32
    """Upper bound on generated tokens per sample (the stop token included)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    seed: int | None = None
    """Seed for this call; None draws from the engine's generator."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end a sample (kept in the output), besides the tokenizer's EOS."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


@dataclass(init=False)
class Generation:
    """One sampled response, with the weights version that sampled each of its tokens.

    ``token_versions[t]`` is the version of the weights that computed ``logprobs[t]`` and drew
    ``token_ids[t]``. An engine that takes new weights in the middle of a response (partial
    rollouts: the update interrupts it at a token boundary and decoding goes on with the new
    weights) reports a non-decreasing run of versions; otherwise every entry is the same.
    ``version`` is the **oldest** token's version (the first token's), the one the staleness
    bound ``max_staleness`` is checked against; for an empty response it is the version the
    engine held. Give either: ``token_versions`` alone sets ``version`` to its minimum,
    ``version`` alone fills ``token_versions`` with it.
    """

    token_ids: torch.Tensor  # [T] int64: the response only, prompt excluded
    logprobs: torch.Tensor  # [T] float32: log p(token_t | prefix) under the sampling policy
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_new_tokens reached)
    version: int  # weights version of the oldest token (see the class docstring)
    token_versions: torch.Tensor  # [T] int64: weights version that sampled each token

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprobs: torch.Tensor,
        finish_reason: str,
        version: int = -1,
        token_versions: torch.Tensor | None = None,
    ) -> None:
        if token_ids.shape != logprobs.shape:
            raise ValueError(
                f"token_ids {tuple(token_ids.shape)} and logprobs "
                f"{tuple(logprobs.shape)} must have the same shape"
            )
        self.token_ids, self.logprobs, self.finish_reason = token_ids, logprobs, finish_reason
        if token_versions is None:
            self.version = version
            self.token_versions = torch.full(token_ids.shape, version, dtype=torch.int64)
            return
        if token_versions.shape != token_ids.shape:
            raise ValueError(
                f"token_versions {tuple(token_versions.shape)} must have the shape of "
                f"token_ids {tuple(token_ids.shape)}"
            )
        self.token_versions = token_versions.to(torch.int64)
        if token_versions.numel() == 0:
            self.version = version
            return
        oldest = int(self.token_versions.min())
        if version not in (-1, oldest):
            raise ValueError(
                f"version {version} is not the oldest token's version {oldest}: leave version "
                "out when token_versions is given"
            )
        self.version = oldest

    @classmethod
    def checked_by_caller(
        cls,
        token_ids: torch.Tensor,
        logprobs: torch.Tensor,
        finish_reason: str,
        version: int,
        token_versions: torch.Tensor,
    ) -> Generation:
        """A generation whose parts the caller already holds consistent (same shapes,
        ``token_versions`` int64, ``version`` its minimum or the engine's for an empty
        response): an engine building a batch's rows from whole arrays skips the per-row
        checks and conversions of the constructor (tensor calls per row)."""
        gen = cls.__new__(cls)
        gen.token_ids, gen.logprobs, gen.finish_reason = token_ids, logprobs, finish_reason
        gen.version, gen.token_versions = version, token_versions
        return gen

    @property
    def version_span(self) -> int:
        """Versions the response spans: newest token's minus oldest token's (0: one version)."""
        if self.token_versions.numel() == 0:
            return 0
        return int(self.token_versions.max()) - self.version


@runtime_checkable
class GenerationEngine(Protocol):
    """Samples responses and records the behaviour log-probabilities of what it sampled."""

    @property
    def version(self) -> int:
        """Version of the weights currently loaded (-1 before the first update)."""
        ...

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """Sample one response per prompt.

        Called by the rollout adapter once per micro-batch; several calls may be in flight at
        once. Every returned ``Generation`` says which weights version sampled each of its
        tokens (``token_versions``; ``version`` is the oldest). An engine either never swaps
        weights under a running response (every token one version) or, with partial rollouts,
        interrupts it at a token boundary and goes on with the new weights, recording the
        switch there.
        """
        ...

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights in place (no restart) and adopt ``version``.

        Called by the weight-sync path when the trainer publishes. It waits for the calls in
        flight to finish (a micro-batch boundary), or, with partial rollouts, pauses the running
        responses at a token boundary; loads; then resumes (the paused responses go on with the
        new weights). Returns once the new weights are in use.
        """
        ...


@runtime_checkable
class ScoringEngine(Protocol):
    """Computes log-probabilities of given responses (reference policy, or recomputation)."""

    def logprobs(
        self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Per-token ``log p(response_t | prompt, response_<t)``, one [T_i] float32 per sample.

        Called by the reference adapter in a worker thread, one micro-batch at a time.
        """
        ...


@dataclass
class TrainBatch:
    """What the train adapter hands a training engine: whole groups, advantages computed."""

    prompt_ids: list[torch.Tensor]  # B x [P_i] int
    response_ids: list[torch.Tensor]  # B x [T_i] int
    behaviour_logprobs: list[torch.Tensor]  # B x [T_i] float32, recorded at generation
    advantages: torch.Tensor  # [B] float32, one per sample (GRPO: group-normalized reward)
    versions: torch.Tensor  # [B] int64, weights version of each sample's oldest token
    ref_logprobs: list[torch.Tensor] | None = None  # B x [T_i] float32, for the KL term
    extra: dict[str, Any] = field(default_factory=dict)
    """More per-sample inputs; ``extra["token_versions"]`` (B x [T_i] int64), when the train
    stage has them, is the weights version that sampled each response token, -1 for a token the
    model did not generate (an episode's observation and template tokens)."""
    loss_mask: list[torch.Tensor] | None = None
    """B x [T_i] bool: the response tokens the loss covers (a multi-turn episode's own turns;
    its observation and template tokens are false). None: every response token."""

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        sizes = {
            "response_ids": len(self.response_ids),
            "behaviour_logprobs": len(self.behaviour_logprobs),
            "advantages": int(self.advantages.shape[0]),
            "versions": int(self.versions.shape[0]),
        }
        if self.ref_logprobs is not None:
            sizes["ref_logprobs"] = len(self.ref_logprobs)
        if self.loss_mask is not None:
            sizes["loss_mask"] = len(self.loss_mask)
        for name, size in sizes.items():
            if size != n:
                raise ValueError(f"TrainBatch.{name} has {size} rows, prompt_ids has {n}")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Response tokens in the batch (what training time scales with)."""
        return int(sum(int(r.numel()) for r in self.response_ids))


@runtime_checkable
class TrainingEngine(Protocol):
    """Owns the trainable policy and its optimizer.

    A step is split in two so that training can start on the first micro-batches of a step
    while later ones are still being generated (streaming): the train adapter calls
    ``forward_backward`` once per micro-batch as it arrives, then ``optimizer_step`` once the
    step's samples are all in.
    """

    @property
    def version(self) -> int:
        """Optimizer steps taken so far: the policy version the next samples will carry."""
        ...

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        """Accumulate gradients of ``loss_scale * sum of per-sample losses`` over ``batch``.

        Called by the train adapter in a worker thread. ``loss_scale`` is ``1 / samples in the
        step`` so that the accumulated gradient is the step's mean whatever the micro-batch
        split. Returns scalar metrics of this micro-batch (``loss`` at least).
        """
        ...

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step the optimizer, zero the gradients, bump ``version`` by one.

        Called by the train adapter after the last ``forward_backward`` of a step. Returns
        scalar metrics (``grad_norm`` at least).
        """
        ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Current policy weights, detached, for publishing to generators.

        Called by the weight-sync path after ``optimizer_step``; the returned tensors must not
        change under later steps (return copies).
        """
        ...


@runtime_checkable
class CheckpointableEngine(Protocol):
    """A training engine whose state can be written and read back (optional role).

    Needed by checkpoints (``checkpoint.every_steps``), resuming, and the policy folder a run
    leaves; a training engine without it still trains. Every call happens between optimizer
    steps, in the trainer's process (a worker thread).
    """

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write all a resumed run needs to continue exactly: the policy as a Hugging Face
        folder ``directory/policy`` (safetensors, ``from_pretrained`` loads it), optimizer
        and scheduler state, ``version``. Called after ``optimizer_step`` of a checkpoint's
        last step."""
        ...

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote (weights, optimizer, ``version``). Called once
        when a run resumes, before the first ``forward_backward``."""
        ...

    def save_policy(self, directory: str | os.PathLike[str]) -> None:
        """Write the current policy as a Hugging Face folder (safetensors). Called when the
        run ends."""
        ...


@runtime_checkable
class ShardableEngine(Protocol):
    """A training engine that shards its model and optimizer over the ranks of the default
    ``torch.distributed`` group (optional role: ``train.strategy=fsdp``).

    Once sharded, ``forward_backward`` and ``optimizer_step`` are collective (every rank calls
    them, each on its share of the step's samples), and so are the calls below and, when the
    engine is also a :class:`CheckpointableEngine`, ``save``, ``load`` and ``save_policy``.
    """

    def shard(self, config: Any) -> None:
        """Shard the model and the optimizer (``config``: the engine's sharding options, e.g.
        :class:`engines.fsdp.FSDPConfig`). Called once on every rank, after the group formed
        and before the first step or ``load``."""
        ...

    def state_specs(self) -> Sequence[Any]:
        """Names, full shapes and dtypes of what :meth:`state_buckets` yields
        (:class:`engines.weights_io.StateSpec`, in its order). Local; called by rank 0."""
        ...

    def state_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The full weights, one bucket of at most ``bucket_bytes`` of fresh tensors at a time
        (tied names sharing one). Called on every rank at once after ``optimizer_step`` to
        publish weights; every rank iterates to the end."""
        ...


class RewardFn(Protocol):
    """A plain callable: one reward (or None: "no verdict", excluded from training) per sample.

    Called by the reward adapter in a worker thread with the decoded prompts and completions
    and, as keyword arguments, the other object columns of the rows (e.g. ``answer``). A reward
    function must accept ``**kwargs`` it does not use.
    """

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]: ...
