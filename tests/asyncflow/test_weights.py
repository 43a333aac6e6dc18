"""Weight sync policies (the registry) and the generator hosts that follow them.

Waits are on events the code under test sets (an engine's ``update_weights`` call, a
registry change), each bounded generously; no assertion depends on how fast the machine is.
Registry-only tests run on virtual time (``tests.virtual_time``), where "at once" is exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest
import torch

from asyncflow.hosts import GeneratorHost, check_engine
from asyncflow.registry import Registry
from asyncflow.transport import make_transport
from engines import Generation, GenerationEngine, SamplingParams
from tests.virtual_time import run_virtual
from transferqueue.aio import within

BOUND_S = 60.0  # a bound on waits that end on events, not a duration being measured


class _Engine:
    """A generator whose load the test sets; records the versions it was updated to."""

    def __init__(self, in_flight: int = 0, running_tokens: int = 0) -> None:
        self.version = 0
        self.in_flight = in_flight
        self.drain_tokens = running_tokens
        self.updated: list[int] = []
        self.states: list[Mapping[str, torch.Tensor]] = []
        self.changed = asyncio.Event()

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        raise NotImplementedError

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = version
        self.updated.append(version)
        self.states.append(state)
        self.changed.set()


async def _until(cond: object, what: str) -> None:
    """Wait (bounded) until ``cond()`` holds; the hosts' followers run meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BOUND_S
    while not cond():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"not within {BOUND_S} s: {what}")
        await asyncio.sleep(0.005)


async def _quiet(registry: Registry) -> None:
    """Let every follower look at the current state (two full poll rounds of the registry)."""
    for _ in range(2):
        registry.poke()
        await asyncio.sleep(registry.poll_s * 2)


class _Run:
    """A registry, in-process weights and one host per engine, with followers running
    (``follow_source``: the hosts load what their weight source delivers)."""

    def __init__(self, engines: list[_Engine], policy: str, follow_source: bool = False) -> None:
        self.registry = Registry(0, policy=policy, poll_s=0.01)
        transport = make_transport("inprocess")
        self.weights = transport.sender()
        self.hosts = [
            GeneratorHost(
                f"g{i}",
                e,
                self.registry,
                transport.receiver(f"g{i}"),
                follow_source=follow_source,
            )
            for i, e in enumerate(engines)
        ]
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> _Run:
        for h in self.hosts:
            await h.start()
        self.tasks = [asyncio.ensure_future(h.run()) for h in self.hosts]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def publish(self, version: int) -> dict[str, torch.Tensor]:
        state = {"w": torch.full((2,), float(version))}
        self.weights.publish(state, version)
        await self.registry.publish(version)
        return state


def test_eager_updates_every_generator_at_once() -> None:
    async def go() -> None:
        engines = [_Engine(in_flight=5), _Engine(in_flight=0)]
        async with _Run(engines, "eager") as run:
            state = await run.publish(1)
            await _until(lambda: all(e.updated == [1] for e in engines), "both updated")
            for e in engines:  # handed over, not copied
                assert all(e.states[0][k] is v for k, v in state.items())
            assert await run.registry.oldest_generator_version() == 1

    asyncio.run(go())


def test_eager_hosts_following_their_weights_load_before_the_registry_hears_of_them() -> None:
    """``follow_source`` (``eager`` under Ray): a version the transport delivered is loaded by
    every host without the registry's word, before the trainer tells the registry; the
    registry then counts each update once, with the adoption taken as immediate, and a
    version published later is followed the same way. Hosts not following their source wait
    for the registry (the bound on that wait is the registry's decision, never a poll)."""

    async def go() -> None:
        engines = [_Engine(in_flight=5), _Engine(in_flight=0)]
        async with _Run(engines, "eager", follow_source=True) as run:
            reg = run.registry
            run.weights.publish({"w": torch.ones(2)}, 1)  # the transport only
            await _until(lambda: all(e.updated == [1] for e in engines), "both loaded")
            assert (await reg.admission_view())[1] == 0  # the registry was not told yet
            assert await reg.newest_generator_version() == 1  # but heard of the updates
            await reg.publish(1)
            assert reg.adoption_s == [0.0] and reg.updates == 2
            await run.publish(2)
            await _until(lambda: all(e.updated == [1, 2] for e in engines), "both at 2")
            assert reg.updates == 4 and len(reg.adoption_s) == 2
        waiting = _Engine()
        async with _Run([waiting], "eager") as run:
            run.weights.publish({"w": torch.ones(2)}, 1)
            await _quiet(run.registry)
            assert waiting.updated == []  # the registry has not said so
            await run.registry.publish(1)
            await _until(lambda: waiting.updated == [1], "updated once the registry said so")

    asyncio.run(go())


def test_on_demand_updates_idle_generators_and_one_busy_one_per_demand() -> None:
    async def go() -> None:
        busy_old = _Engine(in_flight=3, running_tokens=900)  # a long-running sample
        busy_young = _Engine(in_flight=8, running_tokens=40)
        idle = _Engine(in_flight=0)
        async with _Run([busy_old, busy_young, idle], "on_demand") as run:
            reg = run.registry
            await run.publish(1)
            # nothing to drain on the idle one: it takes the weights; the busy ones keep going
            await _until(lambda: idle.updated == [1], "idle generator updated")
            await _quiet(reg)
            assert (busy_old.updated, busy_young.updated) == ([], [])
            reg.demand(1)  # a generator holds version 1 already: no busy one is disturbed
            await _quiet(reg)
            assert busy_old.updated == busy_young.updated == []
            idle.in_flight = 4
            idle.drain_tokens = 2000
            await run.publish(2)
            await _quiet(reg)
            assert idle.updated == [1]  # busy now: waits
            reg.demand(2)  # work needs version 2 and nobody has it: the one that drains soonest
            await _until(lambda: busy_young.updated == [2], "the quickest to drain updated")
            await _quiet(reg)
            assert (busy_old.updated, idle.updated) == ([], [1])
            busy_old.in_flight = 0  # its samples finished: idle, so it catches up on its own
            await _until(lambda: busy_old.updated == [2], "the now idle generator caught up")
            assert await reg.newest_generator_version() == 2
            assert await reg.oldest_generator_version() == 1
            assert len(reg.adoption_s) == 2

    asyncio.run(go())


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="policy"):
        Registry(0, policy="lazy")


def test_publish_wakes_a_waiting_feeder_at_once() -> None:
    """The feeder waits on ``wait_changed`` while it may not admit; new weights must wake it
    (it then demands them) rather than leave it asleep until its timeout."""

    async def go() -> tuple[tuple[int, int, int], float]:
        reg = Registry(0, policy="on_demand")
        _, _, seen = await reg.admission_view()
        waiter = asyncio.ensure_future(reg.wait_changed(seen, timeout_s=60.0))
        await asyncio.sleep(0)
        await reg.publish(1)
        return await waiter, asyncio.get_running_loop().time()

    # on virtual time: it returned the new view (version 1 published, change 1) at once (loop
    # time 0), not at its 60 s timeout
    assert run_virtual(go()) == ((1, 1, 1), 0.0)


def test_a_change_between_view_and_wait_is_not_missed() -> None:
    """With the registry in another process, the feeder's view and its wait are two calls;
    a publish in between must end the wait at once."""

    async def go() -> tuple[tuple[int, int, int], float]:
        reg = Registry(0)
        _, _, seen = await reg.admission_view()
        await reg.publish(1)  # lands before the wait begins
        return await reg.wait_changed(seen, timeout_s=60.0), asyncio.get_running_loop().time()

    assert run_virtual(go()) == ((1, 1, 1), 0.0)  # at once, on virtual time


def test_a_restarted_generator_registers_with_its_own_weights_and_counts_a_restart() -> None:
    async def go() -> None:
        reg = Registry(0)
        await reg.register("g0", 0)
        await reg.report("g0", version=5)
        assert await reg.newest_generator_version() == 5
        assert await reg.register("g0", 0) == 1  # a new incarnation, back at its initial weights
        assert await reg.newest_generator_version() == 0  # never the dead one's version
        assert (await reg.stats())["restarts"] == {"g0": 1}

    asyncio.run(go())


def test_a_generator_that_left_no_longer_counts_nor_blocks_an_update() -> None:
    """``unregister`` (an instance scaled away): out of the watch and the versions, and an
    on_demand update it would have been chosen for (the lagging one cheapest to drain) goes
    to a generator still there."""

    async def go() -> None:
        reg = Registry(0, policy="on_demand", poll_s=0.01)
        await reg.register("g0", 0)
        await reg.register("g1", 0)
        await reg.report("g0", version=0, in_flight=4, drain_tokens=400)
        await reg.report("g1", version=0, in_flight=1, drain_tokens=1)
        await reg.publish(1)
        reg.demand(1)
        assert await reg.wait_update("g0", 0.05) is None  # g1 is cheaper to drain
        waiter = asyncio.ensure_future(reg.wait_update("g0", 5.0))
        await asyncio.sleep(0.02)
        await reg.unregister("g1")
        assert await waiter == 1
        assert (await reg.watch(-1, 0.0))[1].keys() == {"g0"}
        versions = (await reg.stats())["versions"]
        assert isinstance(versions, dict) and versions.keys() == {"g0"}
        await reg.unregister("g1")  # (asked twice: nothing to do)

    asyncio.run(go())


def test_registry_watch_returns_new_state_after_a_report() -> None:
    async def go() -> None:
        reg = Registry(0)
        await reg.register("g0", 0)
        seq, snap = await reg.watch(-1, timeout_s=1.0)
        assert snap == {"g0": (0, 0, 0, 0, 0)}
        waiter = asyncio.ensure_future(reg.watch(seq, timeout_s=60.0))
        await asyncio.sleep(0)
        await reg.report("g0", version=3, in_flight=7, running=5, received=9)
        seq2, snap2 = await waiter
        assert seq2 > seq and snap2 == {"g0": (3, 7, 0, 5, 9)}
        assert asyncio.get_running_loop().time() == 0.0  # at once, not at the timeout

    run_virtual(go())  # virtual time: the loop clock moves only when every task waits


class _BrokenUpdate(_Engine):
    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("weights do not fit the model")


def test_an_update_that_raises_ends_the_host_with_that_error() -> None:
    """A follower error must reach the supervisor (the run), never hang a later step."""

    async def go() -> None:
        async with _Run([_BrokenUpdate()], "eager") as run:
            await run.publish(1)
            with pytest.raises(RuntimeError, match="weights do not fit"):
                await within(run.tasks[0], BOUND_S)

    asyncio.run(go())


class _NoUpdate:
    version = 0

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        return []


class _SyncUpdate(_NoUpdate):
    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        pass


def test_engines_are_checked_against_their_protocol_at_start() -> None:
    with pytest.raises(TypeError, match=r"rollout engine _NoUpdate lacks update_weights"):
        check_engine(_NoUpdate(), GenerationEngine, "rollout")
    with pytest.raises(TypeError, match=r"update_weights with 'async def'"):
        check_engine(_SyncUpdate(), GenerationEngine, "rollout")
    check_engine(_Engine(), GenerationEngine, "rollout")  # a complete engine passes
