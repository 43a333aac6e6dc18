"""Per message kind request counters of one server, cheap enough for the request loop.

:class:`~transferqueue.wire.rpc.RpcServer` counts every request it answers here: plain ints and
floats on ``__slots__`` objects, updated on the server's event loop only (no lock, no
prometheus_client object per request: a request costs two ``perf_counter`` calls, one
``bisect`` and a few additions). Readers (``stats``, the Prometheus endpoint of
:mod:`transferqueue.deploy.metrics`) take a :meth:`RequestCounters.snapshot` on the same loop.

    per kind    requests  errors  seconds (sum)  bytes_in  bytes_out  buckets[i]
    get_meta    1200      3       0.84           96000     310000     count with latency in
                                                                      (BOUNDS[i-1], BOUNDS[i]]

A request's latency runs from its receipt to its reply being handed to ZeroMQ: for a
request that waits (a blocking ``get_meta``), its wait included.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["LATENCY_BOUNDS_S", "KindCounters", "RequestCounters", "frames_nbytes"]

LATENCY_BOUNDS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
"""Upper bounds of the latency histogram's buckets, in seconds (one more bucket: +Inf)."""


class KindCounters:
    """What one server saw of one message kind since it started."""

    __slots__ = ("buckets", "bytes_in", "bytes_out", "errors", "requests", "seconds")

    def __init__(self) -> None:
        self.requests = 0
        self.errors = 0  # requests answered with an error reply
        self.seconds = 0.0  # latencies summed
        self.bytes_in = 0  # request frames, as received
        self.bytes_out = 0  # reply frames (buffers placed in shared memory not included)
        self.buckets = [0] * (len(LATENCY_BOUNDS_S) + 1)  # not cumulative; last: over 60 s

    def observe(self, seconds: float) -> None:
        """One request answered after ``seconds`` (called on the server's loop)."""
        self.seconds += seconds
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1


class RequestCounters:
    """The :class:`KindCounters` of every kind a server takes, and its unreadable messages."""

    def __init__(self, kinds: Iterable[str]) -> None:
        self.by_kind = {kind: KindCounters() for kind in kinds}
        self.bad_messages = 0  # dropped or refused before a kind's handler ran

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers, safe to hand to another thread: ``{"bad_messages": n, "kinds":
        {kind: {"requests", "errors", "seconds", "bytes_in", "bytes_out", "buckets"}}}``
        (``buckets`` not cumulative, one per bound of :data:`LATENCY_BOUNDS_S` and +Inf)."""
        return {
            "bad_messages": self.bad_messages,
            "kinds": {
                kind: {
                    "requests": c.requests,
                    "errors": c.errors,
                    "seconds": c.seconds,
                    "bytes_in": c.bytes_in,
                    "bytes_out": c.bytes_out,
                    "buckets": list(c.buckets),
                }
                for kind, c in self.by_kind.items()
            },
        }


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes in ``frames`` (ZeroMQ frames, bytes, bytearrays, memoryviews or any other
    buffer; what is none counts 0: counting never fails a reply)."""
    n = 0
    for f in frames:
        if isinstance(f, memoryview):
            n += f.nbytes
        elif isinstance(f, bytes | bytearray):
            n += len(f)
        else:
            with contextlib.suppress(TypeError):
                n += memoryview(f).nbytes
    return n
