"""Progress, not only liveness: what a stage holds, what it is in, and since when.

A :class:`Work` records one stage's (or one engine's) units of work as they are taken and
finished; a stage host answers the driver's probe with the snapshots of every ``Work`` it has
(:func:`host_answer`), and the driver's stall watch (:mod:`asyncflow.stall`) judges them.

| snapshot key | what                                                                     |
|--------------|--------------------------------------------------------------------------|
| ``name``     | the stage (``rollout``, ``reward``, ``train``) or engine (``rollout/    |
|              | instance0``)                                                             |
| ``what``     | what it waits for when idle: rows of which fields from which task        |
| ``done``     | units of work finished so far (batches, engine calls)                    |
| ``median_s`` | median time of the last :data:`WINDOW` units (None before the first)    |
| ``holding``  | one dict per unit in hand: ``rows``, ``lease``, ``held_s`` (since taken),|
|              | ``phase`` (``read``, ``process``, ``write``; ``generate``) and ``phase_s``,|
|              | ``quiet_s`` (since taken or its last bounded wait ended) and, in a bounded|
|              | wait (:func:`waiting`), ``bound_s``: the wait's own bound                |
| ``idle``     | workers waiting for work, and ``idle_s`` the longest wait                |

A unit that waits on something with a bound of its own (trainer rank 0 bringing a replaced rank
back, bounded by ``deploy.start_timeout_s``) says so with :func:`waiting`: the stall watch then
judges the wait by that bound, and the unit's ``quiet_s`` starts again once the wait is over
(it was not stuck: it waited on a recovery that the watch itself set off).

A snapshot is taken on the probe's own thread while the stage's loop mutates the records:
only plain containers are read, and a read that races a change is tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WINDOW", "Work", "host_answer", "thread_stacks", "waiting"]

WINDOW = 32
"""Units of work the median time is taken over."""
_STACK_FRAMES = 16
"""Innermost frames kept of each thread's and each held unit's stack."""


@dataclass
class _Unit:
    rows: int
    lease: int | None
    taken: float
    phase: str
    phase_at: float
    task: asyncio.Task[Any] | None = field(default=None, repr=False)
    frame: Any = field(default=None, repr=False)  # (the frame of the coroutine that took it)
    since: float = 0.0  # taken, or the end of its last bounded wait
    bound_s: float | None = None  # in a bounded wait: its bound


_CURRENT: contextvars.ContextVar[tuple[Work, int] | None] = contextvars.ContextVar(
    "asyncflow_progress_unit", default=None
)
"""The unit the running task holds (set by :meth:`Work.take`; tasks it starts inherit it)."""


@contextlib.contextmanager
def waiting(phase: str, bound_s: float) -> Iterator[None]:
    """The unit the calling task holds is in ``phase`` (``recover rank 1``), a wait bounded
    by ``bound_s`` of its own: judged by that bound, and quiet from its end on (see the module
    doc). Outside a unit (no stage took one in this task), nothing."""
    current = _CURRENT.get()
    unit = None if current is None else current[0]._units.get(current[1])
    if unit is None:
        yield
        return
    before = unit.phase
    unit.phase, unit.phase_at, unit.bound_s = phase, time.monotonic(), bound_s
    try:
        yield
    finally:
        now = time.monotonic()
        unit.phase, unit.phase_at, unit.since, unit.bound_s = before, now, now, None


class Work:
    """One stage's (or engine's) units of work: taken, in a phase, finished."""

    def __init__(self, name: str, what: str) -> None:
        self.name = name
        self.what = what
        self.done = 0
        self._units: dict[int, _Unit] = {}
        self._idle: dict[int, float] = {}  # worker -> waiting for work since
        self._times: deque[float] = deque(maxlen=WINDOW)
        self._next = 0

    def idle(self, worker: int) -> None:
        """``worker`` waits for work (a ``get_meta``) from now on."""
        self._idle.setdefault(worker, time.monotonic())

    def take(self, rows: int, lease: int | None = None, *, worker: int | None = None) -> int:
        """A unit of ``rows`` rows (under ``lease``) is in hand; returns its token."""
        now = time.monotonic()
        if worker is not None:
            self._idle.pop(worker, None)
        self._next += 1
        try:
            task = asyncio.current_task()
        except RuntimeError:  # (no loop: a thread)
            task = None
        caller = sys._getframe(1)
        self._units[self._next] = _Unit(rows, lease, now, "read", now, task, caller, now)
        _CURRENT.set((self, self._next))
        return self._next

    def phase(self, token: int, phase: str) -> None:
        unit = self._units.get(token)
        if unit is not None:
            unit.phase, unit.phase_at = phase, time.monotonic()

    def finish(self, token: int, *, done: bool = True) -> None:
        """The unit left this stage's hands; ``done``: it was completed (else dropped,
        given back or failed: not progress)."""
        unit = self._units.pop(token, None)
        if unit is not None and done:
            self.done += 1
            self._times.append(time.monotonic() - unit.taken)

    def snapshot(self, *, stacks: bool = False) -> dict[str, Any]:
        """What this stage holds and has done (see the module doc); ``stacks``: with the
        coroutine stack of each unit in hand."""
        for _ in range(10):
            try:
                units = list(self._units.values())
                idle = list(self._idle.values())
                times = list(self._times)
                break
            except RuntimeError:  # (changed on the stage's loop meanwhile)
                continue
        else:
            units, idle, times = [], [], []
        now = time.monotonic()
        holding = []
        for u in units:
            item: dict[str, Any] = {
                "rows": u.rows,
                "lease": u.lease,
                "held_s": now - u.taken,
                "phase": u.phase,
                "phase_s": now - u.phase_at,
                "quiet_s": now - u.since,
            }
            if u.bound_s is not None:
                item["bound_s"] = u.bound_s
            if stacks:
                item["stack"] = _unit_stack(u)
            holding.append(item)
        return {
            "name": self.name,
            "what": self.what,
            "done": self.done,
            "median_s": statistics.median(times) if times else None,
            "holding": holding,
            "idle": len(idle),
            "idle_s": now - min(idle) if idle else 0.0,
        }


def _unit_stack(unit: _Unit) -> str:
    """The await chain of the coroutine that holds ``unit``, from it inwards: found by its
    frame (``gc``: only when a stall is told), else from its task (whose outer coroutines
    may be compiled wrappers with no frame that end the chain, as Ray's are)."""
    coro: Any = None
    if unit.frame is not None:
        coro = next(
            (r for r in gc.get_referrers(unit.frame) if getattr(r, "cr_frame", None) is unit.frame),
            None,
        )
    if coro is None and unit.task is not None:
        coro = unit.task.get_coro()
    return _await_chain(coro)


def _await_chain(coro: Any) -> str:
    """``coro`` and what it awaits, outermost first (``Task.get_stack`` gives only the
    outermost frame of a suspended coroutine)."""
    frames: list[tuple[Any, int]] = []
    for _ in range(64):
        if coro is None:
            break
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:  # (a compiled wrapper, e.g. Ray's, has none: passed through)
            frames.append((frame, frame.f_lineno))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    summary = traceback.StackSummary.extract(frames[-_STACK_FRAMES:])
    return "".join(summary.format())


def thread_stacks() -> str:
    """Every thread of this process with its innermost frames (``sys._current_frames``)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        stack = traceback.format_stack(frame)[-_STACK_FRAMES:]
        out.append(f"thread {names.get(ident, ident)!r}:\n{''.join(stack)}")
    return "\n".join(out)


def host_answer(
    works: list[Work], *, stacks: bool = False, node: str | None = None, actor: str | None = None
) -> dict[str, Any]:
    """A host's answer to the driver's probe: its process, the snapshot of each of its
    ``works``, and with ``stacks`` the stacks of its threads and of its units in hand."""
    return {
        "pid": os.getpid(),
        "node": node,
        "actor": actor,
        "works": [w.snapshot(stacks=stacks) for w in works],
        "stacks": thread_stacks() if stacks else None,
    }
