"""An engine's compute keeps the normal scheduling class in a process put in the background.

A deployment may put every thread of an engine's process in Linux's ``SCHED_BATCH``
(``transferqueue.sched``, asyncflow's ``deploy.batch_sched``), so that the wake-ups of its
event loop and I/O threads never preempt running work. The engine's own compute (a
generation call, a forward-backward pass, an optimizer step) is the work that should not
wait: :func:`compute_bound` runs a method in the normal class (``SCHED_OTHER``), and puts
its thread back in ``SCHED_BATCH`` after it. Threads that were never put in the background
are left as they are (one system call per call to find out); off Linux it does nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["compute_bound"]

P = ParamSpec("P")
R = TypeVar("R")

_BATCH = getattr(os, "SCHED_BATCH", None)
_OTHER = getattr(os, "SCHED_OTHER", None)


def _in_batch() -> bool:
    return _BATCH is not None and os.sched_getscheduler(0) == _BATCH


def compute_bound(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs in ``SCHED_OTHER`` when its thread is in ``SCHED_BATCH`` (module
    docstring), and the thread goes back to ``SCHED_BATCH`` after it."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not _in_batch():
            return fn(*args, **kwargs)
        assert _BATCH is not None and _OTHER is not None
        param = os.sched_param(0)
        os.sched_setscheduler(0, _OTHER, param)
        try:
            return fn(*args, **kwargs)
        finally:
            os.sched_setscheduler(0, _BATCH, param)

    return run
