"""What ``bench.peer`` runs on both systems: workloads, checks and the runners' protocol.

Imports numpy and torch only, so that the runner of each system (ours in our virtualenv, the
peer in its own) builds the very same bytes from the same seeds. A runner is driven by
``bench.peer`` through JSON lines: one command per line on stdin, one reply per line on the
file descriptor it was given (stdout is handed to stderr first, so that whatever the system
under test prints never mixes with the replies)::

    -> {"op": "cycle", "case": "dense", "reps": 2, "verify": false}
    <- {"ok": true, "put_s": [...], "get_meta_s": [...], "get_data_s": [...], "nbytes": ...}
    -> {"op": "meta", "live": 1000000, "batch": 64, "seconds": 2.0}
    <- {"ok": true, "calls": 812, "timed_s": 2.0, "samples_per_s": ..., "fill_s": ...}
    -> {"op": "close"}

A failing command answers ``{"ok": false, "error": "..."}`` and the runner keeps serving.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "CASES",
    "Case",
    "MetaLoop",
    "System",
    "case_tensors",
    "dense_case",
    "digest",
    "multimodal_case",
    "ragged_case",
    "serve",
    "unpack_rows",
]


@dataclass(frozen=True)
class Case:
    """A put + get workload: ``dense`` fields [rows, width] float32, ``ragged`` sequences
    of ``lo``-``hi`` int32 token ids plus one float32 logprob per token, or ``multimodal``
    rows of a vision-language RL batch: an image ``[3, H, W]`` uint8 (H and W each drawn
    from ``img_lo``-``img_hi``), ``lo``-``hi`` int32 token ids and a few scalars."""

    kind: str
    rows: int
    width: int = 0
    fields: int = 0
    lo: int = 0
    hi: int = 0
    img_lo: int = 224
    img_hi: int = 1024


CASES = {
    "full": {
        "dense": Case("dense", rows=1024, width=8192, fields=9),  # 302 MB: the peer's "Small"
        "ragged": Case("ragged", rows=256, lo=128, hi=4096),  # ~4.5 MB
        "multimodal": Case("multimodal", rows=64, lo=256, hi=2048),  # ~80 MB
    },
    "quick": {
        "dense": Case("dense", rows=64, width=8192, fields=9),
        "ragged": Case("ragged", rows=64, lo=128, hi=4096),
        "multimodal": Case("multimodal", rows=8, lo=256, hi=2048),
    },
}

SCALARS = ("reward", "advantage", "version")  # the multimodal case's per-row scalars


def dense_case(case: Case) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"f{i}": torch.randn(case.rows, case.width, generator=g) for i in range(case.fields)}


def ragged_case(case: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Packed sequences: field -> (values, offsets [rows + 1] int64)."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(case.lo, case.hi + 1, case.rows)
    offsets = np.zeros(case.rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    ids = torch.from_numpy(rng.integers(0, 50_000, total).astype(np.int32))
    logprobs = torch.from_numpy(-rng.random(total).astype(np.float32))
    off = torch.from_numpy(offsets)
    return {"ids": (ids, off), "logprobs": (logprobs, off.clone())}


def multimodal_case(case: Case) -> dict[str, Any]:
    """A vision-language RL batch, packed: ``image`` -> (values uint8 [N], offsets [rows + 1],
    shapes [rows, 3]) int64, row i being ``values[offsets[i]:offsets[i + 1]]`` viewed as
    ``shapes[i]``; ``ids`` -> (values int32, offsets); ``reward`` and ``advantage`` float32
    [rows], ``version`` int64 [rows]."""
    rng = np.random.default_rng(1)
    hw = rng.integers(case.img_lo, case.img_hi + 1, (case.rows, 2))
    shapes = np.concatenate([np.full((case.rows, 1), 3), hw], axis=1).astype(np.int64)
    img_off = np.zeros(case.rows + 1, dtype=np.int64)
    np.cumsum(shapes.prod(axis=1), out=img_off[1:])
    pixels = torch.from_numpy(rng.integers(0, 256, int(img_off[-1]), dtype=np.uint8))
    lengths = rng.integers(case.lo, case.hi + 1, case.rows)
    ids_off = np.zeros(case.rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=ids_off[1:])
    ids = torch.from_numpy(rng.integers(0, 150_000, int(ids_off[-1])).astype(np.int32))
    return {
        "image": (pixels, torch.from_numpy(img_off), torch.from_numpy(shapes)),
        "ids": (ids, torch.from_numpy(ids_off)),
        "reward": torch.from_numpy(rng.random(case.rows).astype(np.float32)),
        "advantage": torch.from_numpy(rng.standard_normal(case.rows).astype(np.float32)),
        "version": torch.from_numpy(rng.integers(0, 100, case.rows)),
    }


def unpack_rows(packed: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The rows of a packed field ``(values, offsets[, shapes])``, as views."""
    values, offsets = packed[0], packed[1].tolist()
    rows = [values[a:b] for a, b in itertools.pairwise(offsets)]
    if len(packed) > 2:
        rows = [r.view(s) for r, s in zip(rows, packed[2].tolist(), strict=True)]
    return rows


def case_tensors(cols: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a case's columns, in order (for :func:`digest`)."""
    return [t for c in cols.values() for t in (c if isinstance(c, tuple) else (c,))]


def payload_bytes(cols: dict[str, Any]) -> int:
    """Bytes a system moves each way: tensor values, plus offsets (and shapes) for packed
    fields."""
    total = 0
    for c in cols.values():
        for t in c if isinstance(c, tuple) else (c,):
            total += t.numel() * t.element_size()
    return total


def digest(tensors: list[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, in order: both runners must report the same."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


class System(Protocol):
    """One system under test, started by its runner (the client process) with its servers."""

    def cycle(self, case: str, verify: bool) -> tuple[float, float, float]:
        """One put + get_meta + get_data of the case's payload: the three times in seconds.
        With ``verify``, raise unless what came back is bit-exact what was put."""
        ...

    def meta_calls(self, live: int, batch: int, seconds: float) -> dict[str, float]:
        """Time ``get_meta`` of ``batch`` rows with ``live`` rows in the store, for about
        ``seconds`` of calls; rows are (re)filled outside the timed calls."""
        ...

    def close(self) -> None: ...


class MetaLoop:
    """The meta-rate loop both runners share.

    ``fill(live)`` drops the rows of the last fill of that size and puts ``live`` fresh ones
    into a partition of their own (untimed); ``call(live, batch)`` takes one batch from it
    and returns the seconds its ``get_meta`` took (a system that acknowledges batches does
    that after it: the whole call is timed too). Calls stop before they would take more than
    half of the filled rows, so every timed call sees between ``live`` and ``live / 2``
    ready rows; then that partition is filled again. Fills are kept across commands (the
    peer needs about 25 s to put a million rows), and the first call after a fill is an
    untimed warm-up (a task's first call may set up its queue).
    """

    def __init__(self, fill: Callable[[int], None], call: Callable[[int, int], float]) -> None:
        self._fill = fill
        self._call = call
        self._left: dict[int, int] = {}  # live -> calls left before half the rows are taken

    def run(self, live: int, batch: int, seconds: float) -> dict[str, float]:
        if live < 4 * batch:
            raise ValueError(f"live={live} rows are too few for batches of {batch}")
        timed = fill_s = get_meta_s = 0.0
        calls = 0
        while timed < seconds:
            if self._left.get(live, 0) <= 0:
                t0 = time.perf_counter()
                self._fill(live)
                self._call(live, batch)
                fill_s += time.perf_counter() - t0
                self._left[live] = (live // 2) // batch - 1
            t0 = time.perf_counter()
            get_meta_s += self._call(live, batch)
            timed += time.perf_counter() - t0
            calls += 1
            self._left[live] -= 1
        return {
            "calls": calls,
            "timed_s": timed,
            "samples_per_s": calls * batch / get_meta_s,  # get_meta alone: the hand-out
            "samples_per_s_whole": calls * batch / timed,  # with the ack, where there is one
            "fill_s": fill_s,
        }


def serve(make: Callable[[], System], out_fd: int) -> None:
    """The runner's loop: build the system, then answer commands until ``close``."""
    out = os.fdopen(out_fd, "w", buffering=1)

    def reply(payload: dict[str, Any]) -> None:
        out.write(json.dumps(payload) + "\n")
        out.flush()

    t0 = time.perf_counter()
    try:
        system = make()
    except Exception as e:
        reply({"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    reply({"ok": True, "init_s": time.perf_counter() - t0})
    try:
        for raw in sys.stdin:
            cmd = json.loads(raw)
            op = cmd.get("op")
            if op == "close":
                break
            try:
                if op == "cycle":
                    times = [
                        system.cycle(cmd["case"], bool(cmd.get("verify")) and i == 0)
                        for i in range(int(cmd.get("reps", 1)))
                    ]
                    reply(
                        {
                            "ok": True,
                            "put_s": [t[0] for t in times],
                            "get_meta_s": [t[1] for t in times],
                            "get_data_s": [t[2] for t in times],
                        }
                    )
                elif op == "meta":
                    reply(
                        {"ok": True, **system.meta_calls(cmd["live"], cmd["batch"], cmd["seconds"])}
                    )
                elif op == "bare" and hasattr(system, "bare_calls"):
                    # (ours only: the bare ZeroMQ round trip, bench/bare.py)
                    reply({"ok": True, **system.bare_calls(cmd["batch"], cmd["seconds"])})
                elif op == "describe":
                    reply({"ok": True, **getattr(system, "describe", dict)()})
                else:
                    reply({"ok": False, "error": f"unknown op {op!r}"})
            except Exception as e:
                reply(
                    {
                        "ok": False,
                        "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc(),
                    }
                )
    finally:
        system.close()
        reply({"ok": True, "closed": True})


def runner_main(make: Callable[[str, int], System]) -> None:
    """Entry point of a runner: ``--scale full|quick --units N --out-fd FD``."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", default="full", choices=sorted(CASES))
    ap.add_argument("--units", type=int, default=1)
    args = ap.parse_args()
    # Replies go to the real stdout; anything the system prints goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    serve(lambda: make(args.scale, args.units), out_fd)
