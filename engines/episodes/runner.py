"""The turn loop: one episode of a model and an environment.

    reset(row) -> [observation] -> turn 0 -> step -> observation -> turn 1 -> step -> ... -> end

Each turn, the generation engine is given the conversation so far as one token sequence (the
prompt, then every token of the episode: its own earlier turns exactly as it sampled them and
the observations between them, :mod:`engines.episodes.format`), so an engine with prefix
caching (vLLM) reuses the work of the previous turn. A turn's ``max_new_tokens`` is the
sampling parameters' cap, lowered to what is left of the episode's token budget.

An episode ends, with its reason (:data:`engines.episodes.record.END_REASONS`):

| reason       | when                                                                     |
|--------------|--------------------------------------------------------------------------|
| ``done``     | the environment's step said so (no environment: after the one turn)      |
| ``max_turns``| ``max_turns`` turns taken and the environment not done                   |
| ``max_tokens``| the episode's tokens (turns and observations) reached ``max_tokens``    |
| ``error``    | building the environment, ``reset``, ``step`` or ``close`` raised, or    |
|              | returned something malformed (not a ``StepResult``, a reward that is not |
|              | a finite number, a first observation that is not text)                   |
| ``timeout``  | one of those calls took longer than ``timeout_s``                        |

``error`` and ``timeout`` end only the episode: the runner returns it (its return is NaN, "no
verdict": trained with advantage 0, see the train adapter) and the run goes on. An error of
the *generation engine* is not the environment's: it propagates to the caller (the rollout
then generates the batch again elsewhere).

Plain (non-async) environment methods run on the runner's own threads (``threads`` daemon
threads), never on the event loop and never in the default executor that other stages share;
a call stuck past its bound is abandoned (its thread stays busy until it returns: threads all
stuck make later calls of this runner time out too, never anything else, and being daemons
they never keep the process from exiting).

Called by the rollout adapter (``adapters.rollout``) for every episode of a batch, with a
``generate`` that sends the turn to the batch's engine instance (``TurnBatcher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import queue
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from engines.envs.base import EnvFactory, StepResult
from engines.episodes.format import TurnFormat
from engines.episodes.record import Episode, EpisodeBuilder
from engines.protocols import Generation, SamplingParams

__all__ = ["EpisodeLimits", "EpisodeRunner", "EpisodeSource", "TurnGenerate"]

log = logging.getLogger(__name__)

TurnGenerate = Callable[[torch.Tensor, SamplingParams], Awaitable[Generation]]
"""Samples one turn: ``(conversation so far [L] int64, params) -> Generation``."""


class EpisodeSource(Protocol):
    """What the rollout adapter runs a row's episode with: an :class:`EpisodeRunner`
    (environments) or an ``engines.agents.AgentRunner`` (agents)."""

    def run(
        self,
        prompt: torch.Tensor,
        row: Mapping[str, Any],
        generate: TurnGenerate,
        params: SamplingParams,
    ) -> Awaitable[Episode]:
        """One episode of the row (``prompt``: its prompt ids), its turns through ``generate``
        (the batch's instance). Called by the rollout adapter for every row of a batch."""
        ...

    def close(self) -> None:
        """Release what the source holds (the adapter calls it when the stage stops)."""
        ...


@dataclass(kw_only=True, frozen=True)
class EpisodeLimits:
    """Bounds of one episode."""

    max_turns: int = 4
    """Model turns at most."""
    max_tokens: int = 256
    """Tokens after the prompt at most: the model's and the observations' together."""
    timeout_s: float = 10.0
    """Bound of each environment call (build, ``reset``, ``step``, ``close``)."""
    max_observation_tokens: int = 64
    """Tokens of one observation's text at most; a longer one is truncated with a marker."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1 or self.max_observation_tokens < 1:
            raise ValueError(
                "max_turns, max_tokens and max_observation_tokens must be >= 1, got "
                f"{self.max_turns}, {self.max_tokens}, {self.max_observation_tokens}"
            )
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")


class _EnvFailure(Exception):
    """An environment call failed: ``reason`` is ``error`` or ``timeout``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EpisodeRunner:
    """Runs episodes of one environment (see the module docstring).

    Args:
        factory: builds one environment per episode; None: one-turn episodes (no
            environment).
        turn_format: how observations become tokens and turns become text.
        limits: the episode's bounds.
        threads: workers for plain environment methods.
    """

    def __init__(
        self,
        factory: EnvFactory | None,
        turn_format: TurnFormat,
        limits: EpisodeLimits | None = None,
        *,
        threads: int = 4,
    ) -> None:
        self.factory = factory
        self.format = turn_format
        self.limits = limits or EpisodeLimits()
        self._pool = _Workers(threads)
        self._finalizer = weakref.finalize(self, self._pool.close)

    def close(self) -> None:
        """Stop the thread pool (idempotent; calls still running finish on their own)."""
        self._finalizer()

    async def run(
        self,
        prompt: torch.Tensor,
        row: Mapping[str, Any],
        generate: TurnGenerate,
        params: SamplingParams,
    ) -> Episode:
        """One episode of ``prompt`` (its token ids) and ``row`` (the task's columns)."""
        lim = self.limits
        prompt = prompt.long()
        episode = EpisodeBuilder(judged=self.factory is not None)
        if self.factory is None:
            gen = await generate(prompt, self._capped(params, lim.max_tokens))
            episode.add_turn(gen)
            return episode.finish("done" if gen.finish_reason == "stop" else "max_tokens")
        env: Any = None
        try:
            env = await self._call("building the environment", self.factory)
            first = await self._call("reset", env.reset, row)
            if first is not None:
                if not isinstance(first, str):
                    raise _EnvFailure("error", f"reset returned {type(first).__name__}, not text")
                ids = self._observation(episode, first, after_eos=False)
                if episode.length + len(ids) >= lim.max_tokens:
                    return episode.finish("max_tokens")
                episode.add_observation(ids)
            for turn in range(lim.max_turns):
                left = lim.max_tokens - episode.length
                conversation = torch.cat([prompt, episode.sequence()])
                gen = await generate(conversation, self._capped(params, left))
                episode.add_turn(gen)
                if episode.length >= lim.max_tokens:
                    return episode.finish("max_tokens")
                action = self.format.decode(gen.token_ids.tolist())
                result = await self._call("step", env.step, action)
                _check_result(result)
                episode.reward(result.reward, result.info)
                if result.done:
                    return episode.finish("done")
                if turn == lim.max_turns - 1:
                    break
                ended = (
                    gen.token_ids.numel() > 0 and int(gen.token_ids[-1]) == self.format.eos_token_id
                )
                ids = self._observation(episode, result.observation or "", after_eos=ended)
                if episode.length + len(ids) >= lim.max_tokens:
                    return episode.finish("max_tokens")
                episode.add_observation(ids)
            return episode.finish("max_turns")
        except _EnvFailure as failure:
            log.debug("episode ended (%s): %s", failure.reason, failure)
            return episode.finish(failure.reason, str(failure))
        finally:
            if env is not None:
                await self._close(env)

    def _observation(self, episode: EpisodeBuilder, text: str, *, after_eos: bool) -> list[int]:
        ids, truncated = self.format.observation(
            text, after_eos=after_eos, max_tokens=self.limits.max_observation_tokens
        )
        if truncated:
            episode.count("truncated_observations")
        return ids

    @staticmethod
    def _capped(params: SamplingParams, left: int) -> SamplingParams:
        if params.max_new_tokens <= left:
            return params
        return replace(params, max_new_tokens=max(left, 1))

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` within the bound, in the pool unless it is a coroutine function;
        any failure becomes an :class:`_EnvFailure`."""
        timeout = self.limits.timeout_s
        try:
            async with asyncio.timeout(timeout):
                if inspect.iscoroutinefunction(fn):
                    return await fn(*args)
                loop = asyncio.get_running_loop()
                result = await self._pool.submit(loop, functools.partial(fn, *args))
                if inspect.isawaitable(result):
                    result = await result
                return result
        except TimeoutError:
            raise _EnvFailure("timeout", f"{what} took longer than timeout_s={timeout}") from None
        except _EnvFailure:
            raise
        except Exception as e:
            raise _EnvFailure("error", f"{what} raised {type(e).__name__}: {e}") from None

    async def _close(self, env: Any) -> None:
        close = getattr(env, "close", None)
        if not callable(close):
            return
        try:
            await self._call("close", close)
        except _EnvFailure as failure:  # the episode is over either way
            log.warning("closing an environment failed: %s", failure)


class _Workers:
    """Daemon threads for plain environment methods. ``concurrent.futures`` joins its workers
    when the interpreter exits, so one environment call stuck for good would keep the process
    from ever exiting; a daemon thread does not. Threads start with the first call."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._size = threads
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        if self._closed:
            raise RuntimeError("the episode runner is closed")
        if not self._threads:
            for i in range(self._size):
                t = threading.Thread(target=self._work, name=f"env-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.put((loop, future, fn))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, fn = item
            try:
                outcome, ok = fn(), True
            except BaseException as e:  # handed to the awaiting coroutine
                outcome, ok = e, False
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, outcome, ok)

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)


def _settle(future: asyncio.Future[Any], outcome: Any, ok: bool) -> None:
    if future.done():  # abandoned after its bound
        return
    if ok:
        future.set_result(outcome)
    else:
        future.set_exception(outcome)


def _check_result(result: object) -> None:
    if not isinstance(result, StepResult):
        raise _EnvFailure("error", f"step returned {type(result).__name__}, not a StepResult")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise _EnvFailure("error", f"step returned reward {reward!r}, not a finite number")
    if result.observation is not None and not isinstance(result.observation, str):
        raise _EnvFailure(
            "error", f"step returned an observation of {type(result.observation).__name__}"
        )
    if not isinstance(result.info, dict):
        raise _EnvFailure("error", f"step returned info of {type(result.info).__name__}")
