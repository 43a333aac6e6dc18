"""HF transformers training engine: the policy, AdamW, and the loss of :mod:`engines.loss`.

Implements :class:`engines.protocols.TrainingEngine` and
:class:`engines.protocols.CheckpointableEngine`. The train adapter calls ``forward_backward``
once per micro-batch of a step (in a worker thread), then ``optimizer_step``; the weight-sync
path calls ``state_dict`` after the step; checkpoints call ``save`` between steps and
``load`` before the first one, and the end of a run ``save_policy``.

A checkpoint written by :meth:`HFTrainingEngine.save` into a folder:

| path                  | content                                                        |
|-----------------------|----------------------------------------------------------------|
| ``policy/``           | the policy, ``save_pretrained`` (``model.safetensors``, config, |
|                       | generation config): loads with ``from_pretrained``              |
| ``trainer_state.pt``  | ``{"format", "version", "optimizer", "scheduler"}``: AdamW's    |
|                       | state dict (``torch.load(weights_only=True)`` reads it); no LR  |
|                       | scheduler exists (constant LR), so ``scheduler`` is None        |

**Sharded** (:meth:`HFTrainingEngine.shard`, after the process group formed): the model and
AdamW are sharded over the ranks with FSDP2 (:mod:`engines.fsdp`), and a checkpoint is
instead:

| path                  | content                                                        |
|-----------------------|----------------------------------------------------------------|
| ``policy/``           | the full policy, gathered a bucket at a time (safetensors       |
|                       | shards + index when it spans several buckets)                   |
| ``sharded/``          | every rank's shard of the weights and of AdamW's state          |
|                       | (``torch.distributed.checkpoint``), read back by as many ranks  |
| ``trainer_state.pt``  | ``{"format", "version", "optimizer": None, "scheduler": None,   |
|                       | "sharded": True}``                                              |

Then ``save``, ``load``, ``save_policy``, ``state_dict`` and ``state_buckets`` are collective
(every rank calls them, in the same order), and every rank runs the same number of forward and
backward passes per ``forward_backward`` (a rank with fewer micro-batches runs empty passes
that add zero gradients), because each pass gathers parameters and reduce-scatters gradients.

Log-probs are computed at the generation temperature (``HFTrainingConfig.temperature``), the
same convention as the generation and scoring engines, so ``logp - behaviour_logp`` measures
staleness, not a change of temperature. Each ``forward_backward`` is split into micro-batches
of bounded padded size, each backpropagated at once, so memory does not grow with the batch.
The loss is a sum over samples (times ``loss_scale``), so the split does not change the
gradient.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from engines import fsdp
from engines.hf.batching import response_logprobs, right_pad, split_by_tokens
from engines.hf.loading import ModelSource, load_model, load_weights, read_folder_state
from engines.loss import OBJECTIVES, interpolate_prox_logp, policy_loss
from engines.protocols import TrainBatch
from engines.sched import compute_bound

__all__ = ["HFTrainingConfig", "HFTrainingEngine"]

_STATE_FORMAT = 1  # bump when trainer_state.pt changes


@dataclass(kw_only=True)
class HFTrainingConfig:
    """Optimizer and loss settings of :class:`HFTrainingEngine`."""

    lr: float = 1e-5
    """AdamW learning rate (constant); a pretrained LM's scale. The tiny demo model learns at
    2e-4 and becomes unstable from about 5e-4."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None disables clipping."""
    temperature: float = 1.0
    """Sampling temperature of the generator; log-probs are computed at it."""
    clip_eps: float = 0.2
    """PPO clip range below 1."""
    clip_eps_high: float | None = None
    """PPO clip range above 1; None = clip_eps."""
    is_cap: float | None = 2.0
    """Truncation of the importance weight pi_old / mu; None disables the correction."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference; needs ``TrainBatch.ref_logprobs``."""
    seq_norm: float | None = None
    """None: token mean per sequence; a number L: token sum / L (Dr. GRPO, no length bias;
    use ``max_new_tokens``). See :mod:`engines.loss`."""
    max_tokens_per_micro_batch: int = 8192
    """Padded tokens per forward/backward pass."""
    max_micro_batch_size: int = 64
    """Samples per forward/backward pass."""
    loss: str = "tis"
    """The objective (:mod:`engines.loss`): ``tis`` (truncated importance sampling) or
    ``decoupled`` (decoupled PPO: a proximal policy for the clip, see ``prox_logp``)."""
    prox_logp: str = "recompute"
    """``decoupled``: the proximal log-probs. ``recompute``: a forward pass without gradient
    with the weights at the start of the step (reported: ``prox_logp_gap``, their mean
    distance to the current log-probs); ``interpolate``: log-linear between the behaviour
    log-probs and the current ones by version stamps
    (:func:`engines.loss.interpolate_prox_logp`), no forward pass. The versions are
    ``TrainBatch.versions`` (per sample), or ``TrainBatch.extra["token_versions"]``
    (``B x [T_i]`` ints, per token) when present."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {self.max_grad_norm}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.seq_norm is not None and self.seq_norm <= 0:
            raise ValueError(f"seq_norm must be > 0 or None, got {self.seq_norm}")
        if self.loss not in OBJECTIVES:
            raise ValueError(f"loss must be one of {OBJECTIVES}, got {self.loss!r}")
        if self.prox_logp not in ("recompute", "interpolate"):
            raise ValueError(f"prox_logp must be recompute or interpolate, got {self.prox_logp!r}")
        if self.max_tokens_per_micro_batch < 1 or self.max_micro_batch_size < 1:
            raise ValueError(
                "max_tokens_per_micro_batch and max_micro_batch_size must be >= 1, got "
                f"{self.max_tokens_per_micro_batch}, {self.max_micro_batch_size}"
            )


class HFTrainingEngine:
    """Trains a HF causal LM with the policy loss; see the module docstring.

    Args:
        model: a saved model folder or an in-memory model. An in-memory model is trained in
            place: give the generation engine its own copy (``copy.deepcopy``).
        config: optimizer and loss settings.
        device: where the model runs.
        dtype: dtype for a model loaded from a folder (keep float32 for training on CPU).
        version: optimizer steps already taken by these weights (0 for a fresh start).

    ``TrainBatch.extra["old_logprobs"]`` (``B x [T_i]``), if present, is used as ``pi_old``
    (the proximal log-probs of the ``decoupled`` objective; for callers that take several
    optimizer steps on one batch); otherwise ``pi_old`` is the current policy (one step per
    batch), or with ``decoupled`` what ``HFTrainingConfig.prox_logp`` makes of it.
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        config: HFTrainingConfig | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        version: int = 0,
    ) -> None:
        self.config = config or HFTrainingConfig()
        self._model = load_model(model, dtype=dtype, device=device)
        self._model.train()
        self._device = next(self._model.parameters()).device
        self._optimizer = self._new_optimizer()
        self._version = version
        self._lock = threading.Lock()
        self._pending_samples = 0
        self._sharding: fsdp.FSDPConfig | None = None

    def _new_optimizer(self, *, sharded: bool = False) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters: the fused kernel (one call for every
        tensor: half the time of the per-tensor loop for a small model on a CPU) unless the
        parameters are sharded, where the per-tensor loop handles their shards."""
        cfg = self.config
        params = [p for p in self._model.parameters() if p.requires_grad]
        fused = not sharded and all(p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(
            params,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            fused=fused or None,
        )

    def shard(self, config: fsdp.FSDPConfig | None = None) -> None:
        """Shard the model and AdamW over the default process group (FSDP2; see the module
        docstring). Called once on every rank, after the group formed and before the first
        step or ``load`` (the optimizer is built again over the shards)."""
        with self._lock:
            if self._sharding is not None:
                raise RuntimeError("this training engine is already sharded")
            if self._optimizer.state or self._pending_samples:
                raise RuntimeError(
                    "shard() must come before the first forward_backward, step or load"
                )
            fsdp.shard_model(self._model, config)
            self._optimizer = self._new_optimizer(sharded=True)
            self._sharding = config or fsdp.FSDPConfig()

    @property
    def sharded(self) -> bool:
        """Whether :meth:`shard` was called (the collective calls of the module docstring)."""
        return self._sharding is not None

    @property
    def version(self) -> int:
        """Optimizer steps taken: the version of the current weights."""
        return self._version

    @property
    def model(self) -> PreTrainedModel:
        """The trained model."""
        return self._model

    @compute_bound
    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        """Accumulate gradients of ``loss_scale * sum of per-sample losses`` over ``batch``."""
        cfg = self.config
        if cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError(
                f"kl_coef={cfg.kl_coef} needs TrainBatch.ref_logprobs; run a reference "
                "scoring stage or set kl_coef=0"
            )
        old_all = batch.extra.get("old_logprobs")
        if old_all is not None and len(old_all) != len(batch):
            raise ValueError(f"extra['old_logprobs'] has {len(old_all)} rows, batch {len(batch)}")
        for i, (resp, beh) in enumerate(
            zip(batch.response_ids, batch.behaviour_logprobs, strict=True)
        ):
            if resp.shape != beh.shape:
                raise ValueError(
                    f"sample {i}: response_ids {tuple(resp.shape)} and behaviour_logprobs "
                    f"{tuple(beh.shape)} differ in shape"
                )
            if batch.loss_mask is not None and batch.loss_mask[i].shape != resp.shape:
                raise ValueError(
                    f"sample {i}: loss_mask {tuple(batch.loss_mask[i].shape)} and response_ids "
                    f"{tuple(resp.shape)} differ in shape"
                )
        sums: dict[str, float] = {}
        tokens = 0
        loss_total = 0.0
        world = dist.get_world_size() if self.sharded else 1
        # FSDP averages the reduce-scattered gradients over the ranks; the step's gradient is
        # their sum (every rank scales by 1 / the step's samples over all ranks)
        scale = loss_scale * world
        with self._lock:
            self._model.train()
            slices = split_by_tokens(
                batch.prompt_ids,
                batch.response_ids,
                cfg.max_tokens_per_micro_batch,
                cfg.max_micro_batch_size,
            )
            idle = self._passes_behind(len(slices)) if self.sharded else 0
            prox_forward = cfg.loss == "decoupled" and cfg.prox_logp == "recompute"
            prox_forward = prox_forward and old_all is None
            for part in slices:
                scored = response_logprobs(
                    self._model,
                    batch.prompt_ids[part],
                    batch.response_ids[part],
                    temperature=cfg.temperature,
                    with_entropy=True,
                    share_prompts=not self.sharded,  # FSDP: the same passes on every rank
                )
                dev = self._device
                behaviour = right_pad(batch.behaviour_logprobs[part], 0.0, torch.float32)[0]
                behaviour = behaviour.to(dev)
                ref = old = None
                if batch.ref_logprobs is not None:
                    ref = right_pad(batch.ref_logprobs[part], 0.0, torch.float32)[0].to(dev)
                if old_all is not None:
                    old = right_pad(old_all[part], 0.0, torch.float32)[0].to(dev)
                extra: dict[str, float] = {}
                adv = batch.advantages[part].to(dev)
                mask = scored.mask
                if batch.loss_mask is not None:  # only the model's own tokens of an episode
                    mask = mask & right_pad(batch.loss_mask[part], False, torch.bool)[0].to(dev)
                if cfg.loss == "decoupled" and old is None:
                    old, extra = self._prox_logp(batch, part, scored.logprobs, behaviour)
                out = policy_loss(
                    scored.logprobs,
                    behaviour,
                    adv,
                    mask,
                    old_logp=old,  # decoupled: the proximal log-probs
                    clip_eps=cfg.clip_eps,
                    clip_eps_high=cfg.clip_eps_high,
                    is_cap=cfg.is_cap,
                    ref_logp=ref,
                    kl_coef=cfg.kl_coef,
                    loss_scale=scale,
                    seq_norm=cfg.seq_norm,
                    over_cap="drop" if cfg.loss == "decoupled" else "truncate",
                )
                out.metrics.update(extra)
                if out.num_tokens:  # a micro-batch of empty responses has nothing to learn
                    out.loss.backward()
                elif self.sharded:  # ... but it must still take part in the collectives
                    self._idle_pass(prox_forward)
                loss_total += float(out.loss.detach()) / world
                n = out.num_tokens
                tokens += n
                entropy = 0.0 if scored.entropy is None else float((scored.entropy * mask).sum())
                metrics = {**out.metrics, "entropy": entropy / max(n, 1)}
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value * n
            for _ in range(idle):
                self._idle_pass(prox_forward)
            self._pending_samples += len(batch)
        result = {key: value / max(tokens, 1) for key, value in sums.items()}
        staleness = (self._version - batch.versions.long()).float()
        result.update(
            loss=loss_total,
            num_tokens=float(tokens),
            num_samples=float(len(batch)),
            micro_batches=float(len(slices)),
            staleness_mean=float(staleness.mean()) if len(batch) else 0.0,
            staleness_max=float(staleness.max()) if len(batch) else 0.0,
        )
        return result

    def _prox_logp(
        self, batch: TrainBatch, part: slice, logp: torch.Tensor, behaviour: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The proximal log-probs of a micro-batch (``[B, T]``, detached) as ``prox_logp``
        says, and metrics. The proximal policy is the policy at the start of the step: the
        weights of version ``self._version``, which no update changes before
        ``optimizer_step`` (so the current log-probs are scored by it too)."""
        cfg = self.config
        if cfg.prox_logp == "recompute":
            with torch.no_grad():
                prox = response_logprobs(
                    self._model,
                    batch.prompt_ids[part],
                    batch.response_ids[part],
                    temperature=cfg.temperature,
                    share_prompts=not self.sharded,
                ).logprobs
            valid = torch.zeros_like(prox, dtype=torch.bool)
            for i, r in enumerate(batch.response_ids[part]):
                valid[i, : int(r.numel())] = True
            gap = (prox - logp.detach()).abs()[valid]
            return prox, {"prox_logp_gap": float(gap.mean()) if gap.numel() else 0.0}
        token_versions = batch.extra.get("token_versions")
        if token_versions is not None:
            if len(token_versions) != len(batch):
                raise ValueError(
                    f"extra['token_versions'] has {len(token_versions)} rows, batch {len(batch)}"
                )
            versions = right_pad(token_versions[part], -1, torch.long)[0]  # [B, T]
        else:
            versions = batch.versions[part].long()  # [B]
        prox = interpolate_prox_logp(
            behaviour,
            logp,
            versions.to(logp.device),
            prox_version=self._version,
            logp_version=self._version,
        )
        return prox, {}

    def _passes_behind(self, passes: int) -> int:
        """How many fewer forward/backward passes this rank has than the rank with the most
        (collective: a one-element all-reduce)."""
        count = torch.tensor([passes], dtype=torch.int64, device=self._device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item()) - passes

    def _idle_pass(self, prox_forward: bool) -> None:
        """A forward and backward pass that adds zero to every gradient: it gathers and
        reduce-scatters like a real one, so that the ranks' collectives stay in step (a real
        pass that recomputes the proximal log-probs has one more forward: ``prox_forward``)."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self._device)
        if prox_forward:
            with torch.no_grad():
                self._model(input_ids=ids, use_cache=False)
        logits = self._model(input_ids=ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    @compute_bound
    def optimizer_step(self) -> dict[str, float]:
        """Clip, step AdamW, zero the gradients, bump ``version``.

        A step whose gradient norm is not finite is skipped (gradients dropped, weights kept)
        but still counts as a version, so versions stay in step with the caller's schedule;
        ``skipped`` reports it.
        """
        cfg = self.config
        with self._lock:
            params = [p for p in self._model.parameters() if p.grad is not None]
            if params:
                max_norm = cfg.max_grad_norm if cfg.max_grad_norm is not None else math.inf
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                grad_norm = float(fsdp.full_tensor(norm))  # sharded: a replicated DTensor
            else:
                grad_norm = 0.0
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            samples = self._pending_samples
            self._pending_samples = 0
            self._version += 1
            return {
                "grad_norm": grad_norm,
                "lr": float(self._optimizer.param_groups[0]["lr"]),
                "skipped": float(skipped),
                "samples": float(samples),
                "version": float(self._version),
            }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached copies of the current weights (safe to keep across later steps).

        Tied parameters (the embedding and the output head) share one copy, as they share one
        tensor in the model. Sharded: the full weights gathered on every rank (collective; the
        whole model on each rank: publish with :meth:`state_buckets` instead).
        """
        if self.sharded:
            return {k: v for bucket in self.state_buckets(1 << 62) for k, v in bucket.items()}
        with self._lock:
            copies: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}
            out: dict[str, torch.Tensor] = {}
            for name, tensor in self._model.state_dict().items():
                if tensor.numel() == 0:  # empty tensors may share a null data pointer
                    out[name] = tensor.detach().clone()
                    continue
                key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
                if key not in copies:
                    copies[key] = tensor.detach().clone()
                out[name] = copies[key]
            return out

    def state_specs(self) -> list[fsdp.StateSpec]:
        """Names (tied ones grouped), full shapes and dtypes of what :meth:`state_buckets`
        yields, in its order."""
        return fsdp.state_specs(self._model)

    def state_buckets(self, bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
        """The current weights as full tensors, one bucket of at most ``bucket_bytes`` at a
        time (fresh copies, tied names sharing one): how a sharded trainer publishes without
        any rank holding more than one bucket beyond its shard. Sharded: collective, and every
        rank iterates to the end. Holds the engine's lock until the iteration ends (or the
        iterator is closed)."""
        with self._lock:
            yield from fsdp.state_buckets(self._model, bucket_bytes)

    # -- checkpoints ----------------------------------------------------------------------
    def save_policy(self, directory: str | os.PathLike[str]) -> None:
        """The current policy as a Hugging Face folder (safetensors), under the lock: never
        half an optimizer step. The folder is created if needed. Sharded: gathered a bucket
        at a time, written by rank 0 (collective)."""
        with self._lock:
            if self._sharding is not None:
                fsdp.write_policy(self._model, directory, self._sharding.bucket_bytes)
                return
            self._model.save_pretrained(os.fspath(directory), safe_serialization=True)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Everything training needs to go on: ``policy/`` and ``trainer_state.pt`` (see the
        module docstring). Called between steps (after ``optimizer_step``): gradients being
        accumulated for the next step are not saved, the weights and AdamW's moments are."""
        root = Path(directory)
        if self._sharding is not None:
            self._save_sharded(root, self._sharding)
            return
        root.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._model.save_pretrained(os.fspath(root / "policy"), safe_serialization=True)
            state = {
                "format": _STATE_FORMAT,
                "version": self._version,
                "optimizer": self._optimizer.state_dict(),
                "scheduler": None,
            }
            torch.save(state, root / "trainer_state.pt")

    def _save_sharded(self, root: Path, sharding: fsdp.FSDPConfig) -> None:
        rank0 = dist.get_rank() == 0
        with self._lock:
            fsdp.write_policy(self._model, root / "policy", sharding.bucket_bytes)
            fsdp.save_sharded(
                self._model, self._optimizer, root / "sharded", {"version": self._version}
            )
            if rank0:
                state = {
                    "format": _STATE_FORMAT,
                    "version": self._version,
                    "optimizer": None,
                    "scheduler": None,
                    "sharded": True,
                }
                torch.save(state, root / "trainer_state.pt")
            dist.barrier()  # trainer_state.pt is what marks the trainer's part written

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote: the weights (in place), AdamW's state and
        ``version``. Raises ``FileNotFoundError`` / ``ValueError`` naming what is missing or
        does not fit (another architecture, another optimizer layout)."""
        root = Path(directory)
        path = root / "trainer_state.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {root} is not a training checkpoint")
        state = torch.load(path, map_location=self._device, weights_only=True)
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"{path}: trainer state format {state.get('format')!r}, this engine reads "
                f"{_STATE_FORMAT}"
            )
        if bool(state.get("sharded")) != self.sharded:
            raise ValueError(
                f"{root} holds a {'sharded' if state.get('sharded') else 'full'} trainer "
                f"state and this engine is {'sharded' if self.sharded else 'not'}: resume "
                "with the train.strategy the checkpoint was written with"
            )
        if self.sharded:
            with self._lock:
                fsdp.load_sharded(self._model, self._optimizer, root / "sharded")
                self._optimizer.zero_grad(set_to_none=True)
                self._pending_samples = 0
                self._version = int(state["version"])
            return
        weights = read_folder_state(root / "policy")
        with self._lock:
            load_weights(self._model, weights)
            try:
                self._optimizer.load_state_dict(state["optimizer"])
            except ValueError as e:
                raise ValueError(f"{path}: the optimizer state does not fit this model: {e}") from e
            self._optimizer.zero_grad(set_to_none=True)
            self._pending_samples = 0
            self._version = int(state["version"])
