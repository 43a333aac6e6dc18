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
