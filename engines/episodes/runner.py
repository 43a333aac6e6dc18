"""The turn loop: one episode of a model and an environment.

    reset(row) -> [observation] -> turn 0 -> step -> observation -> turn 1 -> step -> ... -> end

Each turn, the generation engine is given the conversation so far as one token sequence (the
prompt, then every token of the episode: its own earlier turns exactly as it sampled them and
the observations between them, :mod:`engines.episodes.format`), so an engine with prefix
caching (vLLM) reuses the work of the previous turn. A turn's ``max_new_tokens`` is the
sampling parameters' cap, lowered to what is left of the episode's token budget.

An episode ends, with its reason (:data:`engines.episodes.record.END_REASONS`):

| reason        | when                                                   | trained?               |
|---------------|--------------------------------------------------------|------------------------|
| ``done``      | the environment's step said so (no environment: after  | yes, its return        |
|               | the one turn)                                          |                        |
| ``max_turns`` | ``max_turns`` turns taken and the environment not done | yes, its return        |
| ``max_tokens``| the episode's tokens (turns and observations) reached  | yes, its return        |
|               | ``max_tokens``                                         |                        |
| ``timeout``   | the policy took too long: the episode's wall-clock     | yes, with              |
|               | budget ``episode_timeout_s`` ran out (checked after    | ``timeout_reward``     |
|               | each turn and each environment answer)                 |                        |
| ``env_error`` | the environment's infrastructure failed on every one   | no: NaN, its group is  |
|               | of ``1 + retries`` tries: building it, ``reset`` or    | dropped and refilled   |
|               | ``step`` raised (:class:`engines.envs.EnvError` or any | (``adapters.train``)   |
|               | other exception), took longer than ``timeout_s``, or   |                        |
|               | answered something malformed (not a ``StepResult``, a  |                        |
|               | reward that is not a finite number, a first            |                        |
|               | observation that is not text)                          |                        |

A failed try is thrown away whole and the episode starts again from its prompt on a fresh
environment (its tokens, rewards and counters are the last try's); only the count of retries
survives (``Episode.stats``). Text the model writes that the environment cannot use is no
failure: the environment answers it. ``env_error`` ends only the episode, never the run. An
error of the *generation engine* is not the environment's: it propagates to the caller (the
rollout then generates the batch again elsewhere).

``max_concurrent`` bounds the environments open at once in this runner (one rollout worker):
an episode waits for a slot before building its environment and frees it after ``close``.

Each episode records how its time went (:class:`EpisodeStats`, in ``Episode.stats``): the
latency of every ``reset`` and ``step`` call, the seconds it waited on the engine (its turns)
and on the environment (every environment call), its retries, and each failed try's cause
(:mod:`engines.episodes.causes`: refused, lost, timeout, protocol error, the environment
raised) with the first message of each; the train stage sums them per step
(``adapters.episodes.EpisodeTally``). The first failure of each cause in a runner is logged
at WARNING with its message, later ones at most once a minute per cause.

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
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import torch

from engines.envs.base import EnvError, EnvFactory, StepResult
from engines.episodes.causes import PROTOCOL_ERROR, TIMEOUT, CauseLog, cause_of
from engines.episodes.format import TurnFormat
from engines.episodes.record import Episode, EpisodeBuilder
from engines.protocols import Generation, SamplingParams

__all__ = ["EpisodeLimits", "EpisodeRunner", "EpisodeSource", "EpisodeStats", "TurnGenerate"]

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
    """Bound of each environment call (build, ``reset``, ``step``, ``close``); a call past it
    is an infrastructure failure (``env_error`` once the retries are spent)."""
    max_observation_tokens: int = 64
    """Tokens of one observation's text at most; a longer one is truncated with a marker."""
    retries: int = 2
    """Tries after the first when the environment's infrastructure fails, each from the
    episode's start on a fresh environment."""
    episode_timeout_s: float | None = None
    """Wall-clock budget of one try of an episode (None: none); past it the episode ends
    ``timeout`` with ``timeout_reward`` and is trained."""
    timeout_reward: float = 0.0
    """The return of an episode that ended ``timeout``."""
    max_concurrent: int | None = None
    """Environments open at once in one runner at most (None: as many as episodes)."""

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1 or self.max_observation_tokens < 1:
            raise ValueError(
                "max_turns, max_tokens and max_observation_tokens must be >= 1, got "
                f"{self.max_turns}, {self.max_tokens}, {self.max_observation_tokens}"
            )
        if not self.timeout_s > 0 or not math.isfinite(self.timeout_s):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        budget = self.episode_timeout_s
        if budget is not None and not (budget > 0 and math.isfinite(budget)):
            raise ValueError(f"episode_timeout_s must be a finite number > 0 or None, got {budget}")
        if not math.isfinite(self.timeout_reward):
            raise ValueError(f"timeout_reward must be a finite number, got {self.timeout_reward}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, got {self.max_concurrent}")


@dataclass
class EpisodeStats:
    """How one episode's time went (all its tries); ``Episode.stats`` holds it as a dict."""

    reset_s: list[float] = field(default_factory=list)
    """Latency of each ``reset`` call."""
    step_s: list[float] = field(default_factory=list)
    """Latency of each ``step`` call."""
    engine_s: float = 0.0
    """Seconds waiting on the engine for turns."""
    env_s: float = 0.0
    """Seconds waiting on the environment (building, ``reset``, ``step``, ``close``)."""
    retries: int = 0
    """Tries thrown away because the environment's infrastructure failed."""
    failures: dict[str, int] = field(default_factory=dict)
    """Failed tries (the last one too, when the episode ended ``env_error``) by cause
    (:mod:`engines.episodes.causes`)."""
    failure_messages: dict[str, str] = field(default_factory=dict)
    """The first failed try's message of each cause."""

    def failed(self, cause: str, message: str) -> None:
        """Count one failed try."""
        self.failures[cause] = self.failures.get(cause, 0) + 1
        self.failure_messages.setdefault(cause, message)


class _TimedOut(Exception):
    """The episode's wall-clock budget ran out (the policy's failure, not the environment's)."""


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
        self._causes = CauseLog(log, "an episode's try failed (env_error)")
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
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
        """One episode of ``prompt`` (its token ids) and ``row`` (the task's columns), tried
        again from its start while the environment's infrastructure fails (see the module
        docstring)."""
        prompt = prompt.long()
        stats = EpisodeStats()
        if self.factory is None:
            episode = EpisodeBuilder(judged=False)
            gen = await self._generate(
                stats, generate, prompt, self._capped(params, self.limits.max_tokens)
            )
            episode.add_turn(gen)
            ended = episode.finish("done" if gen.finish_reason == "stop" else "max_tokens")
            ended.stats = asdict(stats)
            return ended
        for attempt in range(self.limits.retries + 1):
            episode = EpisodeBuilder(judged=True)
            try:
                async with self._slot():
                    ended = await self._attempt(episode, prompt, row, generate, params, stats)
            except EnvError as failure:
                cause = cause_of(failure)
                stats.failed(cause, str(failure))
                self._causes.report(cause, f"try {attempt + 1}: {failure}")
                if attempt == self.limits.retries:
                    ended = episode.finish("env_error", str(failure))
                    break
                stats.retries += 1
                continue
            break
        ended.stats = asdict(stats)
        return ended

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of ``max_concurrent`` open environments (a semaphore per event loop: a runner
        may outlive the loop it first ran on)."""
        cap = self.limits.max_concurrent
        if cap is None:
            yield
            return
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(cap))
        async with self._slots[1]:
            yield

    async def _attempt(
        self,
        episode: EpisodeBuilder,
        prompt: torch.Tensor,
        row: Mapping[str, Any],
        generate: TurnGenerate,
        params: SamplingParams,
        stats: EpisodeStats,
    ) -> Episode:
        """One try of the episode on a fresh environment; an infrastructure failure raises
        :class:`EnvError`."""
        lim = self.limits
        assert self.factory is not None
        deadline = (
            None if lim.episode_timeout_s is None else time.monotonic() + lim.episode_timeout_s
        )
        env: Any = None
        try:
            env = await self._call(stats, "building the environment", self.factory)
            first = await self._call(stats, "reset", env.reset, row)
            if first is not None:
                if not isinstance(first, str):
                    raise EnvError(
                        f"reset returned {type(first).__name__}, not text", cause=PROTOCOL_ERROR
                    )
                ids = self._observation(episode, first, after_eos=False)
                if episode.length + len(ids) >= lim.max_tokens:
                    return episode.finish("max_tokens")
                episode.add_observation(ids)
            for turn in range(lim.max_turns):
                left = lim.max_tokens - episode.length
                conversation = torch.cat([prompt, episode.sequence()])
                gen = await self._generate(
                    stats, generate, conversation, self._capped(params, left)
                )
                episode.add_turn(gen)
                if episode.length >= lim.max_tokens:
                    return episode.finish("max_tokens")
                _check_budget(deadline, lim)
                action = self.format.decode(gen.token_ids.tolist())
                result = await self._call(stats, "step", env.step, action)
                _check_result(result)
                episode.reward(result.reward, result.info)
                if result.done:
                    return episode.finish("done")
                if turn == lim.max_turns - 1:
                    break
                _check_budget(deadline, lim)
                ended = (
                    gen.token_ids.numel() > 0 and int(gen.token_ids[-1]) == self.format.eos_token_id
                )
                ids = self._observation(episode, result.observation or "", after_eos=ended)
                if episode.length + len(ids) >= lim.max_tokens:
                    return episode.finish("max_tokens")
                episode.add_observation(ids)
            return episode.finish("max_turns")
        except _TimedOut as timed_out:
            return episode.finish("timeout", str(timed_out), final_reward=lim.timeout_reward)
        finally:
            if env is not None:
                await self._close(stats, env)

    async def _generate(
        self,
        stats: EpisodeStats,
        generate: TurnGenerate,
        conversation: torch.Tensor,
        params: SamplingParams,
    ) -> Generation:
        t0 = time.perf_counter()
        try:
            return await generate(conversation, params)
        finally:
            stats.engine_s += time.perf_counter() - t0

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

    async def _call(
        self, stats: EpisodeStats, what: str, fn: Callable[..., Any], *args: Any
    ) -> Any:
        """``fn(*args)`` within the bound, in the pool unless it is a coroutine function;
        any failure becomes an :class:`EnvError`. Its time goes to ``stats``."""
        t0 = time.perf_counter()
        try:
            return await self._bounded(what, fn, *args)
        finally:
            dt = time.perf_counter() - t0
            stats.env_s += dt
            if what == "reset":
                stats.reset_s.append(dt)
            elif what == "step":
                stats.step_s.append(dt)

    async def _bounded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
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
            raise EnvError(f"{what} took longer than timeout_s={timeout}", cause=TIMEOUT) from None
        except EnvError as e:
            raise EnvError(f"{what}: {e}", cause=e.cause) from None
        except Exception as e:
            raise EnvError(f"{what} raised {type(e).__name__}: {e}", cause=cause_of(e)) from None

    async def _close(self, stats: EpisodeStats, env: Any) -> None:
        close = getattr(env, "close", None)
        if not callable(close):
            return
        try:
            await self._call(stats, "close", close)
        except EnvError as failure:  # the episode is over either way
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


def _check_budget(deadline: float | None, limits: EpisodeLimits) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise _TimedOut(
            f"the episode took longer than episode_timeout_s={limits.episode_timeout_s}"
        )


def _check_result(result: object) -> None:
    if not isinstance(result, StepResult):
        raise EnvError(
            f"step returned {type(result).__name__}, not a StepResult", cause=PROTOCOL_ERROR
        )
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvError(
            f"step returned reward {reward!r}, not a finite number", cause=PROTOCOL_ERROR
        )
    if result.observation is not None and not isinstance(result.observation, str):
        raise EnvError(
            f"step returned an observation of {type(result.observation).__name__}",
            cause=PROTOCOL_ERROR,
        )
    if not isinstance(result.info, dict):
        raise EnvError(f"step returned info of {type(result.info).__name__}", cause=PROTOCOL_ERROR)
