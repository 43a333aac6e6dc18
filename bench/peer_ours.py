"""Our runner for ``bench.peer``: TransferQueue as a local service, driven like the peer.

The client process is this one; the controller and the storage units are processes of
their own (``transferqueue.serve(units)``, the same layout as the peer's Ray actors); the
client connects with its defaults (``transferqueue.connect``: shared memory with same-host
units)::

    python -m bench.peer_ours --scale full --units 4

Per cycle: ``put`` (dense tensors, :class:`~transferqueue.Ragged` packed sequences, or for
the multimodal case a :class:`~transferqueue.Shaped` image column beside ragged token ids and
dense scalars),
``get_meta`` of the whole batch, ``get_data``; then, untimed, ``ack`` (the partition declares
the task, so the rows are freed). The meta rate times ``get_meta`` (the hand-out, as the
peer's, which marks rows consumed there) and, apart, ``get_meta`` + ``ack`` (a lease and its
acknowledgement: two round trips, for exactly-once delivery the peer does not offer); its
rows are kept until the next fill (no declared task), as the peer keeps consumed rows until
cleared. Beside the meta rate at 1k rows, this runner times a bare ZeroMQ round trip of the
same shape (``bench/bare.py``): the floor our ``get_meta`` is compared with.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import transferqueue
from bench.bare import BareRoundTrip
from bench.peer_cases import (
    CASES,
    MetaLoop,
    bits_equal,
    case_tensors,
    dense_case,
    digest,
    multimodal_case,
    payload_bytes,
    ragged_case,
    runner_main,
)
from transferqueue import Ragged, Shaped

_FILL_CHUNK_ROWS = 100_000


def _column(packed: Any) -> Any:
    """A case's field as our column: packed (values, offsets[, shapes]) as Ragged / Shaped
    over the same buffers, a tensor as itself."""
    if isinstance(packed, tuple):
        return Shaped(*packed) if len(packed) == 3 else Ragged(*packed)
    return packed


class OursSystem:
    """Our local service with ``units`` storage units, this process as its client."""

    def __init__(self, scale: str, units: int) -> None:
        self.units = units
        self.service = transferqueue.serve(num_units=units)
        self.tq = transferqueue.connect(self.service.address)
        self.client = self.tq.client()
        cases = CASES[scale]
        packed: dict[str, dict[str, Any]] = {
            "dense": dense_case(cases["dense"]),
            "ragged": ragged_case(cases["ragged"]),
            "multimodal": multimodal_case(cases["multimodal"]),
        }
        self.expected: dict[str, dict[str, Any]] = {
            case: {k: _column(v) for k, v in cols.items()} for case, cols in packed.items()
        }
        self.batches = self.expected
        self.rows = {case: cases[case].rows for case in packed}
        self.nbytes = {case: payload_bytes(cols) for case, cols in packed.items()}
        self.digests = {case: digest(case_tensors(cols)) for case, cols in packed.items()}
        for case in self.batches:
            self.client.declare_tasks(["bench"], partition=case)  # rows freed once acked
        self._meta = MetaLoop(self._fill, self._call)
        self._bare: BareRoundTrip | None = None  # (started on first use)

    def describe(self) -> dict[str, Any]:
        return {
            "system": "ours (local service)",
            "torch": torch.__version__,
            "units": self.units,
            "nbytes": self.nbytes,
            "digests": self.digests,
        }

    def cycle(self, case: str, verify: bool) -> tuple[float, float, float]:
        batch = self.batches[case]
        c = self.client
        t0 = time.perf_counter()
        c.put(batch, partition=case)
        t1 = time.perf_counter()
        meta = c.get_meta("bench", list(batch), self.rows[case], partition=case, timeout_s=60)
        t2 = time.perf_counter()
        got = c.get_data(meta)
        t3 = time.perf_counter()
        if verify:
            for name, want in self.expected[case].items():
                col = got[name]
                if isinstance(want, Ragged):
                    ok = col == want
                else:
                    ok = isinstance(col, torch.Tensor) and bits_equal(col, want)
                if not ok:
                    raise AssertionError(f"ours: field {name!r} of case {case!r} is not bit-exact")
        del got
        c.ack(meta)
        return t1 - t0, t2 - t1, t3 - t2

    def meta_calls(self, live: int, batch: int, seconds: float) -> dict[str, float]:
        return self._meta.run(live, batch, seconds)

    def bare_calls(self, batch: int, seconds: float) -> dict[str, float]:
        """The bare ZeroMQ round trip, calls back to back for about ``seconds``."""
        if self._bare is None:
            self._bare = BareRoundTrip()
            self._bare.seconds_per_call(batch, 0.5)  # (warm-up)
        return {"seconds_per_call": self._bare.seconds_per_call(batch, seconds)}

    def _fill(self, live: int) -> None:
        self.client.clear(f"meta{live}")
        for start in range(0, live, _FILL_CHUNK_ROWS):
            n = min(_FILL_CHUNK_ROWS, live - start)
            x = torch.arange(start, start + n, dtype=torch.int64).view(n, 1)
            self.client.put({"x": x}, partition=f"meta{live}")

    def _call(self, live: int, batch: int) -> float:
        t0 = time.perf_counter()
        meta = self.client.get_meta("bench", ["x"], batch, partition=f"meta{live}", timeout_s=10)
        dt = time.perf_counter() - t0
        if len(meta) != batch:
            raise AssertionError(f"ours get_meta returned {len(meta)} rows, asked {batch}")
        self.client.ack(meta)
        return dt

    def close(self) -> None:
        if self._bare is not None:
            self._bare.close()
        self.tq.close()
        self.service.close()


if __name__ == "__main__":
    runner_main(OursSystem)
