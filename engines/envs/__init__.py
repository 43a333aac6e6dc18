"""Environments: what answers the model between its turns (tools, games, simulators).

:mod:`engines.envs.base` holds the seam (the :class:`Environment` Protocol, its
:class:`StepResult`) and the registry; the episodes that run an environment turn by turn are
in :mod:`engines.episodes`. Built-in environments (``engines.envs.<name>``):

| name             | the model ...                     | reward                          |
|------------------|-----------------------------------|---------------------------------|
| ``tool_use``     | calls a calculator, then answers  | 1 if the answer is right        |
| ``guess_number`` | guesses, is told higher or lower  | 1, minus 0.1 per extra turn     |

From other libraries (optional extras, imported only when named): ``openenv`` (an OpenEnv
server over its WebSocket session, :mod:`engines.envs.openenv`) and ``skyrl_gym:<id>`` (a
SkyRL-Gym environment, :mod:`engines.envs.skyrl_gym`).

Each built-in comes with a task of the same name (``engines.tasks.TASKS``) whose prompts start its
episodes. Your own: any class (or factory) with ``reset(row)`` and ``step(action)``, named by
import path ``module.path:attribute``.
"""

from engines.envs.base import (
    ENVIRONMENTS,
    EnvError,
    EnvFactory,
    Environment,
    StepResult,
    environment_factory,
    environment_recipe,
    register_environment,
)

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
