"""One agent episode's calls, recorded as one trajectory: the session.

A session is bound to one episode and one generation instance (the ``generate`` it is given:
the rollout sends every call of a batch to the batch's instance, so the prefix cache of the
previous call is reused and the staleness bound is checked on every call). Its calls run one
at a time, in order. Each call's prompt must **extend** the trajectory so far (token prefix):

    call 1: prompt P1            -> sampled S1        trajectory P1 S1
    call 2: prompt P1 S1 O1      -> sampled S2        trajectory P1 S1 O1 S2
            (O1: what the agent added: tool results, user turns; loss mask off)

The episode's prompt is ``P1``; what follows it (``S1 O1 S2 ...``) is the episode's tokens,
``S`` under the loss mask with their log-probs and per-token versions, ``O`` off it
(:class:`engines.episodes.Episode`).

**An agent that rewrites history** (a prompt that is not ``trajectory + more``: an edited or
dropped turn, a summary in place of old turns) is refused: the call gets HTTP 400 with code
``history_rewritten`` and the trajectory stays as it was (the agent may go on from it, or
stop). One episode is one row, one token sequence: a second trajectory would need rows the
GRPO group does not have, and training on a sequence the model never saw would be wrong.

Budgets (:class:`engines.episodes.EpisodeLimits`): a call past ``max_turns`` model turns, or
whose prompt leaves no room in ``max_tokens`` (the episode's tokens after its prompt), gets
HTTP 400 (``turn_limit_exceeded``, ``context_length_exceeded``); a call's ``max_tokens`` is
lowered to what is left, so the last turn ends with finish reason ``length``. A call on a
finished session gets HTTP 400 ``session_finished``. None of these hangs.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from engines.episodes.record import Episode, EpisodeBuilder
from engines.episodes.runner import EpisodeLimits, TurnGenerate
from engines.protocols import Generation, SamplingParams

__all__ = ["APIError", "Call", "Session"]


class APIError(Exception):
    """An OpenAI-style error answer: HTTP ``status``, ``code`` and the message."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Call:
    """One answered call: the prompt's ids and the model's sample."""

    prompt_ids: list[int]
    generation: Generation


class Session:
    """The trajectory of one episode's calls (see the module docstring).

    Args:
        session_id: the id in the endpoint's path.
        generate: samples one turn on the episode's instance.
        params: the run's sampling parameters (the trainer scores at them: a request's
            ``temperature`` does not change them; its ``max_tokens`` lowers the cap).
        limits: the episode's turn and token budgets.
    """

    def __init__(
        self,
        session_id: str,
        generate: TurnGenerate,
        params: SamplingParams,
        limits: EpisodeLimits,
    ) -> None:
        self.id = session_id
        self._generate = generate
        self.params = params
        self.limits = limits
        self.lock = asyncio.Lock()
        """Held by the endpoint around each call: a session's calls run one at a time."""
        self.prompt: list[int] | None = None
        self.ids: list[int] = []
        """The trajectory: the episode's prompt and every token after it."""
        self.messages: list[dict[str, Any]] | None = None
        """The chat conversation that :attr:`ids` encodes (the last request and its answer)."""
        self.text: str | None = None
        """The text that :attr:`ids` encodes, for ``/v1/completions``."""
        self.calls: list[Call] = []
        self.end_reason: str | None = None
        """``max_turns`` or ``max_tokens`` once a budget ran out."""
        self.failure: BaseException | None = None
        """An error of the generation engine (not the agent's): the episode is generated again."""
        self.finished = False
        self.refused: dict[str, int] = {}
        """Requests of this session the endpoint refused, by error code (its server counts
        them: ``context_length_exceeded``, ``history_rewritten``, ...)."""
        self._builder = EpisodeBuilder(judged=False)

    @property
    def last(self) -> Generation | None:
        return self.calls[-1].generation if self.calls else None

    async def complete(self, prompt_ids: list[int], max_tokens: int | None) -> Generation:
        """Sample the continuation of ``prompt_ids``, which must extend the trajectory."""
        if self.finished:
            raise APIError(400, "session_finished", f"session {self.id} has finished")
        lim = self.limits
        if self.prompt is None:
            added: list[int] = []
        elif prompt_ids[: len(self.ids)] != self.ids:
            raise APIError(
                400,
                "history_rewritten",
                f"session {self.id}: the prompt does not extend the conversation so far (its "
                f"first {len(self.ids)} tokens differ from what the model saw and wrote); an "
                "episode is one trajectory: send the whole conversation, with the model's "
                "answers as they were returned, and add to its end",
                param="messages",
            )
        else:
            added = prompt_ids[len(self.ids) :]
        if len(self.calls) >= lim.max_turns:
            self.end_reason = "max_turns"
            raise APIError(
                400,
                "turn_limit_exceeded",
                f"session {self.id}: the episode's budget of {lim.max_turns} model turns is spent",
            )
        left = lim.max_tokens - self._builder.length - len(added)
        if left <= 0:
            self.end_reason = "max_tokens"
            raise APIError(
                400,
                "context_length_exceeded",
                f"session {self.id}: the episode's budget of {lim.max_tokens} tokens after its "
                f"first prompt is spent ({self._builder.length} used, {len(added)} added)",
                param="messages",
            )
        cap = min(self.params.max_new_tokens, left, max_tokens or left)
        params = replace(self.params, max_new_tokens=max(cap, 1))
        try:
            gen = await self._generate(torch.tensor(prompt_ids, dtype=torch.int64), params)
        except Exception as e:  # the engine's failure: the rollout retries the batch
            self.failure = e
            raise APIError(
                500, "engine_error", f"generation failed: {type(e).__name__}", kind="server_error"
            ) from e
        if self.prompt is None:
            self.prompt = list(prompt_ids)
        else:
            self._builder.add_observation(added)
        self._builder.add_turn(gen)
        self.ids = [*prompt_ids, *(int(t) for t in gen.token_ids.tolist())]
        self.calls.append(Call(list(prompt_ids), gen))
        if gen.finish_reason == "length" and cap == left:
            self.end_reason = "max_tokens"
        return gen

    def episode(
        self, reward: float | None, end_reason: str | None = None, error: str | None = None
    ) -> Episode:
        """The recorded episode; ``reward`` (the agent's) is the last turn's and the return
        (None: NaN, for the reward stage to judge). Ends the session."""
        self.finished = True
        reason = end_reason or self.end_reason or "done"
        ep = self._builder.finish(reason, error)
        rewards = torch.full_like(ep.turn_rewards, math.nan)
        if reward is not None and rewards.numel():
            rewards.zero_()
            rewards[-1] = float(reward)
        prompt = torch.tensor(self.prompt or [], dtype=torch.int64)
        return replace(ep, turn_rewards=rewards, prompt_ids=prompt if self.prompt else None)
