"""Generator hosts: a generation engine in its own process, its load reports, its weights.

A :class:`GeneratorHost` lives next to its engine (in the driver with ``deploy=local``, in a
Ray actor with ``deploy=ray``) and is the only thing that reads the engine's state. It

- registers the engine with the :class:`~asyncflow.registry.Registry` (again after a restart),
- reports the engine's load (``in_flight``, ``drain_tokens``) and weights ``version`` there,
- runs the weight follower: waits until the registry's policy says this engine should load
  newer weights, fetches them from its weight source (the receiving end of a weight
  transport) and calls ``engine.update_weights`` (the engine lands them at its next
  micro-batch boundary, or, with partial rollouts, at its next token boundary); it reports
  each sync's transfer time (the fetch, while the engine generates) and pause time (the
  update call) separately, and the tokens the update kept (``engine.kept_tokens``, an
  optional counter).

With a registry in another process (``deploy=ray``) the registry decides on reported loads,
which lag the engine: a change between idle and busy goes out at once, other load changes at
most every ``report_s``; and an update decided while the engine was reported idle is declined
(handed back, its load reported) if the engine is busy again by the time the weights are
fetched, because loading them then would make it drain its running requests, which is what
``on_demand`` updates of idle engines are there to avoid. A registry in this process reads
the engine live and decides on exact values; nothing is declined there.

The rollout adapter calls :meth:`GeneratorHost.generate` as it would call the engine. Errors of
the follower are not swallowed: :meth:`GeneratorHost.run` raises them, and the deployment
supervises it like a stage.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from adapters.rollout import InstanceLostError
from asyncflow.progress import Work
from asyncflow.transport.base import VersionError
from engines.protocols import Generation, GenerationEngine, SamplingParams
from transferqueue.aio import wait_event

__all__ = ["GeneratorHost", "RegistryAPI", "WeightSource", "check_engine"]

_FETCH_TRIES = 5
"""How often the follower takes a newer version when the one it picked was freed before it
could pin it (every try sees a newer one; more than a few in a row means publishing outruns
the fetch, and the error says so)."""


class RegistryAPI(Protocol):
    """The part of :class:`~asyncflow.registry.Registry` a generator host calls (directly, or
    through the coordinator actor)."""

    async def register(self, name: str, version: int) -> int: ...

    async def report(
        self,
        name: str,
        *,
        version: int | None = None,
        in_flight: int | None = None,
        drain_tokens: int | None = None,
        running: int | None = None,
        received: int | None = None,
    ) -> None: ...

    async def wait_update(self, name: str, timeout_s: float) -> int | None: ...

    async def updated(
        self,
        name: str,
        version: int,
        seconds: float,
        *,
        transfer_s: float = 0.0,
        pause_s: float = 0.0,
        kept_tokens: int = 0,
    ) -> None: ...

    async def update_failed(self, name: str) -> None: ...


class WeightSource(Protocol):
    """The receiving end of a weight transport, as the follower uses it (blocking calls; the
    follower runs them in a worker thread)."""

    def newest(self) -> int:
        """Newest version that :meth:`get` can return now (-1: none)."""
        ...

    def wait_newer(self, version: int, timeout_s: float) -> int:
        """Block until a version newer than ``version`` can be fetched (or ``timeout_s``);
        returns the newest."""
        ...

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        """The weights of ``version`` (valid until :meth:`release`); raises
        :class:`~asyncflow.transport.base.VersionError` when it is no longer available."""
        ...

    def release(self, version: int) -> None: ...


def check_engine(engine: object, protocol: type, role: str) -> None:
    """Raise ``TypeError`` naming every method or property of ``protocol`` that ``engine``
    lacks (checked when a workflow starts, not at the first call that needs it)."""
    names = [
        n
        for n in dir(protocol)
        if not n.startswith("_") and (callable(getattr(protocol, n)) or n == "version")
    ]
    missing = [n for n in names if not hasattr(engine, n)]
    wrong_async = [
        n
        for n in names
        if n not in missing
        and inspect.iscoroutinefunction(getattr(protocol, n))
        and not inspect.iscoroutinefunction(getattr(engine, n))
    ]
    if missing or wrong_async:
        parts = []
        if missing:
            parts.append(f"lacks {', '.join(missing)}")
        if wrong_async:
            parts.append(f"must define {', '.join(wrong_async)} with 'async def'")
        raise TypeError(
            f"the {role} engine {type(engine).__name__} {' and '.join(parts)}: implement "
            f"engines.protocols.{protocol.__name__}"
        )


class GeneratorHost:
    """One generation engine, registered under ``name``, following published weights."""

    def __init__(
        self,
        name: str,
        engine: GenerationEngine,
        registry: RegistryAPI,
        weights: WeightSource,
        *,
        report_s: float = 0.1,
        poll_s: float = 5.0,
        follow_source: bool = False,
    ) -> None:
        check_engine(engine, GenerationEngine, "rollout")
        self.name = name
        self.engine = engine
        self.registry = registry
        self.weights = weights
        self.report_s = report_s
        self.poll_s = poll_s
        self.follow_source = follow_source and getattr(weights, "watch", None) is not None
        """Load each version as soon as the weight source has it, instead of when the
        registry says: the ``eager`` policy's decision (every generator updates at once),
        taken here without the round trip through the registry (in another process under
        Ray, told by the trainer after its transport delivered). The registry hears of the
        update as before. Needs a source with ``watch`` (the transports' receivers)."""
        self.work = Work(name, "generate calls from the rollout")
        """The engine's calls in hand and done (:mod:`asyncflow.progress`), for the stall
        watch."""
        self.replaced = 0
        """Engines replaced because they were stuck (:meth:`replace`)."""
        self._calls = 0  # samples of generate calls in flight (engines without in_flight)
        self._dirty = asyncio.Event()
        self._loaded = asyncio.Event()  # set (and replaced) at every weight update
        self._reported: tuple[int, int, int, int, int] | None = None  # a remote registry's
        self._received = 0  # samples of generate calls received so far (reported for routing)
        self.updates = 0
        self.declined = 0
        """Updates handed back because the engine was busy again (remote registries only)."""

    @property
    def version(self) -> int:
        return int(self.engine.version)

    async def wait_version(self, version: int, timeout_s: float) -> bool:
        """Wait until the engine holds ``version`` or a newer one (True), at most
        ``timeout_s`` (False): woken by the update itself, so a batch waiting for the
        weights just published starts as soon as they are loaded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.version < version:
            left = deadline - loop.time()
            if left <= 0:
                return False
            await wait_event(self._loaded, left)
        return True

    @property
    def in_flight(self) -> int:
        """Sequences accepted and not finished, as the engine counts them (else the samples
        of the calls in flight)."""
        n = getattr(self.engine, "in_flight", None)
        return self._calls if n is None else int(n)

    def _load(self) -> tuple[int, int, int]:
        """(version, in_flight, drain_tokens) for the weight-update policy. Engines that do
        not count their own in-flight sequences count as idle (updated at once)."""
        e = self.engine
        return int(e.version), int(getattr(e, "in_flight", 0)), int(getattr(e, "drain_tokens", 0))

    async def start(self) -> None:
        """Register (call before the first :meth:`generate`)."""
        await self.registry.register(self.name, self.version)
        set_live = getattr(self.registry, "set_live", None)
        if set_live is not None:  # the registry is in this process: it reads the engine live
            set_live(self.name, self._load)

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self._calls += len(prompts)
        self._received += len(prompts)
        self._dirty.set()
        token = self.work.take(len(prompts))
        self.work.phase(token, "generate")
        done = False
        replaced = self.replaced
        try:
            gens = list(await self.engine.generate(prompts, params))
            done = True
            return gens
        except Exception as e:
            if self.replaced != replaced:  # (the stuck engine it was on was replaced)
                raise InstanceLostError(
                    f"generator {self.name!r} was replaced while this call was on it: {e}"
                ) from e
            raise
        finally:
            self.work.finish(token, done=done)
            self._calls -= len(prompts)
            self._dirty.set()

    async def generate_after(
        self,
        prompts: Sequence[torch.Tensor],
        params: SamplingParams,
        version: int,
        timeout_s: float,
    ) -> tuple[list[Generation], float] | None:
        """:meth:`generate` once the engine holds ``version`` or a newer one, and the seconds
        waited for it; None (nothing generated) after ``timeout_s``. A batch given before its
        weights landed starts with the load itself. It counts as received, and as load, only
        from then on: an engine waiting for weights is idle to the weight-update policy
        (``adapters.rollout.AheadInstance``)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if not await self.wait_version(version, timeout_s):
            return None
        waited = loop.time() - t0
        return await self.generate(prompts, params), waited

    @property
    def replaceable(self) -> bool:
        """Whether :meth:`replace` can replace the engine (it can build itself again)."""
        return callable(getattr(self.engine, "spawn_again", None))

    async def replace(self) -> bool:
        """Replace a stuck engine (``spawn_again``: ``engines.hf.process``'s child process)
        with a new one holding the weights of the version it held (fetched from the weight
        source again); the calls in flight on the stuck one fail as a lost instance's
        (``InstanceLostError``: the rollout generates their batches again). False for an
        engine that cannot build itself again."""
        old = self.engine
        again = getattr(old, "spawn_again", None)
        if not callable(again):
            return False
        new = await asyncio.to_thread(again)
        target = int(old.version)
        if target > int(getattr(new, "initial_version", new.version)):
            version, state = await asyncio.to_thread(self._fetch, target)
            try:
                await new.update_weights(state, version)
            finally:
                self.weights.release(version)
        self.engine = new
        self.replaced += 1
        stop = getattr(old, "kill", None) or getattr(old, "close", None)
        if callable(stop):
            await asyncio.to_thread(stop)  # (its calls in flight fail now)
        self._dirty.set()
        return True

    async def run(self) -> None:
        """Follow published weights and report the load until cancelled; raises what the
        engine's ``update_weights`` or the weight source raised."""
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._follow_weights() if self.follow_source else self._follow())
                if getattr(self.registry, "set_live", None) is None:
                    tg.create_task(self._report())
        except ExceptionGroup as eg:  # one part failed (cancellation propagates as is)
            raise eg.exceptions[0] from None

    def _remote_load(self) -> tuple[int, int, int, int, int]:
        """:meth:`_load` as reported to a registry elsewhere, then what the rollout routes by.

        ``in_flight`` (the weight-update policy's): a call counts from the moment it reaches
        this host (an engine may await something before it queues the call's requests), so the
        registry never sees an idle engine that is about to run. ``running``: the sequences
        the engine runs (else the samples of the calls here), and ``received``: the samples
        received so far, so the rollout can add what it dispatched after this report."""
        version, in_flight, drain = self._load()
        running = self.in_flight
        if getattr(self.engine, "in_flight", None) is not None:
            in_flight = max(in_flight, self._calls)
        return version, in_flight, drain, running, self._received

    async def _send(self, load: tuple[int, int, int, int, int]) -> None:
        version, in_flight, drain, running, received = load
        await self.registry.report(
            self.name,
            version=version,
            in_flight=in_flight,
            drain_tokens=drain,
            running=running,
            received=received,
        )
        self._reported = load

    async def _report(self) -> None:
        """Send the load to a registry in another process when it changed.

        A new version, or a change between idle and busy, goes at once: the weight-update
        policy decides on them (``on_demand`` updates idle engines at once), and a decision on
        a stale "idle" costs a declined update, a stale "busy" a missed chance to update while
        idle. Other changes (how many sequences run, the drain estimate, which moves while
        they decode) go at most every ``report_s``: the policy only ranks busy engines by them.
        """
        loop = asyncio.get_running_loop()
        sent_at = -math.inf
        while True:
            self._dirty.clear()
            now, last = self._remote_load(), self._reported
            timeout = self.report_s
            if now != last:
                urgent = last is None or now[0] != last[0] or (now[1] > 0) != (last[1] > 0)
                wait = sent_at + self.report_s - loop.time()
                if urgent or wait <= 0:
                    await self._send(now)
                    sent_at = loop.time()
                    continue
                timeout = wait
            await wait_event(self._dirty, timeout)

    def _busy_again(self) -> bool:
        """The registry (in another process) last heard this engine was idle, and it is busy
        now: an update decided on that report would drain the running requests."""
        if getattr(self.registry, "set_live", None) is not None or self._reported is None:
            return False
        return self._reported[1] == 0 and self._remote_load()[1] > 0

    async def _follow(self) -> None:
        """Load what the registry's policy decides, when it decides."""
        while True:
            target = await self.registry.wait_update(self.name, self.poll_s)
            if target is not None:
                await self._take(target, decided=True)

    async def _follow_weights(self) -> None:
        """``follow_source``: load each version as its weights arrive."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()

        def wake() -> None:  # (on the receiver's thread)
            with contextlib.suppress(RuntimeError):  # (the loop closed)
                loop.call_soon_threadsafe(arrived.set)

        stop = self.weights.watch(wake)  # type: ignore[attr-defined]
        try:
            while True:
                arrived.clear()
                newest = self.weights.newest()
                if newest > self.version:
                    await self._take(newest, decided=False)
                else:  # (the poll: a bound, never the way news arrives)
                    await wait_event(arrived, self.poll_s)
        finally:
            stop()

    async def _take(self, target: int, *, decided: bool) -> None:
        """Fetch and load ``target`` (or a newer version), then tell the registry. ``decided``:
        the registry chose this update from a report, which the engine may have outdated
        (busy again): then it is handed back."""
        t0 = time.perf_counter()
        replaced = self.replaced
        try:
            if getattr(self.weights, "lookup_only", False) and self.weights.newest() >= target:
                version, state = self._fetch(target)  # a lookup: no thread hop
            else:
                version, state = await asyncio.to_thread(self._fetch, target)
            try:
                if decided and self._busy_again():  # hand it back; the registry decides again
                    self.declined += 1
                    await self._send(self._remote_load())
                    await self.registry.update_failed(self.name)
                    return
                kept = self._kept_tokens()
                t1 = time.perf_counter()
                await self.engine.update_weights(state, version)
                t2 = time.perf_counter()
            finally:
                self.weights.release(version)
        except BaseException as e:
            with contextlib.suppress(Exception):
                await self.registry.update_failed(self.name)
            if self.replaced != replaced and isinstance(e, Exception):
                return  # the stuck engine it was loading into was replaced: decided again
            raise
        self.updates += 1
        loaded, self._loaded = self._loaded, asyncio.Event()
        loaded.set()  # batches waiting for this version go now (wait_version)
        await self.registry.updated(
            self.name,
            version,
            t2 - t0,
            transfer_s=t1 - t0,
            pause_s=t2 - t1,
            kept_tokens=self._kept_tokens() - kept,
        )
        self._dirty.set()

    def _kept_tokens(self) -> int:
        """The engine's count of tokens partial updates kept (0 for engines without one)."""
        return int(getattr(self.engine, "kept_tokens", 0))

    def _fetch(self, target: int) -> tuple[int, Mapping[str, torch.Tensor]]:
        """The newest version at least ``target`` and its state, pinned (to be released).

        A version picked as the newest may be superseded, and freed, before ``get`` pins it
        (a newer one was published in between): then the newer one is taken, a bounded number
        of times (each retry sees a strictly newer version, and publishing is one step apart).
        """
        for _ in range(_FETCH_TRIES - 1):
            version = self._fetchable(target)
            try:
                return version, self.weights.get(version)
            except VersionError:
                if self.weights.newest() <= version:  # not superseded: a real error
                    raise
        version = self._fetchable(target)
        return version, self.weights.get(version)

    def _fetchable(self, target: int) -> int:
        """The newest version the weight source has, at least ``target`` (published means
        fetchable; a short wait covers a transport that announces before it delivers)."""
        newest = self.weights.newest()
        if newest < target:
            newest = self.weights.wait_newer(target - 1, self.poll_s)
        if newest < target:
            raise TimeoutError(
                f"generator {self.name!r}: weights version {target} was published but the "
                f"weight source has only {newest} after {self.poll_s} s"
            )
        return newest
