"""An episode's failed tries are counted by cause, and the first of each cause is logged at
WARNING with its message: against small real servers on loopback (nothing listening, a
WebSocket server answering text that is not JSON, JSON of the wrong shape, nothing at all, an
HTTP server that is not a WebSocket one) and an environment that raises."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from adapters.episodes import EpisodeTally, episode_columns
from engines.envs import environment_factory
from engines.episodes import Episode, EpisodeLimits, EpisodeRunner, TurnFormat
from engines.episodes.causes import CAUSES, CauseLog, cause_of
from engines.protocols import Generation, SamplingParams
from engines.tiny import build_tokenizer
from tests.engines.openenv_game import free_port

pytest.importorskip("websockets")

RUNNER_LOG = "engines.episodes.runner"
Handler = Callable[[Any], Awaitable[None]]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


async def _generate(prompt: torch.Tensor, params: SamplingParams) -> Generation:
    return Generation(torch.tensor([5, 2]), torch.full((2,), -0.5), "stop", version=0)


async def _episode(runner: EpisodeRunner) -> Episode:
    return await runner.run(torch.tensor([1, 2, 3]), {}, _generate, SamplingParams())


def _runner(tokenizer: PreTrainedTokenizerBase, url: str) -> EpisodeRunner:
    factory = environment_factory("openenv", {"url": url, "timeout_s": 0.5, "connect_retries": 0})
    return EpisodeRunner(factory, TurnFormat(tokenizer), EpisodeLimits(retries=2, timeout_s=5.0))


async def _served(handler: Handler | None, tokenizer: PreTrainedTokenizerBase) -> Episode:
    """One episode (three tries) against ``handler``'s WebSocket server, or against a port
    where nothing listens (None)."""
    if handler is None:
        return await _episode(_runner(tokenizer, f"http://127.0.0.1:{free_port()}"))
    from websockets.asyncio.server import serve

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        return await _episode(_runner(tokenizer, f"http://127.0.0.1:{port}"))


async def _not_json(ws: Any) -> None:
    async for _ in ws:
        await ws.send("hello, I am not JSON")


async def _wrong_shape(ws: Any) -> None:
    async for _ in ws:
        await ws.send(json.dumps({"type": "observation", "payload": {"text": "hi"}}))


async def _silent(ws: Any) -> None:
    with contextlib.suppress(Exception):  # the client aborts the socket when it gives up
        async for _ in ws:
            pass


@pytest.mark.parametrize(
    ("handler", "cause", "words"),
    [
        (None, "connection_refused", "cannot open a session"),
        (_not_json, "protocol_error", "a reply that is not JSON: 'hello, I am not JSON'"),
        (_wrong_shape, "protocol_error", "expected {'type': ..., 'data': {...}}"),
        (_silent, "timeout", "no reply to 'reset' within timeout_s=0.5"),
    ],
    ids=["nothing-listens", "not-json", "wrong-shape", "silent"],
)
def test_each_cause_is_counted_and_its_first_logged_at_warning(
    handler: Handler | None,
    cause: str,
    words: str,
    tokenizer: PreTrainedTokenizerBase,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.DEBUG, logger=RUNNER_LOG):
        ep = asyncio.run(_served(handler, tokenizer))
    assert ep.end_reason == "env_error" and words in (ep.error or ""), ep.error
    assert ep.stats["failures"] == {cause: 3}  # every try, the last one too
    assert words in ep.stats["failure_messages"][cause]
    assert "ws://127.0.0.1:" in ep.stats["failure_messages"][cause]  # the URL
    records = [r for r in caplog.records if r.name == RUNNER_LOG]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # the rest rate-limited
    line = warnings[0].getMessage()
    assert f"({cause})" in line and words in line and "ws://127.0.0.1:" in line, line
    assert len(records) == 3  # the other two tries at DEBUG


def test_an_http_server_that_is_not_a_websocket_one_is_a_protocol_error(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    from websockets.asyncio.server import serve

    async def main() -> Episode:
        async with serve(
            _silent, "127.0.0.1", 0, process_request=lambda conn, req: conn.respond(404, "no\n")
        ) as server:
            port = server.sockets[0].getsockname()[1]
            return await _episode(_runner(tokenizer, f"http://127.0.0.1:{port}"))

    ep = asyncio.run(main())
    assert ep.stats["failures"] == {"protocol_error": 3}
    assert "does not speak OpenEnv's WebSocket protocol" in (ep.error or ""), ep.error


class _Raises:
    def reset(self, row: object) -> str:
        raise KeyError("board")

    def step(self, action: str) -> None:
        raise AssertionError("never reached")


class _BadStep:
    def reset(self, row: object) -> str:
        return "go"

    def step(self, action: str) -> dict[str, object]:
        return {"reward": 1.0}  # not a StepResult


@pytest.mark.parametrize(
    ("env", "cause", "words"),
    [
        (_Raises, "env_raised", "reset raised KeyError: 'board'"),
        (_BadStep, "protocol_error", "not a StepResult"),
    ],
)
def test_an_environment_that_raises_or_answers_the_wrong_shape(
    env: type, cause: str, words: str, tokenizer: PreTrainedTokenizerBase
) -> None:
    runner = EpisodeRunner(env, TurnFormat(tokenizer), EpisodeLimits(retries=1))
    ep = asyncio.run(_episode(runner))
    assert ep.stats["failures"] == {cause: 2}
    assert words in ep.stats["failure_messages"][cause]


def test_the_step_tally_sums_causes_and_names_the_top_ones(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    async def main() -> list[Episode]:
        refused = [await _served(None, tokenizer) for _ in range(2)]
        return [*refused, await _served(_not_json, tokenizer)]

    episodes = asyncio.run(main())
    tally = EpisodeTally()
    tally.add(episode_columns(episodes))
    causes = tally.causes()
    assert causes.startswith("connection_refused x 6 (first: reset: openenv ws://127.0.0.1:")
    assert "; protocol_error x 3 (first: reset: openenv ws://" in causes, causes
    summary = tally.summary()
    assert summary["env_failures"] == {"connection_refused": 6, "protocol_error": 3}
    assert summary["episode_end_reasons"] == {"env_error": 3}


def test_cause_of_reads_the_chain() -> None:
    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except OSError as e:
            raise RuntimeError("the client gave up") from e
    except RuntimeError as outer:
        assert cause_of(outer) == "connection_refused"
    assert cause_of(TimeoutError()) == "timeout"
    assert cause_of(json.JSONDecodeError("x", "doc", 0)) == "protocol_error"
    assert cause_of(ValueError("no"), default="agent_raised") == "agent_raised"
    assert set(CAUSES) >= {"connection_refused", "timeout", "protocol_error", "env_raised"}


def test_the_log_is_rate_limited_per_cause(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("tests.causes")
    causes = CauseLog(log, "a try failed", every_s=0.0)
    quiet = CauseLog(log, "a try failed", every_s=3600.0)
    with caplog.at_level(logging.DEBUG, logger="tests.causes"):
        for i in range(3):
            quiet.report("timeout", f"t{i}")
            quiet.report("protocol_error", f"p{i}")
        causes.report("timeout", "a")
        causes.report("timeout", "b")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "a try failed (timeout): t0",
        "a try failed (protocol_error): p0",
        "a try failed (timeout): a",
        "a try failed (timeout): 1 more time(s) in the last 0 s; the latest: b",
    ]
