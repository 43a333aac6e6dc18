"""Deferred weight sync: the trainer publishes versioned weights and never waits.

After each optimizer step the train stage calls :meth:`WeightSync.publish`. One watcher task
per generation engine notices the newer version and calls ``engine.update_weights``; the
engine lands it at its next micro-batch boundary (its calls in flight finish on the old
weights, later calls see the new ones), so only the final load is ever exposed. Versions a
generator missed while busy are skipped: it always jumps to the newest.

The prompt feeder reads :meth:`newest_generator_version` for admission control and waits on
:meth:`wait_changed` when it may not admit more; the rollout routes each group only to a
generator whose weights are recent enough for it (see ``asyncflow.feeder``).

Two policies decide *when* a generator takes a newer version:

- ``eager``: at once. Every generator then drains its running requests after every step
  (vLLM's ``pause_generation(mode="wait")``): with long-tailed lengths an instance that runs
  one 8k-token sample admits nothing new until it ends.
- ``on_demand``: when the generator is idle (nothing in flight, so nothing to drain), or when
  the workflow needs newer weights than any generator holds: the feeder may not admit the
  next step's groups, or the rollout holds a group no generator is recent enough for
  (:meth:`demand`). Then only one lagging generator updates: the one likely to drain
  soonest (``drain_tokens``: its running requests' likely remaining tokens, as the engine
  estimates them). Generators a version or two behind keep taking the groups their weights
  are recent enough for, so the staleness bound holds exactly as with ``eager`` (it is
  enforced per group at routing); what changes is that a long-running sample no longer
  stalls its instance at every step.
  Needs engines that report ``in_flight``; others are treated as idle (updated at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import torch

from engines.protocols import GenerationEngine

__all__ = ["POLICIES", "WeightSync"]

POLICIES = ("eager", "on_demand")


class WeightSync:
    """Latest published weights, and the generators that follow them."""

    def __init__(
        self, initial_version: int = 0, *, policy: str = "eager", poll_s: float = 0.05
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"weight sync policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.poll_s = poll_s
        self._state: Mapping[str, torch.Tensor] | None = None
        self._version = initial_version
        self._generators: list[GenerationEngine] = []
        self._published = asyncio.Event()
        self._changed = asyncio.Event()
        self._wake: list[asyncio.Event] = []
        self._need = -1
        self._updating: set[int] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.updates = 0
        self.update_seconds = 0.0
        self._published_at: dict[int, float] = {}
        self.adoption_s: list[float] = []
        """Per published version, seconds until the first generator held it (or newer)."""

    @property
    def version(self) -> int:
        """Newest published version."""
        return self._version

    def register(self, engine: GenerationEngine) -> None:
        self._generators.append(engine)
        self._wake.append(asyncio.Event())

    def demand(self, version: int) -> None:
        """Some work needs weights of at least ``version`` (``on_demand``: if no generator
        holds them, the lagging one likely to drain soonest updates)."""
        if version > self._need:
            self._need = version
        self.poke()

    def poke(self) -> None:
        """Something changed that may let a generator update (it finished work, or a demand):
        the watchers look again."""
        for ev in self._wake:
            ev.set()

    def generator_version(self) -> int:
        """The oldest weights version any registered generator holds."""
        if not self._generators:
            return self._version
        return min(max(g.version, 0) for g in self._generators)

    def newest_generator_version(self) -> int:
        """The newest weights version any registered generator holds."""
        if not self._generators:
            return self._version
        return max(max(g.version, 0) for g in self._generators)

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``state`` the newest weights (called by the trainer; returns at once)."""
        if version <= self._version and self._state is not None:
            raise ValueError(f"published version {version} is not newer than {self._version}")
        self._state, self._version = state, version
        self._published_at[version] = time.perf_counter()
        self._published.set()
        self._changed.set()  # a waiting feeder may now demand them

    async def wait_changed(self, timeout_s: float | None = None) -> None:
        """Wait until new weights are published or a generator adopts some (or ``timeout_s``
        passes)."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def start(self) -> None:
        """Start one watcher per generator on the running loop."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(i)) for i in range(len(self._generators))]

    def _may_update(self, i: int) -> bool:
        """``on_demand``: whether generator ``i`` should take the newest weights now."""
        engine = self._generators[i]
        if not getattr(engine, "in_flight", 0):
            return True  # idle: nothing to drain
        newest = max(g.version for g in self._generators)
        if self._need <= newest or self._updating:
            return False  # some generator is recent enough, or one is already updating
        lagging = [j for j, g in enumerate(self._generators) if g.version < self._need]
        return i == min(lagging, key=self._drain_cost)

    def _drain_cost(self, i: int) -> tuple[int, int]:
        """What an update of generator ``i`` would wait for: the tokens its running requests
        are likely to need if the engine estimates them (``drain_tokens``), then its requests
        in flight."""
        g = self._generators[i]
        return (getattr(g, "drain_tokens", 0), getattr(g, "in_flight", 0))

    async def _follow(self, i: int) -> None:
        engine, wake = self._generators[i], self._wake[i]
        while True:
            while self._state is None or engine.version >= self._version:
                self._published.clear()
                await self._published.wait()
            if self.policy == "on_demand":
                while not self._may_update(i):
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), self.poll_s)
            state, version = self._state, self._version
            assert state is not None
            self._updating.add(i)
            t0 = time.perf_counter()
            try:
                await engine.update_weights(state, version)
            finally:
                self._updating.discard(i)
            now = time.perf_counter()
            self.update_seconds += now - t0
            self.updates += 1
            for v in [v for v in self._published_at if v <= version]:
                self.adoption_s.append(now - self._published_at.pop(v))
            self._changed.set()
            self.poke()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
