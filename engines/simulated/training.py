"""A training engine and a reward function whose compute is a timed sleep.

:class:`SimulatedTrainingEngine` implements :class:`engines.protocols.TrainingEngine`: the
train adapter calls ``forward_backward`` per micro-batch and ``optimizer_step`` per step, both
in a worker thread (``asyncio.to_thread``), so they block with ``time.sleep``; the workflow
calls ``state_dict`` after each step to publish weights. The cost model (:class:`TrainingCost`)::

    forward_backward   (per_token_s * tokens + per_sample_s * samples) / gpus   modelled s
    optimizer_step     step_s                                                   modelled s
    tokens             prompt + response tokens of the micro-batch (what the forward sees)

``gpus`` data-parallel devices split a micro-batch evenly (perfect scaling). Weight transfer to
the generators is modelled on their side (``SimulatedGenerationEngine.sync_s``), so
``state_dict`` returns a one-tensor dict.

:class:`SimulatedReward` is a :class:`engines.protocols.RewardFn` (called by the reward adapter
in a worker thread) that sleeps ``per_sample_s`` per sample and returns deterministic
pseudo-random rewards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engines.protocols import TrainBatch
from engines.simulated.hashing import hash64, uniform

__all__ = ["SimulatedReward", "SimulatedTrainingEngine", "TrainingCost", "sleep_until"]


def sleep_until(deadline: float) -> None:
    """Block until ``time.monotonic()`` reaches ``deadline``."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


@dataclass(frozen=True, kw_only=True)
class TrainingCost:
    """Modelled seconds of a training step on one device (see the module docstring).

    The defaults are SmolLM2-135M on ``HFTrainingEngine`` (fp32, one CPU thread) as recorded
    by ``bench/calibrate.py``.
    """

    per_token_s: float = 0.009279
    """Forward + backward seconds per token (prompt + response)."""
    per_sample_s: float = 0.0
    """Forward + backward seconds per sample (padding, per-sequence overhead)."""
    step_s: float = 0.8774
    """Optimizer step seconds (clip, AdamW update, zero grads)."""

    def __post_init__(self) -> None:
        if min(self.per_token_s, self.per_sample_s, self.step_s) < 0:
            raise ValueError(
                f"per_token_s, per_sample_s, step_s must be >= 0, got {self.per_token_s}, "
                f"{self.per_sample_s}, {self.step_s}"
            )

    def forward_backward_s(self, tokens: int, samples: int, gpus: int = 1) -> float:
        """Modelled seconds of one ``forward_backward`` on ``gpus`` devices."""
        return (self.per_token_s * tokens + self.per_sample_s * samples) / gpus


class SimulatedTrainingEngine:
    """Sleeps for the modelled time of each call; see the module docstring.

    Args:
        cost: the cost model.
        gpus: data-parallel devices of the trainer.
        time_scale: real seconds per modelled second.
        version: optimizer steps already taken.
        seed: seeds the reported metrics.
    """

    def __init__(
        self,
        cost: TrainingCost | None = None,
        *,
        gpus: int = 1,
        time_scale: float = 1.0,
        version: int = 0,
        seed: int = 0,
    ) -> None:
        if gpus < 1 or time_scale <= 0:
            raise ValueError(f"need gpus >= 1 and time_scale > 0, got {gpus}, {time_scale}")
        self.cost = cost or TrainingCost()
        self.gpus = gpus
        self.time_scale = time_scale
        self.seed = seed
        self._version = version
        self._lock = threading.Lock()  # one device group: calls run one at a time
        self._pending_samples = 0
        self.busy_s = 0.0
        """Modelled seconds spent in forward_backward and optimizer_step."""
        self.tokens = 0
        """Tokens (prompt + response) trained on."""

    @property
    def version(self) -> int:
        """Optimizer steps taken: the version of the current weights."""
        return self._version

    def forward_backward(self, batch: TrainBatch, loss_scale: float) -> dict[str, float]:
        """Block for the modelled forward + backward time of ``batch``."""
        prompt_tokens = sum(int(p.numel()) for p in batch.prompt_ids)
        response_tokens = batch.num_tokens
        tokens = prompt_tokens + response_tokens
        with self._lock:
            modelled = self.cost.forward_backward_s(tokens, len(batch), self.gpus)
            sleep_until(time.monotonic() + modelled * self.time_scale)
            self.busy_s += modelled
            self.tokens += tokens
            self._pending_samples += len(batch)
            version = self._version
        # A plausible policy-gradient surrogate: -sum(A_i * mean behaviour logprob_i).
        loss = 0.0
        for adv, logp in zip(batch.advantages.tolist(), batch.behaviour_logprobs, strict=True):
            if logp.numel():
                loss -= adv * float(logp.float().mean())
        staleness = (version - batch.versions.long()).float()
        return {
            "loss": loss * loss_scale,
            "num_tokens": float(response_tokens),
            "num_samples": float(len(batch)),
            "compute_s": modelled,
            "staleness_mean": float(staleness.mean()) if len(batch) else 0.0,
            "staleness_max": float(staleness.max()) if len(batch) else 0.0,
        }

    def optimizer_step(self) -> dict[str, float]:
        """Block for ``step_s``, then bump ``version``."""
        with self._lock:
            sleep_until(time.monotonic() + self.cost.step_s * self.time_scale)
            self.busy_s += self.cost.step_s
            samples, self._pending_samples = self._pending_samples, 0
            self._version += 1
            version = self._version
        grad_norm = 0.5 + uniform("grad_norm", self.seed, version)
        return {
            "grad_norm": grad_norm,
            "lr": 0.0,
            "skipped": 0.0,
            "samples": float(samples),
            "version": float(version),
            "compute_s": self.cost.step_s,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``{"version": tensor([version])}``: the transfer cost is the generators' ``sync_s``."""
        return {"version": torch.tensor([self._version], dtype=torch.int64)}


class SimulatedReward:
    """A reward function that sleeps ``per_sample_s`` per sample (modelled) and hashes.

    Each reward is a deterministic function of (prompt, completion, seed): a uniform draw in
    [0, 1], or with ``success_rate`` a binary reward that is 1 with that probability (GRPO
    groups whose samples all score alike then give no gradient, as with real verifiers).

    Args:
        per_sample_s: modelled seconds per sample (a verifier, a sandbox, a reward model).
        time_scale: real seconds per modelled second.
        success_rate: None for uniform rewards, else the probability of reward 1.
        seed: changes every reward.
    """

    def __init__(
        self,
        per_sample_s: float = 0.0,
        *,
        time_scale: float = 1.0,
        success_rate: float | None = None,
        seed: int = 0,
    ) -> None:
        if per_sample_s < 0 or time_scale <= 0:
            raise ValueError(
                f"need per_sample_s >= 0 and time_scale > 0, got {per_sample_s}, {time_scale}"
            )
        if success_rate is not None and not 0 <= success_rate <= 1:
            raise ValueError(f"success_rate must be in [0, 1] or None, got {success_rate}")
        self.per_sample_s = per_sample_s
        self.time_scale = time_scale
        self.success_rate = success_rate
        self.seed = seed
        self.busy_s = 0.0
        """Modelled seconds spent scoring."""

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **columns: Sequence[Any]
    ) -> list[float | None]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        modelled = self.per_sample_s * len(completions)
        sleep_until(time.monotonic() + modelled * self.time_scale)
        self.busy_s += modelled
        out: list[float | None] = []
        for prompt, completion in zip(prompts, completions, strict=True):
            u = uniform("reward", self.seed, hash64(prompt, completion))
            if self.success_rate is None:
                out.append(u)
            else:
                out.append(1.0 if u < self.success_rate else 0.0)
        return out
