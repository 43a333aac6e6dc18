"""The OpenEnv client against a real OpenEnv server (OpenEnv's own server library, the game of
``tests/engines/openenv_game.py``, started on loopback by each test and stopped)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from asyncflow.config import ConfigError
from asyncflow.config.check import check_config
from engines.envs import environment_factory
from tests.asyncflow.conftest import small_config
from tests.engines.openenv_game import get, serve


def _client(url: str, **options: object) -> object:
    return environment_factory("openenv", {"url": url, **options})()


def test_an_episode_is_one_session_with_several_steps() -> None:
    from engines.envs.openenv import OpenEnvClient

    async def play(url: str) -> list[object]:
        env = _client(url, reset_fields=["answer"])
        assert isinstance(env, OpenEnvClient)
        try:
            first = await env.reset({"prompt": "Guess.", "answer": 5})
            results = [await env.step(text) for text in ("8", "hmm", "3", "I say 5")]
            state = await env.state()
        finally:
            await env.close()
            await env.close()  # idempotent
        return [first, results, state]

    with serve() as (url, _):
        first, results, state = asyncio.run(play(url))
        counts = get(url + "/sessions")
    assert first == "Your guess?"
    assert [(r.observation, r.reward, r.done) for r in results] == [  # type: ignore[attr-defined]
        ("lower", 0.0, False),
        ("say a number", 0.0, False),
        ("higher", 0.0, False),
        (None, 1.0, True),
    ]
    assert results[1].info == {"no_number": 1.0}  # type: ignore[attr-defined]
    assert state["step_count"] == 4  # type: ignore[index]
    assert counts == {"open": 0, "peak": 1, "episodes": 1}  # one session, closed


def shout(text: str) -> dict[str, object]:
    """An action function of the tests' own (``action=`` by import path)."""
    return {"message": text.upper() + " 5"}


def bracketed(observation: dict[str, object]) -> str:
    """A rendering of the tests' own (``render=`` by import path)."""
    return f"[{observation['text']}]"


def wrong_field(text: str) -> dict[str, object]:
    return {"guess": text}  # the server's action has ``message``, not ``guess``


def test_action_and_rendering_are_the_users_functions() -> None:
    async def play(url: str) -> tuple[object, object]:
        env = _client(
            url,
            reset_fields=["answer"],
            action="tests.engines.test_openenv:shout",
            render="tests.engines.test_openenv:bracketed",
        )
        try:
            first = await env.reset({"answer": 5})  # type: ignore[attr-defined]
            return first, await env.step("go")  # type: ignore[attr-defined]
        finally:
            await env.close()  # type: ignore[attr-defined]

    with serve() as (url, _):
        first, result = asyncio.run(play(url))
    assert first == "[Your guess?]"
    assert (result.reward, result.done) == (1.0, True)  # type: ignore[attr-defined]


def test_an_error_reply_is_the_infrastructure_error() -> None:
    """An action the server cannot validate gets an error reply: :class:`OpenEnvError`
    naming the server's message; the session is closed cleanly afterwards."""
    from engines.envs.openenv import OpenEnvError

    async def play(url: str) -> str:
        env = _client(url, action="tests.engines.test_openenv:wrong_field")
        try:
            await env.reset({})  # type: ignore[attr-defined]
            with pytest.raises(OpenEnvError, match="'step' failed on the server") as e:
                await env.step("3")  # type: ignore[attr-defined]
            return str(e.value)
        finally:
            await env.close()  # type: ignore[attr-defined]

    with serve() as (url, _):
        message = asyncio.run(play(url))
        counts = get(url + "/sessions")
    assert "VALIDATION_ERROR" in message
    assert counts["open"] == 0


def test_the_servers_cap_is_learnt_and_never_exceeded() -> None:
    """The server allows 2 sessions; 6 episodes at once with no cap of their own: the refused
    ones wait for a slot and all finish; the server never had more than 2 environments."""

    async def episode(url: str, secret: int) -> float:
        env = _client(url, reset_fields=["answer"], timeout_s=20.0)
        try:
            await env.reset({"answer": secret})  # type: ignore[attr-defined]
            for guess in (1, 2, 3, secret):
                result = await env.step(str(guess))  # type: ignore[attr-defined]
                await asyncio.sleep(0.02)
                if result.done:
                    return float(result.reward)
            return 0.0
        finally:
            await env.close()  # type: ignore[attr-defined]

    async def many(url: str) -> list[float]:
        return await asyncio.gather(*(episode(url, s) for s in range(4, 10)))

    with serve(max_sessions=2) as (url, _):
        rewards = asyncio.run(many(url))
        counts = get(url + "/sessions")
    assert rewards == [1.0] * 6
    assert counts == {"open": 0, "peak": 2, "episodes": 6}


def test_a_dead_server_raises_the_infrastructure_error() -> None:
    """A server killed mid-episode, then one not there at all: both are the taxonomy's
    infrastructure failure (:class:`engines.envs.EnvError`, an ``env_error`` episode)."""
    from engines.envs import EnvError
    from engines.envs.openenv import OpenEnvError

    async def play(url: str, proc: object) -> tuple[BaseException, BaseException]:
        env = _client(url, timeout_s=2.0, connect_retries=1)
        await env.reset({})  # type: ignore[attr-defined]
        proc.kill()  # type: ignore[attr-defined]
        proc.wait()  # type: ignore[attr-defined]
        with pytest.raises(OpenEnvError, match="closed mid-episode") as mid:
            await env.step("3")  # type: ignore[attr-defined]
        await env.close()  # type: ignore[attr-defined]
        fresh = _client(url, timeout_s=2.0, connect_retries=1)
        with pytest.raises(OpenEnvError, match="cannot open a session") as start:
            await fresh.reset({})  # type: ignore[attr-defined]
        await fresh.close()  # type: ignore[attr-defined]
        return mid.value, start.value

    with serve() as (url, proc):
        mid, start = asyncio.run(play(url, proc))
    assert isinstance(mid, EnvError) and isinstance(start, EnvError)


def test_replay_carries_an_episode_across_a_new_session() -> None:
    """``replay=True``: the socket drops mid-episode (closed under the client: the server
    ends that session and its environment), the client opens a new session, resets it with
    the same data, replays the turns taken, and the episode goes on."""

    async def play(url: str, proc: object) -> object:
        env = _client(url, reset_fields=["answer"], replay=True, timeout_s=5.0)
        try:
            await env.reset({"answer": 5})  # type: ignore[attr-defined]
            await env.step("8")  # type: ignore[attr-defined]
            await env._ws.close()  # type: ignore[attr-defined]
            result = await env.step("5")  # type: ignore[attr-defined]
            state = await env.state()  # type: ignore[attr-defined]
            return result, state
        finally:
            await env.close()  # type: ignore[attr-defined]

    with serve() as (url, proc):
        (result, state) = asyncio.run(play(url, proc))  # type: ignore[misc]
        counts = get(url + "/sessions")
    assert (result.reward, result.done) == (1.0, True)  # type: ignore[attr-defined]
    assert state["step_count"] == 2  # the replayed turn and this one
    assert counts["episodes"] == 2 and counts["open"] == 0


def test_without_the_extras_naming_them_fails_before_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "websockets", None)
    monkeypatch.setitem(sys.modules, "websockets.asyncio.client", None)
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)
    for name, extra in (("openenv", "openenv"), ("skyrl_gym:gsm8k_multi_turn", "skyrl-gym")):
        options = (
            "env.options={url: 'http://127.0.0.1:9'}" if name == "openenv" else "env.options={}"
        )
        cfg = small_config(tmp_path, "task=guess_number", options, f"env.name={name}")
        with pytest.raises(ConfigError) as e:
            check_config(cfg)
        message = str(e.value)
        assert "\n" not in message
        assert f"pip install 'asyncflow[{extra}]'" in message, message


def test_bad_options_fail_before_the_run(tmp_path: Path) -> None:
    for options, words in (
        ("{}", "url"),
        ("{url: 'ftp://x'}", "http://host:port"),
        ("{url: 'http://h:1', action: 'nope.mod:fn'}", "nope"),
    ):
        cfg = small_config(
            tmp_path, "task=guess_number", "env.name=openenv", f"env.options={options}"
        )
        with pytest.raises(ConfigError, match=words):
            check_config(cfg)
