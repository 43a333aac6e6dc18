"""Weight sync policies: when generators take published weights."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
import torch

from asyncflow.weights import WeightSync
from engines import Generation, SamplingParams


class _Engine:
    """A generator whose load the test sets; records the versions it was updated to."""

    def __init__(self, in_flight: int = 0, running_tokens: int = 0) -> None:
        self.version = 0
        self.in_flight = in_flight
        self.drain_tokens = running_tokens
        self.updated: list[int] = []

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        raise NotImplementedError

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = version
        self.updated.append(version)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.005)


def test_eager_updates_every_generator_at_once() -> None:
    async def go() -> list[_Engine]:
        engines = [_Engine(in_flight=5), _Engine(in_flight=0)]
        sync = WeightSync(0, policy="eager")
        for e in engines:
            sync.register(e)
        sync.start()
        sync.publish({}, 1)
        await _settle()
        await sync.close()
        return engines

    assert [e.updated for e in asyncio.run(go())] == [[1], [1]]


def test_on_demand_updates_idle_generators_and_one_busy_one_per_demand() -> None:
    async def go() -> None:
        busy_old = _Engine(in_flight=3, running_tokens=900)  # a long-running sample
        busy_young = _Engine(in_flight=8, running_tokens=40)
        idle = _Engine(in_flight=0)
        sync = WeightSync(0, policy="on_demand", poll_s=0.01)
        for e in (busy_old, busy_young, idle):
            sync.register(e)
        sync.start()
        sync.publish({}, 1)
        await _settle()
        # nothing to drain on the idle one: it takes the weights; the busy ones keep going
        assert (busy_old.updated, busy_young.updated, idle.updated) == ([], [], [1])
        sync.demand(1)  # a generator holds version 1 already: no busy one is disturbed
        await _settle()
        assert busy_old.updated == busy_young.updated == []
        idle.in_flight = 4
        idle.drain_tokens = 2000
        sync.publish({}, 2)
        await _settle()
        assert idle.updated == [1]  # busy now: waits
        sync.demand(2)  # work needs version 2 and nobody has it: the one that drains soonest
        await _settle()
        assert (busy_young.updated, busy_old.updated, idle.updated) == ([2], [], [1])
        busy_old.in_flight = 0  # its samples finished: idle, so it catches up on its own
        sync.poke()
        await _settle()
        assert busy_old.updated == [2]
        assert sync.newest_generator_version() == 2 and sync.generator_version() == 1
        assert len(sync.adoption_s) == 2
        await sync.close()

    asyncio.run(go())


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="policy"):
        WeightSync(0, policy="lazy")


def test_publish_wakes_a_waiting_feeder_at_once() -> None:
    """The feeder waits on ``wait_changed`` while it may not admit; new weights must wake it
    (it then demands them) rather than leave it asleep until its timeout."""

    async def go() -> float:
        sync = WeightSync(0, policy="on_demand")
        sync.register(_Engine(in_flight=3, running_tokens=500))
        waiter = asyncio.ensure_future(sync.wait_changed(timeout_s=5.0))
        await asyncio.sleep(0.01)
        t0 = asyncio.get_running_loop().time()
        sync.publish({}, 1)
        await waiter
        return asyncio.get_running_loop().time() - t0

    assert asyncio.run(go()) < 0.5
