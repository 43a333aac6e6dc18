"""The driver's wait for a stage host Ray restarts (``asyncflow.deploy.ray_nodes``): bounded
although a call to an actor Ray has not placed again waits (its node lost, no other node
with its resources), and an end for one Ray will not restart. Fake hosts: no Ray started."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from asyncflow.deploy import ray_nodes
from asyncflow.deploy.ray_nodes import NotBackError, until_alive

exceptions = pytest.importorskip("ray.exceptions")


class _Method:
    def __init__(self, answer: Callable[[], Awaitable[bool]]) -> None:
        self._answer = answer
        self.calls = 0

    def remote(self) -> Awaitable[bool]:
        self.calls += 1
        return self._answer()


class _Host:
    def __init__(self, answer: Callable[[], Awaitable[bool]]) -> None:
        self.ping = _Method(answer)


def _wait(host: Any, bound_s: float) -> None:
    asyncio.run(until_alive("rollout/instance0", host, RuntimeError("died"), bound_s))


def test_a_host_never_placed_again_ends_the_wait_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_nodes, "PING_S", 0.2)  # (each ping's own bound)

    async def never() -> bool:
        await asyncio.Event().wait()  # (Ray queues the call until the actor is placed)
        return True

    host = _Host(never)
    t0 = time.monotonic()
    with pytest.raises(NotBackError, match=r"did not come back within deploy\.start_timeout_s=1"):
        _wait(host, 1.0)
    assert 1.0 <= time.monotonic() - t0 < 3.0
    assert host.ping.calls >= 2  # asked again, not once without bound


def test_a_restarting_host_is_waited_for_until_it_answers() -> None:
    answers = iter([False, False, True])

    async def restarting() -> bool:
        if not next(answers):
            raise exceptions.ActorUnavailableError("restarting", None)
        return True

    host = _Host(restarting)
    _wait(host, 30.0)
    assert host.ping.calls == 3


def test_a_host_ray_will_not_restart_ends_the_wait_at_once() -> None:
    async def dead() -> bool:
        raise exceptions.ActorDiedError()

    t0 = time.monotonic()
    with pytest.raises(NotBackError, match="Ray will not restart it"):
        _wait(_Host(dead), 30.0)
    assert time.monotonic() - t0 < 1.0


class _Remote:
    """An actor method: ``.remote(*args)`` records the call and answers ``result``."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]], name: str, result: Any) -> None:
        self._calls, self._name, self._result = calls, name, result

    def remote(self, *args: Any) -> Awaitable[Any]:
        self._calls.append((self._name, args))

        async def answer() -> Any:
            return self._result

        return answer()


class _Actor:
    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]], **methods: Any) -> None:
        for name, result in methods.items():
            setattr(self, name, _Remote(calls, name, result))


class _Registry:
    def __init__(self) -> None:
        self.gone: list[str] = []

    async def unregister(self, name: str) -> None:
        self.gone.append(name)


def _scaler(n: int) -> tuple[Any, list[tuple[str, tuple[Any, ...]]], _Registry, list[Any]]:
    from asyncflow import load_config
    from asyncflow.deploy.ray_scale import RolloutScaler

    calls: list[tuple[str, tuple[Any, ...]]] = []
    gens = [(f"instance{i}", _Actor(calls, close=None)) for i in range(n)]
    actors: list[Any] = [a for _, a in gens]
    rollout = _Actor(calls, retire_generator=True)
    registry = _Registry()
    cfg = load_config(overrides=["deploy.mode=ray", f"rollout.instances={n}"])
    scaler = RolloutScaler(
        cfg,
        gens,
        actors,
        registry,  # type: ignore[arg-type]
        lambda i: ("", None, ""),
        lambda name, gen: lambda: asyncio.sleep(0),
        lambda: (rollout, None, "broadcast"),
    )
    return scaler, calls, registry, gens


def test_a_generator_that_did_not_come_back_leaves_the_run_while_others_remain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its node lost and no node able to take it: it leaves as a scale-down removes one (no
    drain grace: it has no call left), not ending the run; the last one is not dropped."""
    ray = pytest.importorskip("ray")
    killed: list[tuple[Any, bool]] = []
    # (the real one would start a Ray instance to refuse a fake actor)
    monkeypatch.setattr(ray, "kill", lambda a, no_restart=True: killed.append((a, no_restart)))
    scaler, calls, registry, gens = _scaler(2)
    first = gens[0][1]
    assert asyncio.run(scaler.drop("instance0", NotBackError("not placed"))) is True
    assert [n for n, _ in gens] == ["instance1"] and scaler.count() == 1
    assert "instance0" in scaler.retired  # (its job then ends quietly)
    assert ("retire_generator", ("instance0", 0.0)) in calls
    assert registry.gone == ["instance0"]
    assert killed == [(first, True)]  # stopped for good: Ray places it nowhere later
    assert asyncio.run(scaler.drop("instance1", NotBackError("not placed"))) is False
    assert scaler.count() == 1 and registry.gone == ["instance0"]


def test_a_wait_for_weights_on_a_host_not_placed_again_says_no_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rollout's wait for an instance to load a version is answered by the host at its
    own bound; a host Ray has not placed again never gets the call, so the proxy bounds it
    too (else the batch waited until a node could take the host)."""
    from asyncflow.deploy import remote

    monkeypatch.setattr(remote, "CALL_SLACK_S", 0.1)

    class _Coordinator:
        async def watch(self, seq: int, timeout_s: float) -> tuple[int, dict[str, tuple]]:
            return seq + 1, {"g0": (0, 0, 1, 0, 0)}

    calls: list[tuple[str, tuple[Any, ...]]] = []

    class _Queued(_Remote):  # (Ray queues it: no answer, no error)
        def remote(self, *args: Any) -> Awaitable[Any]:
            calls.append(("wait_version", args))
            return asyncio.Event().wait()

    async def go() -> float:
        view = remote.GeneratorView(_Coordinator())  # type: ignore[arg-type]
        await view.refresh()
        host = _Actor(calls)
        host.wait_version = _Queued(calls, "wait_version", None)  # type: ignore[attr-defined]
        proxy = remote.RemoteGenerator("g0", host, view)
        t0 = time.monotonic()
        assert await proxy.wait_version(1, 0.2) is False
        return time.monotonic() - t0

    assert 0.3 <= asyncio.run(go()) < 2.0
    assert calls == [("wait_version", (1, 0.2))]
