"""A generator host reporting to a registry in another process (``deploy=ray``): which load
changes go out at once, which wait for ``report_s``, and an update decided on a stale "idle"
handed back. Report times on virtual time (``tests.virtual_time``: exact); the hand-back on
the real clock (the follower fetches weights in a thread), ordered by events."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import torch

from adapters.rollout import RolloutAdapter
from asyncflow.deploy.remote import RemoteGenerator
from asyncflow.hosts import GeneratorHost
from asyncflow.transport import make_transport
from engines import Generation, SamplingParams
from engines.packed import pack_generations
from tests.virtual_time import run_virtual
from transferqueue.aio import within

BOUND_S = 60.0  # a bound on waits that end on events, not a duration being measured
PROMPTS = [torch.tensor([1, 2, 3])] * 2
PARAMS = SamplingParams(max_new_tokens=4)


class _Engine:
    """A generator that counts a call in flight only once the test lets it queue (as an
    engine that awaits something first would), and ends calls when the test says."""

    def __init__(self) -> None:
        self.version = 0
        self.in_flight = 0
        self.drain_tokens = 0
        self.queue = asyncio.Event()
        self.finish = asyncio.Event()
        self.updated: list[int] = []

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        await self.queue.wait()
        self.in_flight += len(prompts)
        try:
            await self.finish.wait()
        finally:
            self.in_flight -= len(prompts)
        return []

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        self.version = version
        self.updated.append(version)


class _Elsewhere:
    """A registry in another process as the host sees it (no ``set_live``): records each
    report with the loop time it arrived; ``wait_update`` hands out what the test queues;
    while ``lag`` is clear a report of a busy engine is held in flight."""

    def __init__(self) -> None:
        self.reports: list[tuple[float, int, int, int]] = []
        self.routing: list[tuple[int, int]] = []  # (running, received) of each report
        self.arrived = asyncio.Event()
        self.taken = 0  # reports returned by next_report so far
        self.lag = asyncio.Event()
        self.lag.set()
        self.held = 0  # busy reports held in flight while ``lag`` is clear
        self.holding = asyncio.Event()
        self.decide: asyncio.Queue[int] = asyncio.Queue()
        self.failed = asyncio.Event()
        self.done: list[int] = []
        self.updated_ev = asyncio.Event()

    async def register(self, name: str, version: int) -> int:
        return 0

    async def report(
        self,
        name: str,
        *,
        version: int | None = None,
        in_flight: int | None = None,
        drain_tokens: int | None = None,
        running: int | None = None,
        received: int | None = None,
    ) -> None:
        assert version is not None and in_flight is not None and drain_tokens is not None
        assert running is not None and received is not None
        self.routing.append((running, received))
        if in_flight and not self.lag.is_set():
            self.held += 1
            self.holding.set()
            await self.lag.wait()
        self.reports.append((asyncio.get_running_loop().time(), version, in_flight, drain_tokens))
        self.arrived.set()

    async def wait_update(self, name: str, timeout_s: float) -> int | None:
        try:
            return await within(self.decide.get(), timeout_s)
        except TimeoutError:
            return None

    async def updated(self, name: str, version: int, seconds: float, **timings: float) -> None:
        pause_s, transfer_s = timings["pause_s"], timings["transfer_s"]
        assert 0 <= pause_s <= seconds and 0 <= transfer_s <= seconds  # parts of the update
        self.done.append(version)
        self.updated_ev.set()

    async def update_failed(self, name: str) -> None:
        self.failed.set()

    async def until_held(self, n: int) -> None:
        while self.held < n:
            self.holding.clear()
            await within(self.holding.wait(), BOUND_S)

    async def next_report(self) -> tuple[float, int, int, int]:
        """The first report not yet taken (in order: one sent while the test was busy
        elsewhere is not missed)."""
        while len(self.reports) <= self.taken:
            self.arrived.clear()
            await within(self.arrived.wait(), BOUND_S)
        self.taken += 1
        return self.reports[self.taken - 1]


def _host(engine: _Engine, registry: _Elsewhere) -> tuple[GeneratorHost, object]:
    transport = make_transport("inprocess")
    sender = transport.sender()
    host = GeneratorHost("g0", engine, registry, transport.receiver("g0"), report_s=1.0)
    return host, sender


def test_idle_busy_changes_go_at_once_other_changes_at_most_every_report_s() -> None:
    async def go() -> None:
        engine, registry = _Engine(), _Elsewhere()
        host, _ = _host(engine, registry)
        await host.start()
        runner = asyncio.ensure_future(host.run())
        assert await registry.next_report() == (0.0, 0, 0, 0)
        await asyncio.sleep(0.25)
        call = asyncio.ensure_future(host.generate(PROMPTS, PARAMS))
        # busy from the moment the call reaches the host (the engine has not queued it yet),
        # sent at once although the last report went out less than report_s ago
        assert await registry.next_report() == (0.25, 0, 2, 0)
        engine.queue.set()
        await asyncio.sleep(0.25)
        engine.drain_tokens = 40  # only the drain estimate moved: waits for report_s
        assert await registry.next_report() == (1.25, 0, 2, 40)
        # for routing: the engine runs both now, and the host has received both samples
        assert registry.routing[0] == (0, 0) and registry.routing[-1] == (2, 2)
        await asyncio.sleep(0.25)
        engine.finish.set()
        await call
        assert await registry.next_report() == (1.5, 0, 0, 40)  # busy -> idle: at once
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    run_virtual(go())


def test_an_update_decided_on_a_stale_idle_is_handed_back_then_taken_when_idle() -> None:
    """The registry still believes the engine idle (the busy report is in flight) and tells
    it to update: the host declines (loading now would drain the running call), reports its
    load and hands the update back; once idle again it takes the next one."""

    async def go() -> None:
        engine, registry = _Engine(), _Elsewhere()
        host, sender = _host(engine, registry)
        await host.start()
        runner = asyncio.ensure_future(host.run())
        await registry.next_report()  # idle
        registry.lag.clear()
        engine.queue.set()
        call = asyncio.ensure_future(host.generate(PROMPTS, PARAMS))
        await registry.until_held(1)  # the busy report, in flight
        assert registry.reports[-1][2] == 0  # the registry has only heard "idle"
        sender.publish({"w": torch.ones(2)}, 1)  # type: ignore[attr-defined]
        registry.decide.put_nowait(1)  # decided on that stale "idle"
        await registry.until_held(2)  # the decline reports the load before handing back
        assert (engine.updated, host.declined) == ([], 1)
        registry.lag.set()
        await within(registry.failed.wait(), BOUND_S)
        assert (engine.updated, host.declined, registry.done) == ([], 1, [])
        assert registry.reports[-1][2] == 2  # it hears "busy" before the update comes back
        engine.finish.set()
        await call
        await registry.next_report()  # idle again
        registry.decide.put_nowait(1)
        await within(registry.updated_ev.wait(), BOUND_S)
        assert (engine.updated, registry.done, host.declined) == ([1], [1], 1)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())  # real time: the follower fetches in a thread, which virtual time skips


def test_the_rollout_routes_by_the_engines_count_plus_what_it_sent_since_the_report() -> None:
    """``RemoteGenerator.in_flight``: the sequences the engine last reported running plus the
    samples dispatched after that report, never more than the calls in flight. Counting whole
    calls made an instance finishing one long-tail sample of a group look as loaded as the
    group (skew-aware dispatch then left it idle)."""

    class _View:
        snap: tuple[int, int] | None = None

        def routing(self, name: str) -> tuple[int, int] | None:
            return self.snap

        def version(self, name: str) -> int:
            return 0

    class _Actor:  # the generator actor's handle: ``generate_packed.remote`` ends on ``end``
        def __init__(self) -> None:
            self.generate_packed = self
            self.end = asyncio.Event()

        async def remote(self, flat: object, lengths: object, params: SamplingParams) -> object:
            await self.end.wait()
            return pack_generations([])

    async def go() -> None:
        view, actor = _View(), _Actor()
        proxy = RemoteGenerator("g0", actor, view)  # type: ignore[arg-type]
        group = [torch.tensor([1, 2])] * 8
        calls = [asyncio.ensure_future(proxy.generate(group, PARAMS)) for _ in range(2)]
        await asyncio.sleep(0)
        assert proxy.in_flight == 16  # nothing reported yet: whole calls
        view.snap = (1, 16)  # both calls received, one sequence of them still runs
        assert proxy.in_flight == 1
        calls.append(asyncio.ensure_future(proxy.generate(group, PARAMS)))
        await asyncio.sleep(0)
        assert proxy.in_flight == 1 + 8  # the third call is not in that report yet
        view.snap = (5, 24)
        assert proxy.in_flight == 5
        actor.end.set()
        await asyncio.gather(*calls)
        assert proxy.in_flight == 0  # no call in flight, whatever the last report said

    asyncio.run(go())


class _PublishedBetween:
    """A receiver whose first ``get`` comes just after the sender published a newer version,
    so that the version the follower picked as the newest was freed before it could pin it
    (the race of an eager sync every step)."""

    def __init__(self, receiver: object, sender: object) -> None:
        self.receiver, self.sender, self.raced = receiver, sender, False

    def __getattr__(self, name: str) -> object:
        return getattr(self.receiver, name)

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        if not self.raced:
            self.raced = True
            self.sender.publish({"w": torch.full((2,), 2.0)}, version + 1)  # type: ignore[attr-defined]
        return self.receiver.get(version)  # type: ignore[attr-defined,no-any-return]


def test_a_version_superseded_before_it_is_pinned_gives_way_to_the_newer_one() -> None:
    """The follower is told to take version 1; version 2 is published between its look at the
    newest and its ``get(1)``, which frees 1: it takes 2 instead of failing the run."""

    async def go() -> None:
        engine, registry = _Engine(), _Elsewhere()
        transport = make_transport("inprocess")
        sender = transport.sender()
        weights = _PublishedBetween(transport.receiver("g0"), sender)
        host = GeneratorHost("g0", engine, registry, weights, report_s=1.0)  # type: ignore[arg-type]
        await host.start()
        runner = asyncio.ensure_future(host.run())
        await registry.next_report()
        sender.publish({"w": torch.ones(2)}, 1)  # type: ignore[attr-defined]
        registry.decide.put_nowait(1)
        await within(registry.updated_ev.wait(), BOUND_S)
        assert weights.raced and (engine.updated, registry.done) == ([2], [2])
        assert not registry.failed.is_set()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())  # real time: the follower fetches in a thread


def test_a_batch_waiting_for_weights_is_woken_by_their_load_not_a_poll() -> None:
    """``wait_version``: a waiter for a version no one published returns False at its bound;
    one for the version about to be loaded returns True as the load lands (its bound is a
    minute; the rollout's wait for an eligible instance rests on it), and one for a version
    the engine holds already returns at once. The rollout adapter waits through it when
    every instance has it."""

    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine, registry = _Engine(), _Elsewhere()
        host, sender = _host(engine, registry)
        await host.start()
        runner = asyncio.ensure_future(host.run())
        try:
            assert not await host.wait_version(1, 0.05)
            waiter = asyncio.ensure_future(host.wait_version(1, BOUND_S))
            rollout = RolloutAdapter(host, PARAMS)
            eligible = asyncio.ensure_future(rollout._eligible(1))
            await asyncio.sleep(0.05)
            assert not waiter.done() and not eligible.done()
            sender.publish({"w": torch.ones(2)}, 1)  # type: ignore[attr-defined]
            t0 = loop.time()
            registry.decide.put_nowait(1)
            assert await within(waiter, BOUND_S) is True
            assert await within(eligible, BOUND_S) == ([0], False)
            assert loop.time() - t0 < BOUND_S / 10 and engine.updated == [1]
            assert await within(host.wait_version(1, BOUND_S), 0.5) is True
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())


class _HostHandle:
    """A generator actor's handle as the rollout's proxy calls it (``method.remote(...)``),
    answered by a real host in this process; ``dead`` makes every call fail as a dead
    actor's would."""

    def __init__(self, host: GeneratorHost) -> None:
        self.host, self.dead = host, False
        self.wait_version = self._Method(self, host.wait_version)

    class _Method:
        def __init__(self, handle: _HostHandle, fn: object) -> None:
            self.handle, self.fn = handle, fn

        async def remote(self, *args: object) -> object:
            import ray

            if self.handle.dead:
                raise ray.exceptions.RayActorError()
            return await self.fn(*args)  # type: ignore[operator]


class _Coordinator:
    """The coordinator as the rollout's view long-polls it: one generator ``g0`` at the
    version and incarnation the test sets."""

    def __init__(self) -> None:
        self.version, self.incarnation = 0, 1

    async def watch(self, seq: int, timeout_s: float) -> tuple[int, dict[str, tuple]]:
        return seq + 1, {"g0": (self.version, 0, self.incarnation, 0, 0)}


def test_a_remote_batch_waiting_for_weights_is_routed_when_the_host_loads_them() -> None:
    """Under Ray the rollout routes by the coordinator's view, which hears of a load only
    from the generator's report. ``RemoteGenerator.wait_version`` asks the host itself: the
    batch waiting for version 1 is routed as the load lands, while the view still says 0.
    What the host said counts for its incarnation only (a restarted host starts from its own
    version again), and a dead host's wait says no after a short pause, without a spin."""
    from asyncflow.deploy import remote

    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine, registry = _Engine(), _Elsewhere()
        host, sender = _host(engine, registry)
        await host.start()
        runner = asyncio.ensure_future(host.run())
        coordinator = _Coordinator()
        view = remote.GeneratorView(coordinator)  # type: ignore[arg-type]
        await view.refresh()
        handle = _HostHandle(host)
        proxy = remote.RemoteGenerator("g0", handle, view)
        try:
            rollout = RolloutAdapter(proxy, PARAMS)
            eligible = asyncio.ensure_future(rollout._eligible(1))
            await asyncio.sleep(0.05)
            assert not eligible.done() and proxy.version == 0
            sender.publish({"w": torch.ones(2)}, 1)  # type: ignore[attr-defined]
            registry.decide.put_nowait(1)
            assert await within(eligible, BOUND_S) == ([0], False)
            assert proxy.version == 1 and view.version("g0") == 0  # the host said so first
            coordinator.incarnation = 2  # restarted: its own version (0) again
            await view.refresh()
            assert proxy.version == 0
            handle.dead = True
            t0 = loop.time()
            assert await proxy.wait_version(1, BOUND_S) is False
            assert remote.LOST_WAIT_S <= loop.time() - t0 < BOUND_S / 10
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())


class _Versioned(_Engine):
    """A generator whose every sample is of the weights it holds when it generates."""

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        n = params.max_new_tokens
        return [
            Generation(torch.ones(n, dtype=torch.long), torch.zeros(n), "length", self.version)
            for _ in prompts
        ]


def test_a_batch_given_ahead_of_its_weights_starts_as_they_land_and_never_with_older() -> None:
    """``dispatch_ahead`` (``deploy=ray`` under ``weight_sync=eager``): the rollout hands a
    batch that needs version 1 to the generator actor while it still holds 0, through the real
    proxy and actor method; the host holds the call, counted neither as received nor as load
    (the weight-update policy sees an idle engine) and generates it the moment version 1 is
    loaded, every sample of version 1. A version that does not land within the bound comes
    back as nothing generated, and the proxy's count of what it sent stays true."""
    from asyncflow.deploy import remote
    from asyncflow.deploy.ray_hosts import GeneratorActor

    async def go() -> None:
        engine, registry = _Versioned(), _Elsewhere()
        host, sender = _host(engine, registry)
        await host.start()
        runner = asyncio.ensure_future(host.run())
        actor = GeneratorActor.__new__(GeneratorActor)  # (its engine built: the host above)
        actor.host, actor._registered = host, asyncio.Event()
        actor._registered.set()
        handle = _HostHandle(host)
        handle.generate_packed_after = _HostHandle._Method(  # type: ignore[attr-defined]
            handle, actor.generate_packed_after
        )
        coordinator = _Coordinator()
        view = remote.GeneratorView(coordinator)  # type: ignore[arg-type]
        await view.refresh()
        proxy = remote.RemoteGenerator("g0", handle, view)
        try:
            assert await proxy.generate_after(PROMPTS, PARAMS, 1, 0.05) is None
            assert proxy._sent == 0 and host._received == 0
            rollout = RolloutAdapter(proxy, PARAMS, dispatch_ahead=True)
            assert await within(rollout._eligible(1, ahead=True), BOUND_S) == ([0], True)
            call = asyncio.ensure_future(rollout._generate_after(0, PROMPTS, PARAMS, 1))
            await asyncio.sleep(0.05)
            assert not call.done()
            assert host._received == 0 and host._remote_load()[1] == 0  # idle to the policy
            sender.publish({"w": torch.ones(2)}, 1)  # type: ignore[attr-defined]
            registry.decide.put_nowait(1)
            gens, waited = await within(call, BOUND_S)
            assert [g.version for g in gens] == [1, 1] and waited >= 0.04
            assert host._received == len(PROMPTS) == proxy._sent
            assert proxy.version == 1 and view.version("g0") == 0  # the host said so first
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())
