"""From a :class:`RunConfig` to engines: the only place that knows every engine by name.

A workflow needs :class:`Components`; build them here from a config, or construct them
yourself (custom engines, tests) and pass them to :class:`asyncflow.workflow.Workflow`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from asyncflow.config import RunConfig
from engines.protocols import GenerationEngine, RewardFn, ScoringEngine, TrainingEngine
from engines.rewards import WeightedReward, make_reward
from engines.tasks import Task, make_task

__all__ = ["Components", "build_components", "model_path"]

log = logging.getLogger(__name__)


@dataclass
class Components:
    """Everything engine-side a workflow runs."""

    task: Task
    tokenizer: PreTrainedTokenizerBase
    trainer: TrainingEngine
    generators: list[GenerationEngine]
    reward_fn: RewardFn
    reference: ScoringEngine | None = None
    closers: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for c in self.closers:
            c()


def model_path(cfg: RunConfig, task: Task) -> Path:
    """The policy's model folder: built (tiny), converted (smollm2) or given (a path)."""
    name = cfg.model.name
    if name == "tiny":
        from engines.tiny import TinyConfig, WarmStartConfig, build_tiny

        warm = cfg.model.warm_start_steps
        return build_tiny(
            TinyConfig(seed=cfg.train.seed),
            cache_dir=None if cfg.model.cache_dir is None else Path(cfg.model.cache_dir) / "tiny",
            warm_start_task=task if warm else None,
            warm_start_config=WarmStartConfig(steps=warm) if warm else None,
        )
    if name == "smollm2":
        from engines.smollm2 import model_dir

        return Path(model_dir(cache_dir=cfg.model.cache_dir))
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.name={name!r} is neither 'tiny', 'smollm2' nor a HF model folder "
            "(a directory with config.json)"
        )
    return path


def _reward(cfg: RunConfig) -> RewardFn:
    fns = [make_reward(name) for name in cfg.reward.functions]
    if len(fns) == 1 and cfg.reward.weights is None:
        return fns[0]
    weights = cfg.reward.weights or [1.0] * len(fns)
    return WeightedReward(list(zip(fns, weights, strict=True)))


def build_components(cfg: RunConfig) -> Components:
    """Build the task, tokenizer and engines a config names."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars drown the run's own
    task = make_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)
    path = model_path(cfg, task)
    dtype = getattr(torch, cfg.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    from engines.hf import HFScoringEngine, HFTrainingConfig, HFTrainingEngine

    t = cfg.train
    trainer = HFTrainingEngine(
        path,
        config=HFTrainingConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            temperature=max(cfg.rollout.temperature, 1e-6),
            clip_eps=t.clip_eps,
            clip_eps_high=t.clip_eps_high,
            is_cap=t.is_cap,
            kl_coef=cfg.reference.kl_coef,
            **t.engine_options,
        ),
        dtype=dtype,
        version=0,
    )
    generators: list[GenerationEngine] = []
    closers: list[Any] = []
    for i in range(cfg.rollout.instances):
        gen = _generator(cfg, path, dtype, seed=cfg.rollout.seed + i)
        generators.append(gen)
        close = getattr(gen, "close", None)
        if close is not None:
            closers.append(close)
    reference = None
    if cfg.reference.enabled:
        reference = HFScoringEngine(
            path, dtype=dtype, temperature=max(cfg.rollout.temperature, 1e-6)
        )
    return Components(task, tokenizer, trainer, generators, _reward(cfg), reference, closers)


def _generator(cfg: RunConfig, path: Path, dtype: torch.dtype, *, seed: int) -> GenerationEngine:
    """One generation engine; ``rollout.engine_options`` win over the derived settings."""
    import dataclasses
    import inspect
    import json

    engine = cfg.rollout.engine
    options = dict(cfg.rollout.engine_options)
    if engine == "hf":
        from engines.hf import HFGenerationEngine

        valid = set(inspect.signature(HFGenerationEngine).parameters) - {"model", "version"}
        if isinstance(options.get("dtype"), str):
            name = options["dtype"]
            options["dtype"] = getattr(torch, name, None)
            if not isinstance(options["dtype"], torch.dtype):
                raise ValueError(f"rollout.engine_options.dtype={name!r} is not a torch dtype")
        kwargs: dict[str, Any] = {"dtype": dtype, "seed": seed, **options}
        if not set(kwargs) <= valid:
            raise ValueError(
                f"rollout.engine_options {sorted(set(kwargs) - valid)} are not options of the "
                f"hf engine; valid: {sorted(valid)}"
            )
        return HFGenerationEngine(path, version=0, **kwargs)
    if engine == "vllm":
        from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

        valid = {f.name for f in dataclasses.fields(VLLMEngineConfig)} - {"model", "version"}
        # vLLM refuses a max_model_len beyond the model's context (the tiny model has 512).
        context = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        kwargs = {
            "dtype": cfg.model.dtype,  # behaviour log-probs in the trainer's precision
            "max_model_len": min(2048, int(context or 2048)),
            "seed": seed,
            **options,
        }
        if not set(kwargs) <= valid:
            raise ValueError(
                f"rollout.engine_options {sorted(set(kwargs) - valid)} are not fields of "
                f"VLLMEngineConfig; valid: {sorted(valid)}"
            )
        return VLLMGenerationEngine(VLLMEngineConfig(model=str(path), version=0, **kwargs))
    raise ValueError(
        f"rollout.engine={engine!r} needs engines built by the benchmark harness "
        "(simulated engines have no model); use hf or vllm"
    )
