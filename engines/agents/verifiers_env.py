"""verifiers environments as agents: their own rollout against the endpoint, their rubric as
the reward, their dataset as the prompts.

A `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment owns its loop: it
calls a model through an OpenAI client, runs its tools or its user turns, and scores the
finished rollout with its :class:`Rubric`. That is an agent (:mod:`engines.agents.runner`),
so the run names it as one::

    rollout.agent=verifiers:mypkg.envs:load_environment   # module:attribute
    rollout.agent=verifiers:gsm8k                         # an installed environment's id
    task.name=verifiers task.options.environment=<the same>

``module:attribute`` is an ``Environment`` or a function returning one (``load_environment``,
called with ``rollout.agent_options`` as keyword arguments); a bare id is loaded with
verifiers' own ``load_environment``. The task ``verifiers`` (:class:`VerifiersTask`) serves
the environment's dataset as the rows (``prompt`` its chat messages, ``answer``, ``info``,
``task``, ``example_id``); each episode :class:`VerifiersAgent` hands the row to the
environment's ``run_rollout`` with a verifiers ``OpenAIChatCompletionsClient`` wrapping the
episode's ``openai.AsyncOpenAI`` (``base_url`` on the episode's session), and returns the
rubric's reward. The tokens are the session's record of what the engine sampled (never the
environment's text tokenized again): the model's turns under the loss mask, the tool results
and user turns it added off it.

**API generation.** The classic ``Environment.rollout`` API (``SingleTurnEnv``, ``ToolEnv``,
``MultiTurnEnv``, ``Rubric``; ``verifiers.legacy`` in 0.3, aliased at ``verifiers.*``):
rollouts run in this process against any OpenAI ``base_url``. verifiers 0.4's v1 API runs
each environment's harness in an environment of its own built by ``uv`` at run time (a
download per run) and pins ``openai<3``; the ``verifiers`` extra pins ``>=0.3,<0.4``.

verifiers is imported when a runner or a task is built (the ``verifiers`` extra).
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from engines.imports import MissingExtraError, import_path, require
from engines.tasks import Task, TaskItem

__all__ = [
    "PREFIX",
    "VerifiersAgent",
    "VerifiersTask",
    "VerifiersTaskConfig",
    "load_environment",
    "require_verifiers",
]

PREFIX = "verifiers:"
"""``rollout.agent`` values starting with it name a verifiers environment."""
_CACHE: dict[str, Any] = {}
_BUILD = threading.Lock()


def require_verifiers(what: str = "verifiers environments (rollout.agent=verifiers:...)") -> Any:
    """The ``verifiers`` package with its classic API, or :class:`MissingExtraError` with the
    ``pip install`` line."""
    vf = require("verifiers", extra="verifiers", what=what)
    if not hasattr(vf, "Environment") or not hasattr(vf, "OpenAIChatCompletionsClient"):
        raise MissingExtraError(
            f"{what}: verifiers {getattr(vf, '__version__', '?')} lacks the classic "
            "Environment API; pip install 'asyncflow[verifiers]' (verifiers>=0.3,<0.4)"
        )
    return vf


def load_environment(spec: str, env_args: Mapping[str, Any] | None = None) -> Any:
    """The environment ``spec`` names (``module:attribute`` or an installed id, see the module
    docstring), built once per process and arguments. Raises ``ValueError`` naming what is
    wrong."""
    vf = require_verifiers()
    args = dict(env_args or {})
    key = f"{spec}|{json.dumps(args, sort_keys=True, default=repr)}"
    if key in _CACHE:
        return _CACHE[key]
    with _BUILD, _keeping_signal_handlers(vf):
        env = _build(vf, spec, args)
    _CACHE[key] = env
    return env


@contextlib.contextmanager
def _keeping_signal_handlers(vf: Any) -> Iterator[None]:
    """verifiers' ``Environment.__init__`` installs SIGINT/SIGTERM handlers, which fails off
    the main thread (where the rollout and the data loader build it) and would take the run's
    own handling of SIGTERM (drain and checkpoint) away: skipped while it builds (its teardown
    stays registered with ``atexit``)."""
    module = sys.modules.get(vf.Environment.__module__)
    if module is None or getattr(module, "signal", None) is not signal:
        yield
        return
    shim = types.SimpleNamespace(**{k: getattr(signal, k) for k in dir(signal) if k.isupper()})
    shim.signal = lambda *args: None
    shim.default_int_handler = signal.default_int_handler
    module.signal = shim  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.signal = signal  # type: ignore[attr-defined]


def _build(vf: Any, spec: str, args: dict[str, Any]) -> Any:
    if ":" in spec:
        obj = import_path(
            spec, "verifiers environment", target="rollout.agent", example="mypkg.envs:env"
        )
        if isinstance(obj, vf.Environment):
            if args:
                raise ValueError(
                    f"verifiers environment {spec!r} is an instance: it takes no "
                    f"rollout.agent_options, got {sorted(args)}"
                )
            env = obj
        elif callable(obj):
            env = obj(**args)
        else:
            raise ValueError(
                f"verifiers environment {spec!r} is a {type(obj).__name__}: expected a "
                "verifiers Environment or a function returning one"
            )
    else:
        env = vf.load_environment(spec, **args)
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"verifiers environment {spec!r} gave a {type(env).__name__}, not a verifiers "
            "Environment (the classic API: SingleTurnEnv, ToolEnv, MultiTurnEnv...)"
        )
    return env


class VerifiersAgent:
    """One episode of a verifiers environment (an agent of :mod:`engines.agents.runner`).

    Args:
        environment: the environment's spec (``module:attribute`` or an id).
        model: the served model name (``rollout.agent_model``).
        env_args: keyword arguments of its loader (``rollout.agent_options``).
    """

    def __init__(
        self,
        environment: str,
        *,
        model: str = "policy",
        env_args: Mapping[str, Any] | None = None,
    ) -> None:
        self.vf = require_verifiers()
        self.env = load_environment(environment, env_args)
        self.model = model

    async def __call__(self, row: dict[str, Any], client: Any) -> float | None:
        """Run the environment's rollout on ``row`` through ``client`` (the episode's
        ``openai.AsyncOpenAI``); the rubric's reward (None when it gave none)."""
        sampling: dict[str, Any] = {
            k: v for k, v in dict(self.env.sampling_args or {}).items() if k != "n"
        }
        out = await self.env.run_rollout(
            rollout_input(row), self.vf.OpenAIChatCompletionsClient(client), self.model, sampling
        )
        error = out.get("error")
        if isinstance(error, Mapping) and error.get("error") in _infra_errors(self.vf):
            # the environment's infrastructure (a sandbox, a tunnel), not the policy: the
            # episode ends env_error and is tried again (the environments' failure taxonomy)
            raise RuntimeError(f"verifiers {error.get('error')}: {error.get('message')}")
        reward = out.get("reward")
        return None if reward is None else float(reward)


def _infra_errors(vf: Any) -> set[str]:
    """Names of verifiers' ``InfraError`` and its subclasses. Its other errors (the model's
    response unusable, a tool call that fails) are the policy's: the rubric's reward stands."""
    base = getattr(vf, "InfraError", None)
    names: set[str] = set()
    todo = [base] if isinstance(base, type) else []
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    return names


def agent_from_spec(
    target: str, options: Mapping[str, Any] | None, model: str
) -> Callable[[], VerifiersAgent]:
    """What :func:`engines.agents.agent_factory` builds for ``verifiers:<spec>``: the
    environment is loaded here, once; each episode gets an agent sharing it."""
    spec = target[len(PREFIX) :].strip()
    if not spec:
        raise ValueError(
            "rollout.agent=verifiers: names no environment; e.g. "
            "rollout.agent=verifiers:mypkg.envs:load_environment or verifiers:<environment id>"
        )
    agent = VerifiersAgent(spec, model=model, env_args=options)
    return lambda: agent


def rollout_input(row: Mapping[str, Any]) -> dict[str, Any]:
    """The verifiers ``RolloutInput`` of a row of :class:`VerifiersTask`."""
    out: dict[str, Any] = {"prompt": row["prompt"], "example_id": int(row.get("example_id", 0))}
    if row.get("answer") is not None:
        out["answer"] = row["answer"]
    for key in ("info", "task"):  # JSON objects, written as JSON text (empty: none)
        value = row.get(key)
        if isinstance(value, str):
            value = json.loads(value) if value else None
        if value is not None:
            out[key] = value
    return out


@dataclass(kw_only=True, frozen=True)
class VerifiersTaskConfig:
    """The rows of a verifiers environment's dataset."""

    environment: str
    """The environment: ``module:attribute`` or an installed id (as in ``rollout.agent``)."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of its loader (``rollout.agent_options``: the same)."""
    split: str = "train"
    """``train`` (its ``dataset``) or ``eval`` (its ``eval_dataset``)."""
    shuffle: bool = True
    """Each epoch in an order of its own (drawn from the seed and the epoch)."""
    reference_key: str | None = None
    """The dataset column holding a correct first model turn (the tiny model's warm start,
    ``model.warm_start_steps``, trains on it); None: the ``answer`` column as text."""

    def __post_init__(self) -> None:
        if self.split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {self.split!r}")


class VerifiersTask(Task):
    """Task ``verifiers``: item ``i`` is row ``perm_e[i mod N]`` of the environment's dataset
    in epoch ``e = i // N`` (endless; see :class:`engines.file_task.FileTask` for the rule)."""

    name = "verifiers"
    config_class = VerifiersTaskConfig

    def __init__(self, config: VerifiersTaskConfig, *, seed: int = 0) -> None:
        super().__init__(seed)
        self.config = config
        env = load_environment(config.environment, config.env_args)
        data = env.get_dataset() if config.split == "train" else env.get_eval_dataset()
        self.rows: list[dict[str, Any]] = [dict(r) for r in data]
        if not self.rows:
            raise ValueError(f"verifiers environment {config.environment!r}: empty dataset")
        self._perms: dict[int, list[int]] = {}

    def spec(self) -> dict[str, Any]:
        c = self.config
        return {"name": self.name, "seed": self.seed, "config": asdict(c)}

    @classmethod
    def config_columns(cls, config: Any) -> tuple[str, ...]:
        return ("answer", "info", "task", "example_id")

    def item(self, index: int) -> TaskItem:
        if index < 0:
            raise ValueError(f"item index must be >= 0, got {index}")
        n = len(self.rows)
        epoch, pos = divmod(index, n)
        if epoch not in self._perms:
            perm = list(range(n))
            if self.config.shuffle:
                random.Random(f"verifiers:{self.seed}:{epoch}").shuffle(perm)
            self._perms = {epoch: perm}
        row = self.rows[self._perms[epoch][pos]]
        extra = {
            "info": _json(row.get("info")),
            "task": _json(row.get("task")),
            "example_id": int(row.get("example_id", pos)),
        }
        key = self.config.reference_key
        if key is not None and key not in row:
            raise ValueError(
                f"task.options.reference_key={key!r}: the dataset of "
                f"{self.config.environment!r} has no such column; it has {sorted(row)}"
            )
        answer = row.get("answer", "")
        reference = str(row[key] if key is not None else answer)
        return TaskItem(prompt=row["prompt"], answer=answer, reference=reference, extra=extra)


def _json(value: Any) -> str:
    """A row's ``info`` or ``task`` as a column: JSON text of an object, or empty."""
    if isinstance(value, str):
        value = json.loads(value) if value.strip().startswith("{") else None
    return json.dumps(value) if isinstance(value, dict) and value else ""
