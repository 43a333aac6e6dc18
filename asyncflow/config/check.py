"""Checks of a loaded config that import or open something: what a run would trip on first.

:func:`asyncflow.config.load.load_config` checks types, ranges and names; :func:`check_config`
then checks what needs the machine: the model folder, the engine's package, every reward
(import paths imported), the task (built: its options checked, its data file read), whether
a finite task holds the run's groups, and the trackers' packages. ``asyncflow run`` and
``asyncflow config`` both call :func:`resolve_config` (load + check), so both accept and
refuse exactly the same configs, before a run starts anything.

With ``resume=DIR`` and no config file, the config the checkpoint's run had is the base that
the overrides apply to (``asyncflow run --resume runs/x`` continues ``runs/x`` as it was
configured); a config that changes what a step trains (the task, the group size, the groups
per step, the model) or has no steps left is refused here.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from adapters.episodes import EPISODE_FIELDS
from asyncflow import checkpoint
from asyncflow.config.load import config_to_dict, load_config_sources
from asyncflow.config.run import RunConfig
from asyncflow.config.sections import ConfigError
from asyncflow.loggers import missing_packages
from engines.envs import environment_factory
from engines.rewards import make_reward
from engines.tasks import Task, make_task

__all__ = ["RESERVED_COLUMNS", "check_config", "resolve_config", "resolve_config_sources"]

RESERVED_COLUMNS = (
    "prompt_ids",
    "min_gen_version",
    *EPISODE_FIELDS,
    "reward",
    "ref_logprobs",
)
"""Fields the workflow writes itself: a task's columns must not reuse these names."""


def resolve_config(path: str | Path | None, overrides: list[str]) -> RunConfig:
    """Load (defaults < the task's recipe < file < overrides) and check a config, as
    ``asyncflow run`` does."""
    return resolve_config_sources(path, overrides)[0]


def resolve_config_sources(
    path: str | Path | None, overrides: list[str]
) -> tuple[RunConfig, dict[str, str]]:
    """:func:`resolve_config`, and where each value came from (dotted key -> label, see
    :func:`asyncflow.config.load.load_config_sources`): what ``asyncflow config`` prints."""
    cfg, sources = load_config_sources(path, overrides)
    if cfg.resume is not None:
        cfg, sources = _resumed(cfg, sources, path, overrides)
    check_config(cfg)
    return cfg, sources


def _resumed(
    cfg: RunConfig, sources: dict[str, str], path: str | Path | None, overrides: list[str]
) -> tuple[RunConfig, dict[str, str]]:
    """The config of a resumed run: the checkpoint's (unless a file is given), overridden."""
    resume = cfg.resume
    assert resume is not None
    try:
        found = checkpoint.find_checkpoint(resume)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    if path is None:
        cfg, sources = load_config_sources(found / "config.yaml", overrides)
    saved = checkpoint.read_driver_state(found)
    try:
        checkpoint.check_resumable(config_to_dict(cfg), resume, found, saved)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg, sources


def check_config(cfg: RunConfig) -> Task:
    """Raise :class:`ConfigError` (one line: the field and the fix) if ``cfg`` cannot run.

    Returns the task it built. Imports the reward modules and reads the task's data file,
    nothing heavier: no model is loaded.
    """
    _check_model(cfg)
    _check_engine(cfg)
    _check_strategy(cfg)
    for name in cfg.reward_functions():
        try:
            make_reward(name)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"reward.functions: {e}") from None
        except Exception as e:  # a user's reward failing as it is built: its own words
            raise ConfigError(f"reward.functions: reward {name!r}: {_message(e)}") from e
    _check_env(cfg)
    task = _check_task(cfg)
    if cfg.eval.every_steps:
        _check_eval(cfg)
    missing = missing_packages(cfg.output.loggers)
    if missing:
        raise ConfigError(
            f"output.loggers names {sorted(missing)} but the package is not installed: "
            f"{'; '.join(missing.values())}, or drop it from output.loggers"
        )
    return task


def _check_model(cfg: RunConfig) -> None:
    name = cfg.model.name
    if name == "tiny":
        return
    if name == "smollm2":
        from engines.smollm2 import INSTALL_HINT, PACKAGE, is_available

        if importlib.util.find_spec(PACKAGE) is None or not is_available():
            raise ConfigError(
                f"model.name=smollm2 needs the SmolLM2 weights package: {INSTALL_HINT}"
            )
        return
    if not (Path(name) / "config.json").is_file():
        raise ConfigError(
            f"model.name={name!r} is neither 'tiny', 'smollm2' nor a Hugging Face model folder "
            "(a directory with config.json); fix the path or use model.name=tiny"
        )


def _check_engine(cfg: RunConfig) -> None:
    engine = cfg.rollout.engine
    if engine == "simulated":
        raise ConfigError(
            "rollout.engine=simulated has no model: the benchmark harness builds simulated "
            "engines itself (bench/rl.py); use rollout.engine=hf or vllm"
        )
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine=vllm needs vLLM: pip install 'asyncflow[vllm]' (on GPUs: pip "
            "install vllm), or use rollout.engine=hf"
        )


def _check_strategy(cfg: RunConfig) -> None:
    if cfg.train.strategy != "fsdp":
        return
    import dataclasses

    from engines.fsdp import FSDPConfig

    options = cfg.train.strategy_options
    known = [f.name for f in dataclasses.fields(FSDPConfig)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(
            f"train.strategy_options: {unknown[0]!r} is not an option of fsdp; options: "
            f"{', '.join(known)}"
        )
    try:
        FSDPConfig(**options)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"train.strategy_options: {e}") from None


def _check_env(cfg: RunConfig) -> None:
    if cfg.rollout.agent is not None:
        _check_agent(cfg)
    name = cfg.environment()
    if name is None:
        return
    try:
        environment_factory(name, cfg.env.options)
    except ValueError as e:
        raise ConfigError(f"env.name / env.options: {_options(e, 'env')}") from None
    except Exception as e:  # the environment's own check_options, in its own words
        raise ConfigError(f"env.name / env.options of {name!r}: {_options(e, 'env')}") from e


def _check_agent(cfg: RunConfig) -> None:
    from engines.agents import agent_factory
    from engines.imports import MissingExtraError, require

    try:
        for module in ("aiohttp", "openai"):
            require(module, extra="agents", what="rollout.agent")
        agent = cfg.rollout.agent or ""
        if agent.startswith("verifiers:"):
            _check_verifiers(cfg, agent[len("verifiers:") :].strip())
        agent_factory(agent, cfg.rollout.agent_options, model=cfg.rollout.agent_model)
    except MissingExtraError as e:
        raise ConfigError(str(e)) from None
    except ValueError as e:
        raise ConfigError(f"rollout.agent / rollout.agent_options: {_one_line(e)}") from None
    except Exception as e:  # the agent's own checks, in its own words
        raise ConfigError(f"rollout.agent / rollout.agent_options: {_message(e)}") from e


def _check_verifiers(cfg: RunConfig, spec: str) -> None:
    """A verifiers environment's rows are its dataset: the task must be ``verifiers`` on the
    same environment and arguments (engines.agents.verifiers_env)."""
    from engines.imports import require

    require("verifiers", extra="verifiers", what="rollout.agent=verifiers:...")
    t = cfg.task
    same = (
        t.name == "verifiers"
        and t.options.get("environment") == spec
        and dict(t.options.get("env_args") or {}) == dict(cfg.rollout.agent_options)
    )
    if not same:
        raise ValueError(
            f"rollout.agent=verifiers:{spec} draws its prompts from the environment's dataset: "
            f"set task.name=verifiers task.options.environment={spec} (and task.options.env_args "
            f"equal to rollout.agent_options); got task.name={t.name!r}, "
            f"task.options={dict(t.options)!r}"
        )


def _check_task(cfg: RunConfig) -> Task:
    t = cfg.task
    try:
        task = make_task(t.name, seed=t.seed, **t.options)
    except ImportError as e:  # an optional extra the task needs
        raise ConfigError(f"task={t.name}: {_one_line(e)}") from None
    except Exception as e:  # the task's checks and its library's (e.g. a dataset's assert)
        raise ConfigError(_task_error("task", t.name, e)) from e
    clash = sorted(set(task.columns()) & set(RESERVED_COLUMNS))
    if clash:
        raise ConfigError(
            f"task.options: the task's columns {clash} clash with fields the workflow writes "
            f"{list(RESERVED_COLUMNS)}; rename them"
        )
    available = task.num_items()
    needed = cfg.train.steps * cfg.train.groups_per_step
    if available is not None and needed > available:
        raise ConfigError(
            f"train.steps={cfg.train.steps} x train.groups_per_step="
            f"{cfg.train.groups_per_step} needs {needed} prompts but the task gives "
            f"{available} (task.options.epochs); set train.steps <= "
            f"{available // cfg.train.groups_per_step} or raise task.options.epochs"
        )
    return task


def _check_eval(cfg: RunConfig) -> None:
    name, options = cfg.eval.task_spec(cfg.task.name, cfg.task.options)
    try:
        make_task(name, seed=cfg.eval.seed, **options)
    except ImportError as e:
        raise ConfigError(f"eval.task={name}: {_one_line(e)}") from None
    except Exception as e:  # as for the training task
        raise ConfigError(_task_error("eval", name, e)) from e


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _message(e: BaseException) -> str:
    """The library's own message in one line: as written for the config's own errors
    (``ValueError``, ``TypeError``), after the exception's type for any other (an
    ``AssertionError``'s text alone would not say it is one)."""
    text = _one_line(e)
    if isinstance(e, ValueError | TypeError) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _options(e: BaseException, section: str) -> str:
    """:func:`_message` with a task's or environment's ``options.KEY`` named in full
    (``task.options.KEY``), as the command line writes it."""
    return re.sub(r"(?<![\w.])options\.", f"{section}.options.", _message(e))


def _task_error(section: str, name: str, e: BaseException) -> str:
    """``task.options.config of task 'x': why`` where the task names the option it refused,
    else ``task.options of task 'x': why``."""
    text = _options(e, section)
    key, sep, rest = text.partition(": ")
    if sep and re.fullmatch(rf"{section}\.options\.\w+", key):
        return f"{key} of task {name!r}: {rest}"
    return f"{section}.options of task {name!r}: {text}"
