"""From a :class:`RunConfig` to engines: the only place that knows every engine by name.

Each role has its own builder (:class:`EngineFactories`), because with ``deploy=ray`` every
stage host builds only its own engine, in its own process, from the same config: a rollout
actor loads one generator, a trainer rank one trainer. ``deploy=local`` builds them all in the
driver (:func:`build_components`). Custom engines: give :class:`EngineFactories` with your own
functions (module-level functions, so that they pickle to Ray actors), or, in local mode,
:class:`Components` built yourself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncflow.config import EnvConfig, RunConfig
from asyncflow.threads import intra_op_threads
from engines.envs import environment_factory
from engines.episodes import EpisodeLimits, EpisodeRunner, EpisodeSource, TurnFormat
from engines.protocols import GenerationEngine, RewardFn, ScoringEngine, TrainingEngine
from engines.rewards import WeightedReward, make_reward
from engines.tasks import Task, make_task

if TYPE_CHECKING:  # (transformers' tokenizers load on first use: a host without one skips them)
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Components",
    "EngineFactories",
    "build_components",
    "build_episodes",
    "build_generator",
    "build_reference",
    "build_reward",
    "build_task",
    "build_tokenizer",
    "build_trainer",
    "model_path",
    "resolve_device",
]

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
    fns = [make_reward(name) for name in cfg.reward_functions()]
    if len(fns) == 1 and cfg.reward.weights is None:
        return fns[0]
    weights = cfg.reward.weights or [1.0] * len(fns)
    return WeightedReward(list(zip(fns, weights, strict=True)))


def resolve_device(device: str) -> str:
    """``auto``: CUDA when this process sees a GPU (with ``deploy.mode=ray``, an actor sees
    the GPUs its ``placement.num_gpus`` reserved), else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def build_task(cfg: RunConfig) -> Task:
    return make_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)


def build_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The model folder's tokenizer: ``AutoTokenizer``, or for a folder ``engines.tiny`` built
    the class it saved, loaded directly (the same object, without loading transformers'
    model registry: about 1.4 s of CPU in each process that needs only a tokenizer)."""
    if (Path(path) / "tiny_build.json").is_file():
        from engines.tiny import load_tokenizer

        return load_tokenizer(path)
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tokenizer


def build_trainer(cfg: RunConfig, path: Path, rank: int = 0) -> TrainingEngine:
    """The policy's training engine (every data-parallel rank builds the same one)."""
    from engines.hf import HFTrainingConfig, HFTrainingEngine

    t = cfg.train
    return HFTrainingEngine(
        path,
        config=HFTrainingConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            temperature=max(cfg.rollout.temperature, 1e-6),
            clip_eps=t.clip_eps,
            clip_eps_high=t.clip_eps_high,
            is_cap=t.is_cap,
            loss=t.loss,
            prox_logp=t.prox_logp,
            kl_coef=cfg.reference.kl_coef,
            **t.engine_options,
        ),
        dtype=getattr(torch, cfg.model.dtype),
        device=resolve_device(t.device),
        version=0,
    )


def build_generator(cfg: RunConfig, path: Path, index: int) -> GenerationEngine:
    """Generation instance ``index`` (seeded ``rollout.seed + index``)."""
    return _generator(cfg, path, getattr(torch, cfg.model.dtype), seed=cfg.rollout.seed + index)


def build_episodes(
    cfg: RunConfig, tokenizer: PreTrainedTokenizerBase | None
) -> EpisodeSource | None:
    """The rollout's episode source: an :class:`engines.episodes.EpisodeRunner` (its
    environment, its bounds, observations in the policy's chat template), an
    :class:`engines.agents.AgentRunner` (``rollout.agent``), or None (one-turn responses)."""
    name = cfg.environment()
    agent = cfg.rollout.agent
    if name is None and agent is None:
        return None
    if tokenizer is None:
        raise ValueError(
            f"{'agent' if agent else 'environment'} {agent or name!r}: the rollout needs the "
            "policy's tokenizer (pass tokenizer= to the rollout adapter's builder)"
        )
    env = cfg.env
    limits = EpisodeLimits(
        max_turns=cfg.rollout.max_turns,
        max_tokens=cfg.rollout.max_episode_tokens,
        timeout_s=env.timeout_s,
        max_observation_tokens=env.max_observation_tokens,
        retries=env.retries,
        episode_timeout_s=env.episode_timeout_s,
        timeout_reward=env.timeout_reward,
        max_concurrent=max_concurrent(name, env),
    )
    if agent is not None:
        from engines.agents import AgentRunner

        r = cfg.rollout
        return AgentRunner(
            agent,
            tokenizer,
            limits,
            options=r.agent_options,
            model=r.agent_model,
            api_key=r.agent_api_key,
            # the tokenizer was loaded from the policy's folder (build_tokenizer)
            context_tokens=policy_context(cfg, Path(tokenizer.name_or_path)),
        )
    assert name is not None
    return EpisodeRunner(
        environment_factory(name, env.options),
        TurnFormat(tokenizer, role=env.observation_role),
        limits,
        threads=env.threads,
    )


def _positions(path: Path) -> int | None:
    """The model folder's ``max_position_embeddings`` (None: its config does not say)."""
    try:
        context = json.loads((Path(path) / "config.json").read_text()).get(
            "max_position_embeddings"
        )
    except (OSError, ValueError):
        return None
    return int(context) if isinstance(context, int) and context > 0 else None


def _vllm_max_model_len(path: Path) -> int:
    """vLLM's ``max_model_len`` by default: the model's context, at most 2048 (vLLM refuses
    one beyond the model's context; the tiny model has 512)."""
    return min(2048, _positions(path) or 2048)


def policy_context(cfg: RunConfig, path: Path) -> int | None:
    """The tokens the policy reads at most, prompt and response together: vLLM's
    ``max_model_len`` (``rollout.engine_options`` or its default), else the model's
    ``max_position_embeddings`` (None: the model folder does not say)."""
    if cfg.rollout.engine == "vllm":
        given = cfg.rollout.engine_options.get("max_model_len")
        return int(given) if isinstance(given, int) else _vllm_max_model_len(path)
    return _positions(path)


def max_concurrent(name: str | None, env: EnvConfig) -> int | None:
    """The rollout worker's bound of open environments: ``env.max_concurrent``, lowered for
    an OpenEnv server to its ``max_sessions`` option (episodes past the session cap then wait
    in the runner, not in ``reset`` where the wait counts against ``timeout_s``)."""
    cap = env.max_concurrent
    sessions = env.options.get("max_sessions") if name == "openenv" else None
    if isinstance(sessions, int) and (cap is None or sessions < cap):
        cap = sessions
    return cap


def build_reward(cfg: RunConfig) -> RewardFn:
    return _reward(cfg)


def build_reference(cfg: RunConfig, path: Path) -> ScoringEngine:
    from engines.hf import HFScoringEngine

    return HFScoringEngine(
        path,
        dtype=getattr(torch, cfg.model.dtype),
        device=resolve_device(cfg.reference.device),
        temperature=max(cfg.rollout.temperature, 1e-6),
    )


@dataclass(frozen=True)
class EngineFactories:
    """How each role's engine is built from the config and the model folder.

    Called where the engine lives: in the driver (``deploy=local``) or in the stage host's
    actor (``deploy=ray``, so every function here must pickle: module-level functions or
    ``functools.partial`` of them).
    """

    task: Callable[[RunConfig], Task] = build_task
    model: Callable[[RunConfig, Task], Path] = model_path
    """Resolves the model folder, once, in the driver; stage hosts get the path (with
    ``deploy=ray`` on several nodes it must be readable on every node)."""
    tokenizer: Callable[[Path], PreTrainedTokenizerBase] = build_tokenizer
    trainer: Callable[[RunConfig, Path, int], TrainingEngine] = build_trainer
    generator: Callable[[RunConfig, Path, int], GenerationEngine] = build_generator
    reward: Callable[[RunConfig], RewardFn] = build_reward
    reference: Callable[[RunConfig, Path], ScoringEngine] = build_reference


def build_components(
    cfg: RunConfig, factories: EngineFactories | None = None, *, policy: Path | None = None
) -> Components:
    """Build the task, tokenizer and every engine a config names, in this process.

    ``policy``: the folder the generators load instead of the model (a checkpoint's policy
    when a run resumes; the trainer and the reference are built from the model as always,
    the trainer then loads the checkpoint's state)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-model "Loading weights" bars drown the run's own
    f = factories or EngineFactories()
    task = f.task(cfg)
    path = f.model(cfg, task)
    tokenizer = f.tokenizer(path)
    trainer = f.trainer(cfg, path, 0)
    generators: list[GenerationEngine] = []
    closers: list[Any] = []
    for i in range(cfg.rollout.instances):
        gen = f.generator(cfg, policy or path, i)
        generators.append(gen)
        close = getattr(gen, "close", None)
        if close is not None:
            closers.append(close)
    reference = f.reference(cfg, path) if cfg.reference.enabled else None
    return Components(task, tokenizer, trainer, generators, f.reward(cfg), reference, closers)


def _generator(cfg: RunConfig, path: Path, dtype: torch.dtype, *, seed: int) -> GenerationEngine:
    """One generation engine; ``rollout.engine_options`` win over the derived settings."""
    import dataclasses
    import inspect

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
        kwargs: dict[str, Any] = {
            "dtype": dtype,
            "seed": seed,
            "device": resolve_device(cfg.rollout.device),
            "partial": cfg.rollout.partial,
            **options,
        }
        if not set(kwargs) <= valid:
            raise ValueError(
                f"rollout.engine_options {sorted(set(kwargs) - valid)} are not options of the "
                f"hf engine; valid: {sorted(valid)}"
            )
        if cfg.engine_process():
            from engines.hf.process import HFProcessGenerationEngine

            threads = intra_op_threads(cfg)
            return HFProcessGenerationEngine(path, version=0, threads=threads, **kwargs)
        return HFGenerationEngine(path, version=0, **kwargs)
    if engine == "vllm":
        from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

        valid = {f.name for f in dataclasses.fields(VLLMEngineConfig)} - {"model", "version"}
        kwargs = {
            "dtype": cfg.model.dtype,  # behaviour log-probs in the trainer's precision
            "max_model_len": _vllm_max_model_len(path),
            "seed": seed,
            **({"update_mode": "partial"} if cfg.rollout.partial else {}),
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
