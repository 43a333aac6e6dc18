"""Turns of many episodes, sent to one engine as few ``generate`` calls.

Episodes run concurrently and each asks for one turn at a time. An engine that batches
continuously (vLLM, the simulated engine) merges concurrent calls itself; one that does not
(the HF engine runs calls one after another) would decode each turn alone. The batcher gives
both what suits them: a turn waits until every running episode of the batcher waits for a
turn too (they all go in one call), or ``gather_s`` after the first waiting turn (the others
are still with their environment), whichever comes first; ``gather_s = 0`` sends what waits
at the next pass of the event loop. Turns with different sampling parameters (a turn capped
by its episode's token budget) go in separate calls. Calls run concurrently.

    batcher = TurnBatcher(engine.generate, gather_s=0.005)
    async with batcher.episode():            # one per running episode
        gen = await batcher.generate(conversation, params)

An error of a call is raised in every turn it held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import torch

from engines.protocols import Generation, SamplingParams

__all__ = ["BatchGenerate", "TurnBatcher"]

BatchGenerate = Callable[[list[torch.Tensor], SamplingParams], Awaitable[Sequence[Generation]]]
"""A ``generate`` of many prompts (an engine's, or the rollout adapter's routed one)."""


class TurnBatcher:
    """Merges concurrent one-turn requests into ``generate`` calls (see the module docstring)."""

    def __init__(self, generate: BatchGenerate, *, gather_s: float = 0.005) -> None:
        if gather_s < 0:
            raise ValueError(f"gather_s must be >= 0, got {gather_s}")
        self._generate = generate
        self.gather_s = gather_s
        self._running = 0
        self._pending: list[tuple[torch.Tensor, SamplingParams, asyncio.Future[Generation]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._calls: set[asyncio.Task[None]] = set()
        self.calls = 0
        """``generate`` calls made."""
        self.turns = 0
        """Turns generated."""

    @contextlib.asynccontextmanager
    async def episode(self) -> AsyncIterator[None]:
        """Counts one running episode while the block runs."""
        self._running += 1
        try:
            yield
        finally:
            self._running -= 1
            self._maybe_flush()

    async def close(self) -> None:
        """Cancel the calls in flight and what still waits (when the batch is given up)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for _, _, future in self._pending:
            future.cancel()
        self._pending = []
        calls = list(self._calls)
        for task in calls:
            task.cancel()
        for task in calls:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def generate(self, prompt: torch.Tensor, params: SamplingParams) -> Generation:
        """One turn: the continuation of ``prompt`` (the conversation so far)."""
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, params, future))
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if not self._pending:
            return
        if len(self._pending) >= self._running:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.gather_s, self._flush)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending = self._pending, []
        by_params: dict[int, list[tuple[torch.Tensor, SamplingParams, asyncio.Future[Generation]]]]
        by_params = {}
        keys: list[SamplingParams] = []
        for item in pending:
            if item[2].done():  # its episode was cancelled
                continue
            for i, key in enumerate(keys):
                if key == item[1]:
                    by_params[i].append(item)
                    break
            else:
                keys.append(item[1])
                by_params[len(keys) - 1] = [item]
        for i, items in by_params.items():
            task = asyncio.get_running_loop().create_task(self._call(keys[i], items))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)

    async def _call(
        self,
        params: SamplingParams,
        items: list[tuple[torch.Tensor, SamplingParams, asyncio.Future[Generation]]],
    ) -> None:
        self.calls += 1
        self.turns += len(items)
        try:
            gens = await self._generate([p for p, _, _ in items], params)
            if len(gens) != len(items):
                raise RuntimeError(f"generate returned {len(gens)} samples for {len(items)}")
        except BaseException as e:
            for _, _, future in items:
                if not future.done():
                    future.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        for (_, _, future), gen in zip(items, gens, strict=True):
            if not future.done():
                future.set_result(gen)
