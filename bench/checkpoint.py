"""Store checkpoint benchmark: ``save`` and ``load`` against the reads and puts they are made of.

    python -m bench.checkpoint            # 200k rows, ~330 MB (~1 min on 2 cores)
    python -m bench.checkpoint --quick    # 40k rows, for a smoke test

One partition of ``rows`` rows: a dense float32 [256] field, ragged int64 token ids (0..199
per row) and a short string per row. For the embedded deployment and a local service
(2 units each):

- ``save`` (snapshot + read every row + Arrow IPC files) against reading every row with
  ``get_data`` in batches of the same size and writing its bytes raw to one file (the least
  any save does); ratio = baseline / save;
- ``load`` (files + put + commit + consumption state) against ``put`` of the same columns
  already in memory; ratio = put / load;
- the growth of the process's peak resident memory during the save, against the bytes saved
  (streaming: one batch of one field at a time, so the ratio stays far below 1).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow  # noqa: F401  (loaded up front: its first import, ~0.2 s and ~90 MB, is not the save's)
import torch

import transferqueue
from bench.common import line, write_json
from transferqueue import BatchMeta, Ragged

BATCH = 8192
FIELDS = ["x", "tokens", "text"]


def _columns(lo: int, hi: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(lo)
    n = hi - lo
    lengths = torch.randint(0, 200, (n,), generator=g)
    return {
        "x": torch.randn(n, 256, generator=g),
        "tokens": Ragged.from_lengths(torch.arange(int(lengths.sum())), lengths),
        "text": [f"row {i}" for i in range(lo, hi)],
    }


def _batches(rows: int) -> list[dict[str, Any]]:
    return [_columns(lo, min(rows, lo + BATCH)) for lo in range(0, rows, BATCH)]


def _fill(client: transferqueue.Client, batches: list[dict[str, Any]]) -> float:
    """Seconds to put the (already built) batches."""
    t0 = time.perf_counter()
    for cols in batches:
        client.put(cols, partition="train")
    return time.perf_counter() - t0


def _read_and_dump(client: transferqueue.Client, rows: int, path: Path) -> float:
    """Seconds to read every row (batches of BATCH) and write its bytes raw to one file:
    the least a save does (no snapshot, no format, no headers)."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for lo in range(0, rows, BATCH):
            meta = client.get_meta(
                "reader", FIELDS, batch_size=min(BATCH, rows - lo), partition="train"
            )
            cols = client.get_data(meta)
            f.write(cols["x"].numpy().data)
            f.write(cols["tokens"].values.numpy().data)
            f.write(cols["tokens"].offsets.numpy().data)
            f.write("\n".join(cols["text"]).encode())
            client.ack(meta)
    return time.perf_counter() - t0


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run(kind: str, rows: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="tq-ckpt-"))
    try:
        svc = transferqueue.serve(num_units=2) if kind == "service" else None
        open_tq = (
            (lambda: transferqueue.connect(svc.address))
            if svc is not None
            else (lambda: transferqueue.start(num_units=2))
        )
        batches = _batches(rows)
        with open_tq() as tq:
            c = tq.client()
            _fill(c, batches)
            t_read = _read_and_dump(c, rows, tmp / "raw")
            rss0 = _max_rss_bytes()
            t0 = time.perf_counter()
            c.save(tmp / "ck")
            t_save = time.perf_counter() - t0
            rss_growth = _max_rss_bytes() - rss0
        nbytes = sum(f.stat().st_size for f in (tmp / "ck").rglob("*") if f.is_file())
        if svc is not None:
            svc.close()
            svc = transferqueue.serve(num_units=2)
        with open_tq() as tq:
            c = tq.client()
            t_put = _fill(c, batches)
            tq.reset()  # (an empty store again)
            t0 = time.perf_counter()
            c_rows = c.load(tmp / "ck")
            t_load = time.perf_counter() - t0
            assert c_rows == {"train": rows}
            meta: BatchMeta = c.get_meta(
                "reader", FIELDS, batch_size=rows, partition="train", timeout_s=0
            )
            assert len(meta) == 0  # (consumed by "reader" before the save: stays consumed)
        if svc is not None:
            svc.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mb = nbytes / 1e6
    line(f"{kind}: save {rows} rows", mb / t_save, "MB/s", read_dump_ratio=t_read / t_save)
    line(f"{kind}: load {rows} rows", mb / t_load, "MB/s", put_ratio=t_put / t_load)
    line(f"{kind}: peak RSS growth during save / bytes", rss_growth / nbytes, "ratio")
    return {
        "rows": rows,
        "bytes": nbytes,
        "save_s": t_save,
        "read_dump_s": t_read,
        "load_s": t_load,
        "put_s": t_put,
        "rss_growth_bytes": rss_growth,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rows = 40_000 if args.quick else 200_000
    np.random.seed(0)
    results = {kind: run(kind, rows) for kind in ("embedded", "service")}
    write_json("checkpoint", results)


if __name__ == "__main__":
    main()
