"""The peer's runner for ``bench.peer``: TransferQueue 0.1.11 from PyPI, run as its users do.

Runs in the peer's own virtualenv (``python -m bench.peer --setup`` builds it) as the client
process; it imports the peer (``transfer_queue``) and ``bench.peer_cases`` (numpy and torch
only), nothing of ours::

    bench/.peer-venv/bin/python -m bench.peer_runner --scale full --units 4

How the peer is used, from its README, tutorials and ``scripts/performance_test``: Ray
started in this process, ``transfer_queue.init()`` with its default config (controller and
SimpleStorage units as Ray actors: separate processes) except ``num_data_storage_units``;
the low-level client from ``get_client()`` with ``put(TensorDict, partition_id=...)``,
``get_meta(data_fields, batch_size, partition_id, task_name=...)`` and ``get_data(meta)``;
``clear_samples(meta)`` once a batch is consumed (untimed). Ragged sequences go in as jagged
nested tensors (``torch.nested``, the layout its own "complex" benchmark case uses); every
field comes back as a jagged nested tensor, whose ``values()`` and ``offsets()`` are compared
bit for bit with what was put. The multimodal case's images, whose height and width vary per
row, go in as a strided nested tensor (a jagged one has one ragged axis), its token ids as a
jagged one and its scalars as tensors ``[B]``; each row read back is compared bit for bit.
Ray gets ``units + 1`` logical CPUs: each storage unit and the controller asks for one, and
with fewer ``init()`` waits forever; the machine's cores are the same for both systems.
"""

from __future__ import annotations

import os
import time
from typing import Any

for _k, _v in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
}.items():
    os.environ.setdefault(_k, _v)

import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402

from bench.peer_cases import (  # noqa: E402
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
    unpack_rows,
)

_FILL_CHUNK_ROWS = 100_000


def _as_peer(packed: Any) -> torch.Tensor:
    """A case's field as the peer's users hold it: packed sequences (values, offsets) as a
    jagged nested tensor, packed images (values, offsets, shapes) as a strided one."""
    if not isinstance(packed, tuple):
        return packed
    if len(packed) == 3:
        return torch.nested.nested_tensor(unpack_rows(packed))
    return torch.nested.nested_tensor_from_jagged(packed[0], offsets=packed[1])


class PeerSystem:
    """The peer with ``units`` SimpleStorage units, this process as its client."""

    def __init__(self, scale: str, units: int) -> None:
        # a Ray instance of its own ("local"), never a cluster someone else started here
        ray.init(
            address="local",
            num_cpus=max(2, units + 1),
            include_dashboard=False,
            log_to_driver=False,
        )
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": units}}}))
        self.units = units
        self.client = tq.get_client()
        cases = CASES[scale]
        self.expected: dict[str, dict[str, Any]] = {
            "dense": dense_case(cases["dense"]),
            "ragged": ragged_case(cases["ragged"]),
            "multimodal": multimodal_case(cases["multimodal"]),
        }
        self.batches = {
            case: TensorDict({k: _as_peer(v) for k, v in cols.items()}, batch_size=cases[case].rows)
            for case, cols in self.expected.items()
        }
        self.nbytes = {case: payload_bytes(cols) for case, cols in self.expected.items()}
        self.digests = {case: digest(case_tensors(c)) for case, c in self.expected.items()}
        self._meta = MetaLoop(self._fill, self._call)
        self._filled: set[int] = set()

    def describe(self) -> dict[str, Any]:
        return {
            "system": f"transferqueue {tq.__version__} (PyPI)",
            "ray": ray.__version__,
            "torch": torch.__version__,
            "units": self.units,
            "nbytes": self.nbytes,
            "digests": self.digests,
        }

    # -- put + get -------------------------------------------------------------------------------
    def cycle(self, case: str, verify: bool) -> tuple[float, float, float]:
        batch = self.batches[case]
        rows = batch.batch_size[0]
        t0 = time.perf_counter()
        self.client.put(data=batch, partition_id=case)
        t1 = time.perf_counter()
        meta = self.client.get_meta(
            data_fields=list(batch.keys()), batch_size=rows, partition_id=case, task_name="bench"
        )
        t2 = time.perf_counter()
        got = self.client.get_data(meta)
        t3 = time.perf_counter()
        if verify:
            self._verify(case, got)
        del got
        self.client.clear_samples(meta)
        return t1 - t0, t2 - t1, t3 - t2

    def _verify(self, case: str, got: TensorDict) -> None:
        if case == "multimodal":  # (row by row: the images' layout is strided)
            for name, want in self.expected[case].items():
                rows = unpack_rows(want) if isinstance(want, tuple) else list(want.unbind())
                col = got[name]
                back = list(col.unbind()) if col.is_nested else list(col.reshape(-1).unbind())
                if len(back) != len(rows) or not all(
                    bits_equal(a.reshape(b.shape), b) for a, b in zip(back, rows, strict=True)
                ):
                    raise AssertionError(f"peer: field {name!r} of case {case!r} is not bit-exact")
            return
        for name, want in self.expected[case].items():
            col = got[name]
            values, offsets = (col.values(), col.offsets()) if col.is_nested else (col, None)
            if case == "dense":
                ok = bits_equal(values.reshape(want.shape), want)
            else:
                ok = (
                    bits_equal(values, want[0])
                    and offsets is not None
                    and bits_equal(offsets.to(torch.int64), want[1])
                )
            if not ok:
                raise AssertionError(f"peer: field {name!r} of case {case!r} is not bit-exact")

    # -- get_meta rate ---------------------------------------------------------------------------
    def meta_calls(self, live: int, batch: int, seconds: float) -> dict[str, float]:
        return self._meta.run(live, batch, seconds)

    def _fill(self, live: int) -> None:
        part = f"meta{live}"
        if live in self._filled:
            self.client.clear_partition(part)
        for start in range(0, live, _FILL_CHUNK_ROWS):
            n = min(_FILL_CHUNK_ROWS, live - start)
            x = torch.arange(start, start + n, dtype=torch.int64).view(n, 1)
            self.client.put(data=TensorDict({"x": x}, batch_size=n), partition_id=part)
        self._filled.add(live)

    def _call(self, live: int, batch: int) -> float:
        t0 = time.perf_counter()
        meta = self.client.get_meta(
            data_fields=["x"], batch_size=batch, partition_id=f"meta{live}", task_name="bench"
        )
        dt = time.perf_counter() - t0
        if len(meta) != batch:
            raise AssertionError(f"peer get_meta returned {len(meta)} rows, asked {batch}")
        return dt

    def close(self) -> None:
        tq.close()
        ray.shutdown()


if __name__ == "__main__":
    runner_main(PeerSystem)
