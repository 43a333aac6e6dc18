"""SkyRL-Gym environments (``skyrl-gym`` on PyPI) as environments: ``env.name=skyrl_gym:<id>``.

SkyRL-Gym's text environments are built by ``skyrl_gym.make(id, env_config=..., extras=row)``,
started with ``init(prompt)`` (the prompt as chat messages) and driven with ``step(text)``,
which returns chat messages to show, a reward, ``done`` and metadata. One
:class:`SkyRLGymEnv` wraps one of them for one episode:

| ours (:mod:`engines.envs.base`) | SkyRL-Gym                                                   |
|---------------------------------|-------------------------------------------------------------|
| built                           | ``make(env_id, env_config=env_config, extras=extras)``:     |
|                                 | ``extras`` is the task's row, plus ``reward_spec`` =        |
|                                 | ``{"method": "rule", "ground_truth": str(row["answer"])}``  |
|                                 | and ``extra_info`` = ``{}`` where the row has none, plus    |
|                                 | the ``extras`` option                                       |
| ``reset(row)``                  | ``init([{"role": "user", "content": row["prompt"]}])``;     |
|                                 | messages it adds after the prompt are shown                 |
| ``step(text)``                  | ``step(text)``                                              |
| ``StepResult.observation``      | the contents of ``observations`` (chat messages), one per   |
|                                 | line; the runner writes them in the policy's chat template  |
|                                 | as one message of ``env.observation_role``                  |
| ``reward``, ``done``            | ``reward``, ``done``                                        |
| ``info``                        | the numbers of ``metadata``, and how much each number of    |
|                                 | ``get_metrics()`` changed in the step: summed over the      |
|                                 | episode they are its final ``get_metrics()``                |
| ``close()``                     | ``close()``                                                 |

**Failures.** SkyRL-Gym environments run in this process: an exception raised by ``make``,
``init`` or ``step`` (their own services unreachable, e.g. ``search``'s retriever), like a
``step`` reply without ``reward`` and ``done`` (raised here as
:class:`~engines.envs.base.EnvError`), is an infrastructure failure to the episode runner:
retried on a fresh environment, then ``env_error``. What the model writes that the
environment cannot parse is answered by the environment itself (its reward and observation),
as before.

Messages of several roles in one observation are shown as one message (of
``env.observation_role``): the runner's seam carries text, and the chat template wraps it.

SkyRL-Gym's install is light (pandas, omegaconf, func_timeout, requests) and runs offline;
its ``search``, ``text2sql`` and ``lcb`` environments need their own services or data
(``env_config``). Called by the episode runner (:mod:`engines.episodes.runner`), one
environment per episode, its methods on the runner's worker threads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.envs.base import EnvError, StepResult

__all__ = ["INSTALL_HINT", "SkyRLGymEnv", "check_options"]

INSTALL_HINT = "pip install 'asyncflow[skyrl-gym]'"
"""The one line to type when SkyRL-Gym is missing."""

PREFIX = "skyrl_gym:"
"""``env.name`` of a SkyRL-Gym environment: this prefix, then its registry id."""


def _skyrl_gym() -> Any:
    try:
        import skyrl_gym
    except ImportError:
        raise ValueError(
            f"env.name={PREFIX}<id> needs the skyrl-gym extra: {INSTALL_HINT}"
        ) from None
    return skyrl_gym


def check_options(options: Mapping[str, Any]) -> None:
    """Before a run: SkyRL-Gym importable (else ``ValueError`` with the install line) and
    ``env_id`` in its registry (else ``ValueError`` listing the ids)."""
    gym = _skyrl_gym()
    env_id = options.get("env_id")
    if env_id not in gym.registry:
        raise ValueError(
            f"env.name={PREFIX}{env_id}: no such SkyRL-Gym environment; registered: "
            f"{sorted(gym.registry)}"
        )


def _numbers(values: Any) -> dict[str, float]:
    if not isinstance(values, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def _text(messages: Any, what: str) -> str:
    if isinstance(messages, str):
        return messages
    if not isinstance(messages, list) or not all(
        isinstance(m, Mapping) and isinstance(m.get("content"), str) for m in messages
    ):
        raise TypeError(
            f"skyrl_gym {what} must be a list of chat messages "
            f"({{'role': ..., 'content': str}}), got {str(messages)[:200]!r}"
        )
    return "\n".join(m["content"] for m in messages)


class SkyRLGymEnv:
    """One episode of the SkyRL-Gym environment ``env_id`` (see the module docstring).

    Args:
        env_id: its id in SkyRL-Gym's registry (``env.name=skyrl_gym:<env_id>``).
        env_config: the environment's configuration (an OmegaConf mapping on its side).
        extras: added to every episode's ``extras`` (e.g. ``{"max_turns": 3}``).
    """

    check_options = staticmethod(check_options)
    """The config check's hook (:func:`engines.envs.base.environment_factory`)."""

    def __init__(
        self,
        *,
        env_id: str,
        env_config: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
    ) -> None:
        self.env_id = env_id
        self.env_config = dict(env_config or {})
        self.extras = dict(extras or {})
        self._env: Any = None
        self._metrics: dict[str, float] = {}

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """Make the environment for ``row`` and ``init`` it with the row's prompt."""
        gym = _skyrl_gym()
        from omegaconf import OmegaConf

        extras: dict[str, Any] = dict(row)
        if "reward_spec" not in extras and "answer" in row:
            extras["reward_spec"] = {"method": "rule", "ground_truth": str(row["answer"])}
        extras.setdefault("extra_info", {})
        extras.update(self.extras)
        self.close()
        self._env = gym.make(
            self.env_id, env_config=OmegaConf.create(self.env_config), extras=extras
        )
        prompt = row.get("prompt")
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        )
        first, _ = self._env.init(messages)
        self._metrics = self._get_metrics()
        if first == messages:
            return None
        if not isinstance(first, list) or first[: len(messages)] != messages:
            raise ValueError(
                f"skyrl_gym {self.env_id}: init rewrote the prompt; only messages added after "
                "it can be shown (the prompt's tokens come from the task)"
            )
        return _text(first[len(messages) :], "init's messages") or None

    def step(self, action: str) -> StepResult:
        """One ``step(text)`` of the SkyRL-Gym environment."""
        if self._env is None:
            raise RuntimeError(f"skyrl_gym {self.env_id}: step() before reset()")
        out = self._env.step(action)
        if not isinstance(out, Mapping) or "reward" not in out or "done" not in out:
            raise EnvError(
                f"skyrl_gym {self.env_id}: step returned {str(out)[:200]!r}, not "
                "{observations, reward, done, metadata}"
            )
        done = bool(out["done"])
        info = _numbers(out.get("metadata"))
        metrics = self._get_metrics()
        for k, v in metrics.items():
            delta = v - self._metrics.get(k, 0.0)
            if delta:
                info[k] = info.get(k, 0.0) + delta
        self._metrics = metrics
        text = None if done else _text(out.get("observations") or [], "observations")
        return StepResult(text, reward=float(out["reward"]), done=done, info=info)

    def close(self) -> None:
        """Close the SkyRL-Gym environment (idempotent)."""
        env, self._env = self._env, None
        if env is not None:
            env.close()

    def _get_metrics(self) -> dict[str, float]:
        get = getattr(self._env, "get_metrics", None)
        return _numbers(get()) if callable(get) else {}
