"""Bounded waits that never swallow a cancellation.

On Python 3.11, ``asyncio.wait_for`` returns the inner result instead of raising
``CancelledError`` when the task is cancelled in the same loop iteration as the awaited thing
completes (fixed in 3.12, where ``wait_for`` is built on ``asyncio.timeout``). A loop such as
``while True: await wait_for(event.wait(), t)`` then survives its ``cancel()`` and whoever
waits for it to end hangs: a stage host's follower did exactly that when a generator update
set its wake-up event as the run stopped. Every bounded wait in these packages goes through
``asyncio.timeout`` (ruff bans ``asyncio.wait_for`` in ``pyproject.toml``); these two helpers
are the common shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["wait_event", "within"]

T = TypeVar("T")


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; True if it is set. A cancellation
    always propagates, whatever else happened in the same loop iteration."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(timeout_s, 0.0)):
            await event.wait()
    return event.is_set()


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw``, raising ``TimeoutError`` after ``timeout_s`` (None: no bound)."""
    async with asyncio.timeout(timeout_s):
        return await aw
