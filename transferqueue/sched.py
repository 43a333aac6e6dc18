"""Put a whole process in Linux's ``SCHED_BATCH`` scheduling class: :func:`batch_process`.

A thread in ``SCHED_BATCH`` gets the same share of a busy core as any other and runs at once
on an idle one, but its wake-ups never preempt a running thread: it waits for the running
one's time slice to end. A server or a stage host wakes hundreds of times a second (its event
loop, ZeroMQ's and Ray's I/O threads, one wake-up per message); on a machine with few cores
each wake-up that lands on the core of a generation or training step takes the core from it
for a moment. When every process of a deployment is in ``SCHED_BATCH``, a compute step keeps
its core for its whole slice and the wake-ups go to the other cores or wait their turn.

Linux lets any process move its threads between ``SCHED_OTHER`` and ``SCHED_BATCH`` (no
privilege, the niceness unchanged); threads started later inherit the class of the thread
that starts them. Elsewhere (another OS, a kernel without it) it does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["batch_process", "in_batch", "zmq_in_batch"]

log = logging.getLogger(__name__)

_PASSES = 4  # threads a thread starts while the others are being moved: looked for again


def _policy() -> int | None:
    """``SCHED_BATCH`` where this platform has it, else None."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return None
    return int(policy)


def batch_process() -> int:
    """Move every thread of this process to ``SCHED_BATCH`` (module docstring); the threads
    they start later inherit it. Returns how many threads it moved (0 where the platform has
    no such class). A thread that ends meanwhile is skipped; a refusal is logged, never
    raised: the process runs on as it was."""
    policy = _policy()
    if policy is None:
        return 0
    param = os.sched_param(0)
    done: set[int] = set()
    moved = 0
    for _ in range(_PASSES):
        try:
            tids = {int(t) for t in os.listdir("/proc/self/task")}
        except OSError:  # (no /proc: the calling thread alone)
            tids = {0}
        todo = tids - done
        if not todo:
            break
        for tid in todo:
            done.add(tid)
            try:
                os.sched_setscheduler(tid, policy, param)
            except ProcessLookupError:  # (the thread ended)
                continue
            except OSError as e:
                log.warning("could not put thread %d in SCHED_BATCH: %s", tid, e)
                return moved
            moved += 1
    return moved


def in_batch() -> bool:
    """Whether the calling thread is in ``SCHED_BATCH``."""
    policy = _policy()
    return policy is not None and os.sched_getscheduler(0) == policy


def zmq_in_batch(ctx: Any) -> None:
    """Give a ZeroMQ context's I/O threads (started with its first socket) ``SCHED_BATCH``
    when the calling thread is in it. They would not inherit it: libzmq sets a new thread's
    class from the one glibc remembers for the thread that starts it, which a move by
    :func:`batch_process` (a system call) leaves as it was."""
    policy = _policy()
    if policy is not None and in_batch():
        import zmq

        ctx.set(zmq.THREAD_SCHED_POLICY, policy)
