"""Deferred weight sync: the trainer publishes versioned weights and never waits.

After each optimizer step the train stage calls :meth:`WeightSync.publish`. One watcher task
per generation engine notices the newer version and calls ``engine.update_weights``; the
engine lands it at its next micro-batch boundary (its calls in flight finish on the old
weights, later calls see the new ones), so only the final load is ever exposed. Versions a
generator missed while busy are skipped: it always jumps to the newest.

The prompt feeder reads :meth:`newest_generator_version` for admission control and waits on
:meth:`wait_changed` when it may not admit more; the rollout routes each group only to a
generator whose weights are recent enough for it (see ``asyncflow.feeder``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping

import torch

from engines.protocols import GenerationEngine

__all__ = ["WeightSync"]


class WeightSync:
    """Latest published weights, and the generators that follow them."""

    def __init__(self, initial_version: int = 0) -> None:
        self._state: Mapping[str, torch.Tensor] | None = None
        self._version = initial_version
        self._generators: list[GenerationEngine] = []
        self._published = asyncio.Event()
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.updates = 0
        self.update_seconds = 0.0

    @property
    def version(self) -> int:
        """Newest published version."""
        return self._version

    def register(self, engine: GenerationEngine) -> None:
        self._generators.append(engine)

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
        self._published.set()

    async def wait_changed(self, timeout_s: float | None = None) -> None:
        """Wait until a generator adopts new weights (or ``timeout_s`` passes)."""
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def start(self) -> None:
        """Start one watcher per generator on the running loop."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._follow(g)) for g in self._generators]

    async def _follow(self, engine: GenerationEngine) -> None:
        while True:
            while self._state is None or engine.version >= self._version:
                self._published.clear()
                await self._published.wait()
            state, version = self._state, self._version
            t0 = time.perf_counter()
            await engine.update_weights(state, version)
            self.update_seconds += time.perf_counter() - t0
            self.updates += 1
            self._changed.set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
