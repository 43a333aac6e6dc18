"""The agent seam: a program that owns the loop and calls the model through the OpenAI API.

An agent is an ``async`` function, or a class whose instances are (one instance per
episode, built with the seam's keyword options), called once per episode::

    async def agent(row: dict, client: openai.AsyncOpenAI) -> float | None: ...

``row`` is the task's columns (``prompt``, ``answer`` and its extras); ``client`` is the real
``openai.AsyncOpenAI``, its ``base_url`` bound to the episode's session on the endpoint
(:mod:`engines.agents.server`), so every call it makes is recorded
(:mod:`engines.agents.session`); ``model`` is the served name (``policy`` by default). The
agent returns its reward, or None for the reward stage to judge.

:class:`AgentRunner` runs agents where :class:`engines.episodes.EpisodeRunner` runs
environments: the rollout adapter calls ``run(prompt, row, generate, params)`` for each row
and gets an :class:`engines.episodes.Episode` back, the same columns either way. The episode
ends with:

| reason        | when                                                                   |
|---------------|------------------------------------------------------------------------|
| ``done``      | the agent returned (its reward, or None)                               |
| ``max_turns`` | the agent returned after a call was refused for the turn budget        |
| ``max_tokens``| ... after the token budget ran out (a call cut or refused)              |
| ``error``     | the agent raised, or returned something that is not a number or None   |
| ``timeout``   | the agent ran longer than ``timeout_s`` (it is cancelled)              |

An error of the generation engine during a call is not the agent's: ``run`` raises it after
the agent ends, and the rollout generates the batch again. The endpoint starts on the first
episode, on the rollout's event loop, and stops with :meth:`AgentRunner.aclose`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engines.agents.server import OpenAIServer
from engines.episodes.causes import AGENT_RAISED, PROTOCOL_ERROR, CauseLog, cause_of
from engines.episodes.record import Episode
from engines.episodes.runner import EpisodeLimits, TurnGenerate
from engines.imports import import_path, require
from engines.protocols import SamplingParams

__all__ = ["Agent", "AgentRunner", "agent_factory"]

log = logging.getLogger(__name__)

Agent = Callable[[dict[str, Any], Any], Awaitable[float | None]]
"""``async (row, client) -> reward or None``."""


def agent_factory(
    target: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    model: str = "policy",
) -> Callable[[], Agent]:
    """What builds one episode's agent: ``target`` is an async function, a class (an instance
    per episode, ``target(**options)``, must be an async callable), an import path
    ``module.path:attribute`` of either, or ``verifiers:<environment>``
    (:mod:`engines.agents.verifiers_env`: ``options`` are its loader's arguments, ``model``
    the served name it calls). Raises ``ValueError`` naming what is wrong."""
    if isinstance(target, str) and target.startswith("verifiers:"):
        from engines.agents.verifiers_env import agent_from_spec

        return agent_from_spec(target, options, model)
    obj = (
        import_path(target, "agent", target="agent", example="mypkg.agents:solve")
        if isinstance(target, str)
        else target
    )
    opts = dict(options or {})
    if isinstance(obj, type):
        if not inspect.iscoroutinefunction(vars(obj).get("__call__") or obj.__call__):
            raise ValueError(f"agent class {obj.__name__} needs an async __call__(row, client)")
        return lambda: obj(**opts)
    if not inspect.iscoroutinefunction(obj):
        raise ValueError(
            f"agent {target!r} must be an async function (row, client) -> reward, or a class "
            f"of such callables; got {type(obj).__name__}"
        )
    if opts:
        raise ValueError(f"agent {target!r} is a function: it takes no options, got {sorted(opts)}")
    return lambda: obj


class AgentRunner:
    """Runs agent episodes against the endpoint (see the module docstring).

    Args:
        agent: the agent (:func:`agent_factory`'s ``target``).
        tokenizer: the policy's tokenizer.
        limits: the episode's turn and token budgets; ``timeout_s`` bounds the whole agent run.
        options: keyword options of an agent class.
        model: the served model name (what agents put in ``model=``).
        host: where the endpoint listens (loopback by default).
        port: its port (0: a free one).
        api_key: the bearer token it asks of every request (None: none).
        context_tokens: the policy's context: a call whose prompt and asked-for tokens pass it
            gets 400 ``context_length_exceeded`` (None: no bound; see ``OpenAIServer``).
    """

    writes_prompt = True
    """The rollout writes each episode's prompt (the agent's first call's) as ``prompt_ids``."""

    def __init__(
        self,
        agent: str | Callable[..., Any],
        tokenizer: PreTrainedTokenizerBase,
        limits: EpisodeLimits | None = None,
        *,
        options: Mapping[str, Any] | None = None,
        model: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        context_tokens: int | None = None,
    ) -> None:
        require("openai", extra="agents", what="the agent seam (rollout.agent)")
        require("aiohttp", extra="agents", what="the agent seam (rollout.agent)")
        self.factory = agent_factory(agent, options, model=model)
        self.limits = limits or EpisodeLimits()
        self.server = OpenAIServer(
            tokenizer,
            model=model,
            host=host,
            port=port,
            api_key=api_key,
            context_tokens=context_tokens,
        )
        self._http: Any = None
        self._causes = CauseLog(log, "an agent episode's try failed (env_error)")
        self._started: asyncio.Task[str] | None = None

    async def _start(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self.server.start())
        await asyncio.shield(self._started)
        if self._http is None:
            import openai

            self._http = openai.DefaultAsyncHttpxClient()

    def client(self, base_url: str) -> Any:
        """An ``openai.AsyncOpenAI`` on ``base_url`` (sharing one connection pool)."""
        import openai

        return openai.AsyncOpenAI(
            base_url=base_url,
            api_key=self.server.api_key or "none",
            max_retries=0,
            timeout=self.limits.timeout_s,
            http_client=self._http,
        )

    async def run(
        self,
        prompt: torch.Tensor,
        row: Mapping[str, Any],
        generate: TurnGenerate,
        params: SamplingParams,
    ) -> Episode:
        """One agent episode (``prompt``, the row's prompt ids, stands when the agent never
        calls the model); its calls go through ``generate`` (the batch's instance)."""
        await self._start()
        lim = self.limits
        # The agent's whole run is the policy's budget (episode_timeout_s, else timeout_s):
        # past it the episode ends ``timeout`` and is trained with ``timeout_reward``. An agent
        # that raises or returns a bad reward failed as infrastructure (``env_error``): tried
        # again from the start on a fresh session, up to ``retries`` times (the environments'
        # taxonomy, engines.episodes.runner).
        timeout = lim.episode_timeout_s if lim.episode_timeout_s is not None else lim.timeout_s
        retries = 0
        failures: dict[str, int] = {}
        messages: dict[str, str] = {}
        for attempt in range(lim.retries + 1):
            session = self.server.open_session(generate, params, lim)
            reward: float | None = None
            end: str | None = None
            error: str | None = None
            cause = AGENT_RAISED
            bound: asyncio.Timeout | None = None
            try:
                agent = self.factory()
                async with asyncio.timeout(timeout) as bound:
                    result = await agent(dict(row), self.client(self.server.base_url(session)))
                reward = _reward(result)
            except _BadReward as e:
                end, error, cause = "env_error", str(e), PROTOCOL_ERROR
            except Exception as e:  # the agent's failure ends its episode only
                if bound is not None and bound.expired():
                    end, error = "timeout", f"the agent ran longer than {timeout} s"
                else:
                    end, error = "env_error", f"the agent raised {type(e).__name__}: {e}"
                    cause = cause_of(e, default=AGENT_RAISED)
            finally:
                self.server.end_session(session)
            if session.failure is not None:  # the engine's, not the agent's
                raise session.failure
            if end == "env_error":
                assert error is not None
                failures[cause] = failures.get(cause, 0) + 1
                messages.setdefault(cause, error)
                self._causes.report(cause, f"try {attempt + 1}: {error}")
            if end == "env_error" and attempt < lim.retries:
                retries += 1
                continue
            break
        if end is not None:
            log.debug("agent episode ended (%s): %s", end, error)
        episode = session.episode(reward, end, error)
        if end == "timeout":
            episode.final_reward = lim.timeout_reward
        episode.stats = {
            **episode.stats,
            "retries": retries,
            "failures": failures,
            "failure_messages": messages,
            "refused": dict(session.refused),
        }
        if episode.prompt_ids is None:
            episode.prompt_ids = prompt.long()
        return episode

    async def aclose(self) -> None:
        """Stop the endpoint and the client pool (idempotent)."""
        http, self._http = self._http, None
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()
        await self.server.close()

    def close(self) -> None:
        """Nothing to do off the loop (the rollout calls :meth:`aclose`)."""


class _BadReward(Exception):
    pass


def _reward(result: object) -> float | None:
    if result is None:
        return None
    if isinstance(result, bool) or not isinstance(result, int | float) or not math.isfinite(result):
        raise _BadReward(f"the agent returned {result!r}, not a finite number or None")
    return float(result)
