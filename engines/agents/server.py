"""The OpenAI-compatible endpoint, served from generation engines (aiohttp, on loopback).

| route                                         | what                                       |
|-----------------------------------------------|--------------------------------------------|
| ``GET  /v1/models``                           | the served model (one: ``model``)          |
| ``POST /v1/chat/completions``                 | a chat completion (``tools`` go to the     |
|                                               | chat template)                             |
| ``POST /v1/completions``                      | a text completion (``prompt``: text, or    |
|                                               | token ids)                                 |
| ``/sessions/{id}/v1/...``                     | the same, recorded in an agent episode's   |
|                                               | session (:mod:`engines.agents.session`)    |

Beside OpenAI's fields, every answer carries (token-in/token-out: a client never re-tokenizes):

| field                       | where          | what                                        |
|-----------------------------|----------------|---------------------------------------------|
| ``prompt_token_ids``        | the response   | the prompt's ids as the model read them     |
| ``token_ids``               | each choice    | the sampled ids                             |
| ``token_logprobs``          | each choice    | the sampler's log-prob of each sampled id   |
| ``token_versions``          | each choice    | the policy version that sampled each id     |
| ``session_id``              | the response   | the session (null outside one)              |

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed request, a prompt past the policy's context less the tokens asked for
(``context_length_exceeded``), a spent budget, a rewritten history or a finished
session; 401 for a missing or wrong bearer token (``api_key``); 404 for an unknown model,
session or route; 500 when the engine failed. A handler's error is an error answer, never a
dead server. ``stream: true`` and ``n > 1`` are refused (400).

Why aiohttp: one well-kept asyncio package (server and client, few dependencies), whose
server runs on the event loop that already runs the rollout stage, so a request reaches the
engine with no thread hop. It is the ``agents`` extra, imported when a server starts.

Outside a session, a request samples with its own ``temperature``, ``top_p``, ``seed`` and
``max_tokens`` on ``engine``; inside one, with the run's sampling parameters (the trainer
scores at them) and ``max_tokens`` as a further cap.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from engines.agents.codec import ChatCodec, parse_tool_calls
from engines.agents.session import APIError, Session
from engines.episodes.causes import CauseLog
from engines.episodes.runner import EpisodeLimits, TurnGenerate
from engines.imports import require
from engines.protocols import Generation, SamplingParams

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

__all__ = ["OpenAIServer"]

_FINISHED_KEPT = 4096
"""Ids of finished sessions remembered (their calls get ``session_finished``, not 404)."""


class OpenAIServer:
    """The endpoint (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (its chat template renders chat requests).
        model: the name clients put in ``model``.
        engine: serves requests outside a session (None: those get 404).
        params: sampling defaults outside a session.
        host: where to listen (loopback by default).
        port: the port (0: a free one).
        api_key: the bearer token requests must carry (None: none needed).
        context_tokens: the policy's context (``max_position_embeddings``, or the engine's
            ``max_model_len``): a prompt longer than it less the tokens the request asks for
            (``max_tokens``, else the sampling default) gets 400 ``context_length_exceeded``,
            as OpenAI answers. None: no bound.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str = "policy",
        engine: Any | None = None,
        params: SamplingParams | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        context_tokens: int | None = None,
    ) -> None:
        if context_tokens is not None and context_tokens < 2:
            raise ValueError(f"context_tokens must be >= 2 or None, got {context_tokens}")
        self.codec = ChatCodec(tokenizer)
        self.model = model
        self.engine = engine
        self.params = params or SamplingParams()
        self.host, self.port = host, port
        self.api_key = api_key
        self.context_tokens = context_tokens
        self.url = ""
        """``http://host:port`` once started."""
        self._sessions: dict[str, Session] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count()
        self._refusals = CauseLog(log, "the agent endpoint refused a request")

    async def start(self) -> str:
        """Listen (on the running loop); returns :attr:`url`. Idempotent."""
        if self._runner is not None:
            return self.url
        web = require("aiohttp.web", extra="agents", what="the OpenAI-compatible endpoint")
        app = web.Application(middlewares=[self._middleware()], client_max_size=16 * 2**20)
        for prefix in ("", "/sessions/{session}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port)
        await site.start()
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        """Stop listening (idempotent)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def open_session(
        self, generate: TurnGenerate, params: SamplingParams, limits: EpisodeLimits
    ) -> Session:
        """A new session; its calls go to ``url + "/sessions/" + session.id + "/v1"``."""
        sid = f"s{next(self._ids)}-{secrets.token_hex(4)}"
        session = Session(sid, generate, params, limits)
        self._sessions[sid] = session
        return session

    def end_session(self, session: Session) -> None:
        """No more calls: later ones get 400 ``session_finished``."""
        session.finished = True
        self._sessions.pop(session.id, None)
        self._finished[session.id] = None
        while len(self._finished) > _FINISHED_KEPT:
            self._finished.popitem(last=False)

    def base_url(self, session: Session | None = None) -> str:
        """The ``base_url`` an OpenAI client is given (of ``session``, or outside one)."""
        return f"{self.url}/sessions/{session.id}/v1" if session else f"{self.url}/v1"

    def _refused(self, request: web.Request, error: APIError) -> None:
        """Count a refused request by its code in its session (the episode's ``refused``
        stats, summed per step) and log the first of each code at WARNING with its message
        (:class:`engines.episodes.causes.CauseLog`)."""
        session = self._sessions.get(request.match_info.get("session", ""))
        if session is not None:
            session.refused[error.code] = session.refused.get(error.code, 0) + 1
        self._refusals.report(error.code, f"{request.method} {request.path}: {error}")

    # --- handlers ---------------------------------------------------------------------------

    def _middleware(self) -> Callable[..., Awaitable[web.StreamResponse]]:
        from aiohttp import web

        @web.middleware
        async def middleware(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            try:
                if self.api_key is not None:
                    auth = request.headers.get("Authorization", "")
                    if not secrets.compare_digest(auth, f"Bearer {self.api_key}"):
                        raise APIError(401, "invalid_api_key", "missing or wrong bearer token")
                return await handler(request)
            except APIError as e:
                self._refused(request, e)
                return web.json_response(e.body(), status=e.status)
            except web.HTTPException as e:  # routing: unknown path or method
                err = APIError(
                    e.status, "not_found", f"{request.method} {request.path}: {e.reason}"
                )
                return web.json_response(err.body(), status=e.status)
            except Exception as e:  # a handler's bug answers 500; the server stays up
                err = APIError(
                    500, "internal_error", f"{type(e).__name__}: {e}", kind="server_error"
                )
                return web.json_response(err.body(), status=500)

        return middleware

    async def _models(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        self._session_of(request)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "asyncflow"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        session = self._session_of(request)
        body = await _body(request, self.model)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(
                400, "invalid_value", "messages must be a non-empty list", param="messages"
            )
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, "invalid_value", "each message needs a role", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "invalid_value", "tools must be a list", param="tools")
        ids = self._chat_ids(session, messages, tools)
        gen = await self._sample(session, ids, body)
        content, calls = parse_tool_calls(self.codec.decode(gen.token_ids.tolist()))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if session is not None:
            session.messages = [*messages, message]
            session.text = None
        finish = "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        out = _response("chat.completion", self.model, session, ids, gen, choice)
        return web.json_response(out)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        session = self._session_of(request)
        body = await _body(request, self.model)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        text: str | None = None
        if isinstance(prompt, str):
            text = prompt
            if session is not None and session.text is not None and prompt.startswith(session.text):
                ids = session.ids + self.codec.encode(prompt[len(session.text) :])
            else:
                ids = self.codec.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise APIError(
                400,
                "invalid_value",
                "prompt must be a string or a list of token ids",
                param="prompt",
            )
        gen = await self._sample(session, ids, body)
        completion = self.codec.decode(gen.token_ids.tolist())
        if session is not None:
            session.text = None if text is None else text + completion
            session.messages = None
        choice = {
            "index": 0,
            "text": completion,
            "finish_reason": gen.finish_reason,
            "logprobs": None,
        }
        return web.json_response(
            _response("text_completion", self.model, session, ids, gen, choice)
        )

    # --- internals --------------------------------------------------------------------------

    def _session_of(self, request: web.Request) -> Session | None:
        sid = request.match_info.get("session")
        if sid is None:
            return None
        session = self._sessions.get(sid)
        if session is not None:
            return session
        if sid in self._finished:
            raise APIError(400, "session_finished", f"session {sid} has finished")
        raise APIError(404, "session_not_found", f"no session {sid!r}")

    def _chat_ids(
        self, session: Session | None, messages: list[dict[str, Any]], tools: list[Any] | None
    ) -> list[int]:
        prev = None if session is None else session.messages
        extends = prev and len(messages) > len(prev)
        if session is not None and prev and extends:  # noqa: SIM102 (the check is costlier)
            if [_norm(m) for m in messages[: len(prev)]] == [_norm(m) for m in prev]:
                last = session.last
                ended = bool(
                    last is not None
                    and last.token_ids.numel()
                    and int(last.token_ids[-1]) == self.codec.eos_token_id
                )
                suffix = self.codec.chat_suffix(messages, len(prev) - 1, tools, after_eos=ended)
                if suffix is not None:
                    return session.ids + suffix
        return self.codec.chat_ids(messages, tools)

    async def _sample(
        self, session: Session | None, ids: list[int], body: Mapping[str, Any]
    ) -> Generation:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not _is_id(max_tokens) or max_tokens < 1):
            raise APIError(
                400, "invalid_value", "max_tokens must be an integer >= 1", param="max_tokens"
            )
        self._check_context(session, ids, max_tokens)
        if session is not None:
            async with session.lock:
                return await session.complete(ids, max_tokens)
        if self.engine is None:
            raise APIError(404, "session_required", "this endpoint serves agent sessions only")
        params = _params(self.params, body, max_tokens)
        gens: Sequence[Generation] = await self.engine.generate(
            [torch.tensor(ids, dtype=torch.int64)], params
        )
        return gens[0]

    def _check_context(
        self, session: Session | None, ids: list[int], max_tokens: int | None
    ) -> None:
        """Refuse a prompt the policy cannot read with the tokens the request asks for: the
        limit is the context less those tokens (every call of a session too: its prompt grows
        by the episode's turns)."""
        context = self.context_tokens
        if context is None:
            return
        if session is None:  # the request's own max_tokens, else the endpoint's default
            asked = max_tokens or self.params.max_new_tokens
        else:  # a session samples the run's tokens per turn, max_tokens a further cap
            asked = min(session.params.max_new_tokens, max_tokens or session.params.max_new_tokens)
        if len(ids) + asked <= context:
            return
        if session is not None and session.prompt is not None:
            session.end_reason = "max_tokens"  # the episode has filled the model's context
        raise APIError(
            400,
            "context_length_exceeded",
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{len(ids) + asked} tokens ({len(ids)} in the messages, {asked} in the "
            "completion). Please reduce the length of the messages or completion.",
            param="messages",
        )


async def _body(request: web.Request, model: str) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "invalid_json", "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "invalid_json", "the request body must be a JSON object")
    if body.get("model") != model:
        raise APIError(
            404,
            "model_not_found",
            f"model {body.get('model')!r} does not exist; served: {model!r}",
            param="model",
        )
    if body.get("stream"):
        raise APIError(400, "unsupported_value", "stream is not supported", param="stream")
    if body.get("n", 1) != 1:
        raise APIError(400, "unsupported_value", "n must be 1", param="n")
    return body


def _params(
    base: SamplingParams, body: Mapping[str, Any], max_tokens: int | None
) -> SamplingParams:
    from dataclasses import replace

    changes: dict[str, Any] = {}
    if max_tokens is not None:
        changes["max_new_tokens"] = int(max_tokens)
    for key, field in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
        if body.get(key) is not None:
            changes[field] = body[key]
    try:
        return replace(base, **changes)
    except (TypeError, ValueError) as e:
        raise APIError(400, "invalid_value", f"bad sampling parameters: {e}") from None


def _response(
    kind: str,
    model: str,
    session: Session | None,
    ids: list[int],
    gen: Generation,
    choice: dict[str, Any],
) -> dict[str, Any]:
    n = int(gen.token_ids.numel())
    choice["token_ids"] = [int(t) for t in gen.token_ids.tolist()]
    choice["token_logprobs"] = [float(x) for x in gen.logprobs.tolist()]
    choice["token_versions"] = [int(v) for v in gen.token_versions.tolist()]
    prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
    return {
        "id": f"{prefix}-{secrets.token_hex(8)}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n},
        "prompt_token_ids": ids,
        "session_id": None if session is None else session.id,
    }


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _norm(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same turn (a client's echo of an answer adds empty
    fields: ``refusal``, ``audio``... which do not count)."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = tuple(
        (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
        for c in message.get("tool_calls") or ()
        if isinstance(c, dict)
    )
    return (
        message.get("role"),
        content or "",
        calls,
        message.get("tool_call_id"),
        message.get("name"),
    )
