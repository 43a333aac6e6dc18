"""The ZeroMQ context that a process's client handles share.

ZeroMQ's advice is one context per process: a context holds an I/O thread, a reaper thread
and their descriptors, and serves any number of sockets. A client handle
(``transferqueue.connect``) makes its sockets from this one, for its event loop and for its
blocking calls (:mod:`transferqueue.client.direct`), so a process that opens thousands of
handles (a load generator, a server of many sessions) holds thousands of sockets, not
thousands of contexts: measured, a handle then costs about a dozen descriptors and no
thread of its own beyond its event loop's, instead of 27 descriptors and three threads more.

It admits as many sockets as the process may open descriptors (``ulimit -n``), not
ZeroMQ's default of 1,023: past that, opening a socket fails with "Too many open files".

The context is never terminated: closing a handle closes its sockets (each with no linger),
and the context ends with the process. A forked child makes its own on first use (a ZeroMQ
context must not cross a fork).
"""

from __future__ import annotations

import os
import resource
import threading
from typing import Any

import zmq
import zmq.asyncio

from transferqueue.sched import zmq_in_batch

__all__ = ["process_async_context", "process_context"]

_lock = threading.Lock()
_made: dict[int, tuple[zmq.Context[Any], zmq.asyncio.Context]] = {}  # pid -> (sync, async)


def _contexts() -> tuple[zmq.Context[Any], zmq.asyncio.Context]:
    pid = os.getpid()
    with _lock:
        made = _made.get(pid)
        if made is None:
            _made.clear()  # (a parent's, inherited by fork: never used here)
            ctx: zmq.Context[Any] = zmq.Context()
            # as many sockets as the process may open descriptors (ZeroMQ's default: 1023)
            ctx.set(zmq.MAX_SOCKETS, max(1023, min(ctx.get(zmq.SOCKET_LIMIT), _open_files())))
            zmq_in_batch(ctx)  # (a stage host in SCHED_BATCH: its client's I/O thread too)
            made = _made[pid] = (ctx, zmq.asyncio.Context.shadow(ctx.underlying))
        return made


def _open_files() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def process_context() -> zmq.Context[Any]:
    """This process's context for blocking sockets."""
    return _contexts()[0]


def process_async_context() -> zmq.asyncio.Context:
    """The same context, for asyncio sockets."""
    return _contexts()[1]
