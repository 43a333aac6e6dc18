"""OpenEnv servers as environments: one WebSocket session per episode.

An OpenEnv server (``openenv`` on PyPI; often one server per container) keeps one environment
per WebSocket session on ``/ws``; its HTTP ``/reset`` and ``/step`` build a fresh environment
per request, so multi-step episodes need the session. One :class:`OpenEnvClient` is one
episode's session, speaking the server's own JSON messages:

| ours                  | sent on ``/ws``                            | answered                |
|-----------------------|--------------------------------------------|-------------------------|
| ``reset(row)``        | ``{"type": "reset", "data": reset_data}``  | ``observation`` (below) |
| ``step(text)``        | ``{"type": "step", "data": action(text)}`` | ``observation``         |
| ``state()``           | ``{"type": "state"}``                      | ``{"type": "state"}``   |
| ``close()``           | ``{"type": "close"}``, then the socket     | (the server ends it)    |

An answer ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d,
"metadata": {...}}}`` becomes a :class:`~engines.envs.base.StepResult`:

| StepResult     | from the reply                                                         |
|----------------|------------------------------------------------------------------------|
| ``observation``| ``render(data["observation"])`` (default: its text fields)             |
| ``reward``     | ``data["reward"]`` (None: 0.0)                                         |
| ``done``       | ``data["done"]``                                                       |
| ``info``       | the numbers of ``data["metadata"]`` (summed per episode by the runner) |

How the model's text becomes an action and an observation becomes text are two small
functions, replaceable by import path (``action=``, ``render=``): by default the text is the
action's ``message`` field (:func:`message_action`) and the observation's string fields are
shown (:func:`render_text_fields`).

**Which client.** The protocol is spoken here with ``websockets`` (the ``openenv`` extra), not
with OpenEnv's own client: the ``openenv`` package's install pulls gradio, fastmcp (an MCP
server), openai and huggingface_hub into the training environment for what is a JSON
exchange on one socket. ``websockets`` is small, pure Python, and the library OpenEnv's own
client uses. Servers are written with OpenEnv's own server library (the tests and
``examples/openenv_game.py`` do; install ``openenv`` where the server runs).

**Failures.** What is the server's fault, not the policy's, raises :class:`OpenEnvError` (an
:class:`~engines.envs.base.EnvError`): the server unreachable, the session closed under us, a
reply that is not the protocol's, an error reply (an exception inside the server's
``reset``/``step``), no reply within ``timeout_s``, no session slot before ``timeout_s``. The
episode runner retries such an episode from its start on a fresh session (``env.retries``),
then ends it ``env_error`` and its group is dropped and refilled; the run goes on.

**Reconnecting.** Connecting is retried (``connect_retries``, with backoff) and so is a
``reset`` whose socket dropped. A socket that drops after ``reset`` lost the server's
environment with it: with ``replay=True`` the client opens a new session, resets it with the
same data and replays the episode's actions (for servers whose episodes are a function of the
reset data, e.g. seeded), otherwise it raises :class:`OpenEnvError`.

**Session cap.** OpenEnv servers declare a cap of concurrent sessions and refuse one more with
``CAPACITY_REACHED`` (naming the cap). Clients of one server in one process share a counter:
at most ``max_sessions`` open at once (None: the server's cap, learnt from its first refusal);
a refused client waits for a session of this process to close (or a backoff, as other
processes' sessions may close), then tries again, all within ``timeout_s``. A slot is freed
once the server has closed the session's environment (its close frame comes after), except
for a session dropped on a timeout or a lost socket.

Which bound bounds what: ``env.max_concurrent`` bounds the environments open at once in one
rollout worker (an episode waits for it before building its client, without a deadline);
``max_sessions`` bounds the sessions of one server from one process (waited for inside
``reset``, within ``timeout_s``); the server's own cap bounds every client together. With
``env.name=openenv`` the rollout worker's bound is the smaller of ``env.max_concurrent`` and
``max_sessions`` (``asyncflow.build``), so episodes beyond the session cap queue in the runner
instead of spending ``timeout_s`` in ``reset`` and failing as ``env_error``.

Called by the episode runner (:mod:`engines.episodes.runner`), one client per episode, its
coroutines on the runner's event loop; built by name (``env.name=openenv``) with
``env.options`` as the keyword arguments below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from engines.envs.base import EnvError, StepResult
from engines.imports import import_path

__all__ = [
    "INSTALL_HINT",
    "OpenEnvClient",
    "OpenEnvError",
    "check_available",
    "message_action",
    "render_text_fields",
]

INSTALL_HINT = "pip install 'asyncflow[openenv]'"
"""The one line to type when the client's WebSocket library is missing."""


class OpenEnvError(EnvError):
    """The OpenEnv server failed (unreachable, session closed, malformed or error reply, no
    reply in time): the environment's infrastructure, not the policy (an ``env_error`` once
    the episode's retries are spent)."""


def check_available() -> None:
    """Raise ``ValueError`` with the install line when ``websockets`` cannot be imported
    (called when a run's config is checked, before anything starts)."""
    try:
        import websockets.asyncio.client  # noqa: F401
    except ImportError:
        raise ValueError(f"env.name=openenv needs the openenv extra: {INSTALL_HINT}") from None


def message_action(text: str) -> dict[str, Any]:
    """The default action: the model's text as the ``message`` field."""
    return {"message": text}


def render_text_fields(observation: Mapping[str, Any]) -> str | None:
    """The default rendering: the observation's non-empty string fields (``metadata`` left
    out), the value alone when there is one, else one ``name: value`` line each; None when
    there is none."""
    texts = [
        (k, v)
        for k, v in observation.items()
        if k != "metadata" and isinstance(v, str) and v.strip()
    ]
    if not texts:
        return None
    if len(texts) == 1:
        return texts[0][1]
    return "\n".join(f"{k}: {v}" for k, v in texts)


def ws_url(url: str) -> str:
    """The session endpoint of a server URL: ``http://h:p`` -> ``ws://h:p/ws``."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(
            f"openenv url must look like 'http://host:port' (or ws://, https://), got {url!r}"
        )
    path = parts.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class _Slots:
    """Open sessions of one server from one event loop, at most ``cap`` (None: no cap)."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        self.open = 0
        self._changed = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.cap is None or self.open < self.cap)
            self.open += 1

    async def release(self) -> None:
        async with self._changed:
            self.open -= 1
            self._changed.notify_all()

    async def refused(self, server_cap: int | None, wait_s: float) -> None:
        """The server refused a session: give the slot back, take the server's cap as ours
        (when it is lower), and wait up to ``wait_s`` for one of this process's sessions to
        close (sessions of other clients of the server may close meanwhile: hence the bound)."""
        async with self._changed:
            self.open -= 1
            if server_cap is not None and server_cap >= 1:
                self.cap = server_cap if self.cap is None else min(self.cap, server_cap)
            self._changed.notify_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._changed.wait()


_SLOTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Slots]] = (
    weakref.WeakKeyDictionary()
)


def _slots(url: str, cap: int | None) -> _Slots:
    per_loop = _SLOTS.setdefault(asyncio.get_running_loop(), {})
    slots = per_loop.get(url)
    if slots is None:
        slots = per_loop[url] = _Slots(cap)
    elif cap is not None and (slots.cap is None or cap < slots.cap):
        slots.cap = cap
    return slots


class _Refused(Exception):
    """The server refused a session at its cap."""

    def __init__(self, server_cap: int | None) -> None:
        super().__init__(f"at capacity ({server_cap})")
        self.server_cap = server_cap


class OpenEnvClient:
    """One episode's session with an OpenEnv server (see the module docstring).

    Args:
        url: the server, ``http://host:port`` (``/ws`` is added).
        action: import path of ``fn(text) -> dict``, the action sent for a model turn
            (default :func:`message_action`).
        render: import path of ``fn(observation: dict) -> str | None``, the text shown to the
            model (default :func:`render_text_fields`).
        reset_fields: columns of the task's row sent in ``reset``'s data (e.g. ``seed``).
        reset_data: fixed keyword arguments of the server's ``reset``.
        max_sessions: sessions of this server open at once from this process (None: the
            server's own cap).
        timeout_s: bound of one message's round trip, of connecting, and of waiting for a
            session slot; keep it below ``env.timeout_s``.
        connect_retries: further attempts to connect after a failed one.
        replay: on a socket dropped mid-episode, open a new session and replay the episode.
        max_message_bytes: largest reply accepted.
    """

    def __init__(
        self,
        *,
        url: str,
        action: str | None = None,
        render: str | None = None,
        reset_fields: tuple[str, ...] | list[str] = (),
        reset_data: Mapping[str, Any] | None = None,
        max_sessions: int | None = None,
        timeout_s: float = 5.0,
        connect_retries: int = 2,
        replay: bool = False,
        max_message_bytes: int = 16 * 2**20,
    ) -> None:
        check_available()
        self.url = ws_url(url)
        if max_sessions is not None and max_sessions < 1:
            raise ValueError(f"openenv max_sessions must be >= 1 or None, got {max_sessions}")
        if not timeout_s > 0 or not math.isfinite(timeout_s) or connect_retries < 0:
            raise ValueError(
                "openenv timeout_s must be a finite number > 0 and connect_retries >= 0, got "
                f"{timeout_s}, {connect_retries}"
            )
        self._action: Callable[[str], Mapping[str, Any]] = (
            _function(action, "action") if action else message_action
        )
        self._render: Callable[[Mapping[str, Any]], str | None] = (
            _function(render, "render") if render else render_text_fields
        )
        self.reset_fields = tuple(reset_fields)
        self.reset_data = dict(reset_data or {})
        self.max_sessions = max_sessions
        self.timeout_s = float(timeout_s)
        self.connect_retries = connect_retries
        self.replay = replay
        self.max_message_bytes = max_message_bytes
        self._ws: Any = None
        self._slots: _Slots | None = None
        self._data: dict[str, Any] = {}
        self._actions: list[dict[str, Any]] = []

    @staticmethod
    def check_options(options: Mapping[str, Any]) -> None:
        """The config check's hook (:func:`engines.envs.base.environment_factory`): the
        extra installed, the URL well formed, the functions importable."""
        check_available()
        if isinstance(options.get("url"), str):
            ws_url(options["url"])
        for what in ("action", "render"):
            if options.get(what):
                _function(options[what], what)

    # -- the Environment protocol -------------------------------------------------------
    async def reset(self, row: Mapping[str, Any]) -> str | None:
        """Open the session (waiting for a slot) and reset the server's environment."""
        self._data = {**self.reset_data, **{k: row[k] for k in self.reset_fields if k in row}}
        self._actions = []
        data = await self._start()
        return self._render_reply(data)

    async def step(self, action: str) -> StepResult:
        """Send the model's turn as an action; the reply's reward and done ride on it."""
        payload = dict(self._action(action))
        try:
            data = await self._exchange({"type": "step", "data": payload}, "observation")
        except _Dropped as dropped:
            if not self.replay:
                raise OpenEnvError(
                    f"openenv {self.url}: the session closed mid-episode ({dropped}); its "
                    "environment is gone (replay=True replays the episode on a new session)",
                    cause="connection_lost",
                ) from None
            await self._start()
            for earlier in self._actions:
                await self._request({"type": "step", "data": earlier}, "observation")
            data = await self._request({"type": "step", "data": payload}, "observation")
        self._actions.append(payload)
        reward = data.get("reward")
        done = data.get("done", False)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise OpenEnvError(
                f"openenv {self.url}: reward {reward!r} is not a number", cause="protocol_error"
            )
        if not isinstance(done, bool):
            raise OpenEnvError(
                f"openenv {self.url}: done {done!r} is not a bool", cause="protocol_error"
            )
        metadata = data.get("metadata") or data.get("observation", {}).get("metadata") or {}
        info = {
            k: float(v)
            for k, v in (metadata.items() if isinstance(metadata, dict) else ())
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        text = None if done else self._render_reply(data)
        return StepResult(text, reward=float(reward or 0.0), done=done, info=info)

    async def state(self) -> dict[str, Any]:
        """The server environment's ``state`` (episode id, step count, its own fields)."""
        return await self._request({"type": "state"}, "state")

    async def close(self) -> None:
        """End the session (idempotent): ``close`` sent, the socket closed, the slot freed."""
        from websockets.exceptions import ConnectionClosed

        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await ws.send(json.dumps({"type": "close"}))
                    # the server closes the socket once it has closed the session's
                    # environment: waiting for that keeps its count within the cap
                    with contextlib.suppress(ConnectionClosed):
                        await ws.recv()
                    await ws.close()
        slots, self._slots = self._slots, None
        if slots is not None:
            await slots.release()

    # -- the session --------------------------------------------------------------------
    async def _start(self) -> dict[str, Any]:
        """A new session, reset: waits for a slot, retries a refused or dropped start."""
        from websockets.exceptions import InvalidHandshake

        await self._drop()
        deadline = time.monotonic() + self.timeout_s
        failures = refusals = 0
        while True:
            if self._slots is None:
                slots = _slots(self.url, self.max_sessions)
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                        await slots.acquire()
                except TimeoutError:
                    raise OpenEnvError(
                        f"openenv {self.url}: no session slot within timeout_s={self.timeout_s} "
                        f"({slots.open} of {slots.cap} open in this process)",
                        cause="timeout",
                    ) from None
                self._slots = slots
            try:
                await self._connect()
                return await self._exchange({"type": "reset", "data": self._data}, "observation")
            except _Refused as refused:
                await self._drop()
                slots, self._slots = self._slots, None
                assert slots is not None
                refusals += 1
                wait_s = min(0.05 * 2**refusals, 1.0, max(deadline - time.monotonic(), 0.0))
                await slots.refused(refused.server_cap, wait_s)
                if time.monotonic() >= deadline:
                    raise OpenEnvError(
                        f"openenv {self.url}: the server refused a session {refusals} time(s) "
                        f"within timeout_s={self.timeout_s}: at its cap of "
                        f"{refused.server_cap} sessions (held by other clients?)",
                        cause="connection_refused",
                    ) from None
            except InvalidHandshake as e:  # something answers, but not OpenEnv's WebSocket
                await self._drop()
                raise OpenEnvError(
                    f"openenv {self.url}: the server does not speak OpenEnv's WebSocket "
                    f"protocol: {type(e).__name__}: {e}",
                    cause="protocol_error",
                ) from None
            except (_Dropped, OSError, TimeoutError) as e:
                await self._drop()
                failures += 1
                if failures > self.connect_retries or time.monotonic() >= deadline:
                    raise OpenEnvError(
                        f"openenv {self.url}: cannot open a session after {failures} "
                        f"attempt(s): {type(e).__name__}: {e}; is the server running?",
                        cause=_connect_cause(e),
                    ) from None
                await asyncio.sleep(min(0.05 * 2**failures, 1.0))

    async def _connect(self) -> None:
        from websockets.asyncio.client import connect

        host = urlsplit(self.url).hostname or ""
        loopback = host in ("localhost", "127.0.0.1", "::1")
        extra: dict[str, Any] = {"proxy": None} if loopback else {}  # no proxy to loopback
        self._ws = await connect(
            self.url,
            open_timeout=self.timeout_s,
            close_timeout=min(self.timeout_s, 2.0),
            max_size=self.max_message_bytes,
            **extra,
        )

    async def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(self.timeout_s, 2.0)):
                    await ws.close()

    def _abort(self) -> None:
        """Drop the socket at once (no close handshake: nothing awaited while cancelled)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                ws.transport.abort()

    async def _request(self, message: dict[str, Any], expect: str) -> dict[str, Any]:
        try:
            return await self._exchange(message, expect)
        except _Dropped as e:
            raise OpenEnvError(
                f"openenv {self.url}: the session closed: {e}", cause="connection_lost"
            ) from None

    async def _exchange(self, message: dict[str, Any], expect: str) -> dict[str, Any]:
        """One request and its reply on the session; ``_Dropped`` when the socket is gone,
        :class:`OpenEnvError` for an error reply, a malformed one, or none in time."""
        from websockets.exceptions import ConnectionClosed

        if self._ws is None:
            raise _Dropped("no open session")
        ws = self._ws
        try:
            async with asyncio.timeout(self.timeout_s):
                with contextlib.suppress(ConnectionClosed):  # a refusal may be queued: read it
                    await ws.send(json.dumps(message))
                raw = await ws.recv()
        except ConnectionClosed as e:
            self._ws = None
            raise _Dropped(str(e) or type(e).__name__) from None
        except TimeoutError:
            self._abort()  # a late reply must not be read as the next one's
            raise OpenEnvError(
                f"openenv {self.url}: no reply to {message['type']!r} within "
                f"timeout_s={self.timeout_s}",
                cause="timeout",
            ) from None
        except BaseException:
            self._abort()  # cancelled mid-exchange: the socket is out of step
            raise
        try:
            reply = json.loads(raw)
        except (TypeError, ValueError):
            raise OpenEnvError(
                f"openenv {self.url}: a reply that is not JSON: {str(raw)[:200]!r}",
                cause="protocol_error",
            ) from None
        if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
            raise OpenEnvError(
                f"openenv {self.url}: expected {{'type': ..., 'data': {{...}}}}, got "
                f"{str(reply)[:200]!r}",
                cause="protocol_error",
            )
        data: dict[str, Any] = reply["data"]
        if reply.get("type") == "error":
            if data.get("code") == "CAPACITY_REACHED":
                cap = data.get("max_sessions")
                raise _Refused(cap if isinstance(cap, int) else None)
            raise OpenEnvError(
                f"openenv {self.url}: {message['type']!r} failed on the server: "
                f"{data.get('message')} (code {data.get('code')})"
            )
        if reply.get("type") != expect:
            raise OpenEnvError(
                f"openenv {self.url}: expected a {expect!r} reply to {message['type']!r}, got "
                f"{reply.get('type')!r}",
                cause="protocol_error",
            )
        if expect == "observation" and not isinstance(data.get("observation", {}), dict):
            raise OpenEnvError(
                f"openenv {self.url}: 'observation' is not an object: {data!r}",
                cause="protocol_error",
            )
        return data

    def _render_reply(self, data: Mapping[str, Any]) -> str | None:
        text = self._render(data.get("observation") or {})
        if text is not None and not isinstance(text, str):
            raise OpenEnvError(f"openenv render returned {type(text).__name__}, not text")
        return text


class _Dropped(Exception):
    """The socket closed (or was never opened)."""


def _connect_cause(e: BaseException) -> str:
    """The cause of a session that could not be opened: the socket closed as it opened
    (``connection_lost``), no answer in time (``timeout``), else the server unreachable."""
    if isinstance(e, _Dropped):
        return "connection_lost"
    if isinstance(e, TimeoutError):
        return "timeout"
    return "connection_refused"


def _function(path: str, what: str) -> Any:
    fn = import_path(path, f"openenv {what}", target="function", example="mypkg.game:to_action")
    if not callable(fn):
        raise ValueError(f"openenv {what} {path!r} is a {type(fn).__name__}, not callable")
    return fn
