"""Virtual time for tests of code that models durations by sleeping.

A loaded 2-core machine stretches real sleeps unpredictably, so a test that checks *how long*
a modelled operation took must not read a real clock. Two stand-ins, both exact:

- :class:`VirtualTimeLoop`: an asyncio event loop whose ``time()`` only moves when every task
  is waiting on a timer; it then jumps straight to the next timer. ``asyncio.sleep(d)`` takes
  exactly ``d`` of loop time and no real time. Real I/O still works (the selector is real),
  but nothing waits for work in other threads: while a thread works, pending timers fire at
  once. Use it for code that models time with asyncio sleeps (the simulated engines).
- :class:`FakeClock`: ``monotonic`` and ``sleep`` for code that blocks a thread with
  ``time.sleep`` (patch it over the module's ``time``).

Code under test reads time through the loop (``loop.time()``) or the patched module, never
through ``time.monotonic()`` directly; the tests read it the same way.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["FakeClock", "VirtualTimeLoop", "run_virtual"]

T = TypeVar("T")


class _JumpingSelector(selectors.BaseSelector):
    """A real selector that, when nothing is ready and the loop would sleep until its next
    timer, returns at once with the loop's clock moved to that timer instead."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only real I/O (another thread) can wake us
            return self._real.select(None)
        self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (see the module docstring); starts at 0."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a :class:`VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)


class FakeClock:
    """``monotonic`` / ``sleep`` for blocking code: sleeping moves the clock, takes no time,
    and is recorded (``slept``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += max(0.0, seconds)
