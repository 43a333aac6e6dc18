"""The environment seam: a small Protocol, its step result, and the registry of environments.

An environment is what answers the model between its turns: a tool (a calculator, a code
runner), a game, a simulator. One environment object serves one episode:

| who                              | calls                  | when                               |
|----------------------------------|------------------------|------------------------------------|
| the episode runner               | ``factory()``          | once per episode, before anything  |
| (``engines.episodes``)           | ``reset(row)``         | once, before the model's first turn|
|                                  | ``step(action)``       | after every model turn, with the   |
|                                  |                        | turn's decoded text                |
|                                  | ``close()`` (optional) | once, when the episode has ended   |

``reset`` and ``step`` may be plain methods or coroutines. Plain methods run in a worker
thread of the runner's own pool, so a slow one never blocks the event loop; every call is
bounded by the runner's ``timeout_s``. An environment that raises, hangs past the bound, or
returns something that is not a :class:`StepResult` has failed as *infrastructure*
(``env_error``): the runner plays the episode again from its start on a fresh environment, and
if every try fails the episode's whole group is dropped and another prompt takes its place,
never trained (see :mod:`engines.episodes.runner`). An environment (or an integration speaking
to a server) says so explicitly by raising :class:`EnvError` ("the server closed the session").
Text the model writes that the environment cannot use (a malformed tool call) is not a
failure: the environment answers it like any other action (an error message as the
observation, or the end of the episode with no reward), and it is trained.

Built-in environments by name (:data:`ENVIRONMENTS`), or any class or factory by import path
``module.path:attribute``, built with keyword options: :func:`environment_factory`. An
environment class may declare the settings its episodes need (a ``recipe`` class attribute,
:class:`engines.recipe.Recipe`: tokens per turn, turns): :func:`environment_recipe`. Those
from other libraries (one module each, their library imported only when used):

| ``env.name``       | module                          | extra         |
|--------------------|---------------------------------|---------------|
| ``openenv``        | :mod:`engines.envs.openenv`     | ``openenv``   |
| ``skyrl_gym:<id>`` | :mod:`engines.envs.skyrl_gym`   | ``skyrl-gym`` |

A target with a ``check_options(options)`` attribute has it called by
:func:`environment_factory`, so a missing extra or a bad option fails before a run starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engines.imports import import_path
from engines.names import unknown_name
from engines.recipe import Recipe

__all__ = [
    "ENVIRONMENTS",
    "EnvError",
    "EnvFactory",
    "Environment",
    "StepResult",
    "environment_factory",
    "environment_recipe",
    "register_environment",
]


class EnvError(RuntimeError):
    """The environment's infrastructure failed, not the policy: a server unreachable or
    gone, a session closed under the episode, a reply that does not parse.

    Raised by environments and integrations from ``reset``, ``step`` or their constructor
    (any other exception there is treated the same way; this one says it on purpose and
    carries a message meant for the run's log). The episode runner raises it too, for a call
    past its bound and for a malformed answer. Its episode is retried on a fresh environment
    and, failing that, ends ``env_error`` and its group is dropped (never trained).

    ``cause`` says why, for the run's counts and log (:mod:`engines.episodes.causes`:
    ``connection_refused``, ``connection_lost``, ``timeout``, ``protocol_error``, or
    ``env_raised``, the default)."""

    def __init__(self, message: str, *, cause: str = "env_raised") -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class StepResult:
    """What an environment answers to one model turn."""

    observation: str | None = None
    """Text shown to the model before its next turn (None: nothing; ignored when ``done``)."""
    reward: float = 0.0
    """Reward of this turn; an episode's return is the sum over its turns."""
    done: bool = False
    """The episode is over (solved, failed, or given up): no further turn."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to count (e.g. ``{"tool_call": True}``); numbers are summed per episode."""


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring for who calls what, and when)."""

    def reset(self, row: Mapping[str, Any]) -> str | Awaitable[str | None] | None:
        """Start the episode of ``row`` (the task's columns: ``prompt``, ``answer`` and its
        extras). Returns text shown to the model after the prompt and before its first turn,
        or None (the prompt alone)."""
        ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Answer one model turn (its decoded text, special tokens removed)."""
        ...


EnvFactory = Callable[[], Environment]
"""Builds a fresh environment for one episode (picklable when it is a class or a partial)."""

ENVIRONMENTS: dict[str, str] = {
    "tool_use": "engines.envs.tool_use:ToolUseEnv",
    "guess_number": "engines.envs.guess_number:GuessNumberEnv",
    "openenv": "engines.envs.openenv:OpenEnvClient",
}
"""Built-in environments by name, as import paths (imported only when used)."""


SKYRL_GYM_PREFIX = "skyrl_gym:"
_OR_PATH = ", or an import path 'module.path:attribute'"
"""``env.name`` prefix of SkyRL-Gym environments (``skyrl_gym:<id>``)."""


def register_environment(name: str, path: str) -> None:
    """Add a built-in name for the environment at import path ``path``; a name already taken
    raises ``ValueError``."""
    if name in ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is already registered ({ENVIRONMENTS[name]})")
    if ":" not in path:
        raise ValueError(f"environment path {path!r} must look like 'module.path:attribute'")
    ENVIRONMENTS[name] = path


def _import(path: str) -> Any:
    return import_path(path, "environment", target="attribute", example="mypkg.envs:MazeEnv")


@dataclass(frozen=True)
class _Factory:
    """A picklable factory: the target imported where the factory is called (a Ray actor
    builds its environments from the name, not from an object pickled in the driver)."""

    path: str
    options: tuple[tuple[str, Any], ...]

    def __call__(self) -> Environment:
        env: Environment = _import(self.path)(**dict(self.options))
        return env


def environment_factory(name: str, options: Mapping[str, Any] | None = None) -> EnvFactory:
    """The factory of environment ``name`` (a built-in, ``skyrl_gym:<id>``, or
    ``module.path:attribute``) with keyword ``options``.

    Checks what it can without building an environment, so that a bad name or option fails
    before a run starts: the name (``ValueError`` listing the built-ins), the import, that the
    target is callable, the option names against its signature, that a class has ``reset``
    and ``step``, and the target's own ``check_options(options)`` where it has one (its
    missing extra, its option values).
    """
    opts = dict(options or {})
    if name.startswith(SKYRL_GYM_PREFIX):
        path = "engines.envs.skyrl_gym:SkyRLGymEnv"
        opts["env_id"] = name[len(SKYRL_GYM_PREFIX) :]
    elif ":" in name:
        path = name
    else:
        try:
            path = ENVIRONMENTS[name]
        except KeyError:
            raise ValueError(
                unknown_name("environment", name, ENVIRONMENTS, other=_OR_PATH)
            ) from None
    target = _import(path)
    if not callable(target):
        raise ValueError(
            f"environment {name!r} ({path}) is a {type(target).__name__}, not callable"
        )
    try:
        inspect.signature(target).bind(**opts)
    except TypeError as e:
        raise ValueError(f"environment {name!r}: bad options {sorted(opts)}: {e}") from None
    except ValueError:  # no signature to check (a builtin): building it below checks
        pass
    if isinstance(target, type):
        missing = [m for m in ("reset", "step") if not callable(getattr(target, m, None))]
        if missing:
            raise ValueError(
                f"environment {name!r} ({path}) is a class without {missing}; an environment "
                "needs reset(row) and step(action)"
            )
    check = getattr(target, "check_options", None)
    if callable(check):
        check(opts)
    return _Factory(path, tuple(sorted(opts.items())))


def environment_recipe(name: str) -> Recipe:
    """The :class:`~engines.recipe.Recipe` that environment ``name`` (a built-in or an import
    path) declares as its class attribute ``recipe``; an empty one if it declares none.

    Called by the run's config loader when it lays out a run's defaults. Raises
    ``ValueError`` for an unknown name or a failed import, as :func:`environment_factory`.
    """
    path = name if ":" in name else ENVIRONMENTS.get(name)
    if path is None:
        raise ValueError(unknown_name("environment", name, ENVIRONMENTS, other=_OR_PATH))
    recipe = getattr(_import(path), "recipe", None)
    if recipe is None:
        return Recipe()
    if not isinstance(recipe, Recipe):
        raise ValueError(
            f"environment {name!r} ({path}): its recipe must be an engines.recipe.Recipe, got "
            f"{type(recipe).__name__}"
        )
    return recipe
