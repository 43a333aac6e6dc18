"""Store checkpoint benchmark: ``save`` and ``load`` against the reads and puts they are made of.

    python -m bench.checkpoint            # 200k rows, ~330 MB (~1 min on 2 cores)
    python -m bench.checkpoint --quick    # 40k rows, for a smoke test

One partition of ``rows`` rows: a dense float32 [256] field, ragged int64 token ids (0..199
per row) and a short string per row. For the embedded deployment and a local service
(2 units each):

- ``save`` (snapshot + read every row + Arrow IPC files) against reading every row with
  ``get_data`` in batches of the same size (the least any save must do); ratio = read / save;
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


def _fill(client: transferqueue.Client, rows: int) -> float:
    t0 = time.perf_counter()
    for lo in range(0, rows, BATCH):
        client.put(_columns(lo, min(rows, lo + BATCH)), partition="train")
    return time.perf_counter() - t0


def _read_all(client: transferqueue.Client) -> float:
    status = client.status("train")
    t0 = time.perf_counter()
    for lo in range(0, len(status), BATCH):
        idx = status.indexes[lo : lo + BATCH]
        st = client.get_meta("reader", FIELDS, batch_size=idx.size, partition="train")
        client.get_data(st)
        client.ack(st)
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
        with open_tq() as tq:
            c = tq.client()
            _fill(c, rows)
            t_read = _read_all(c)
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
            t_put = _fill(c, rows)
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
    line(f"{kind}: save {rows} rows", mb / t_save, "MB/s", read_ratio=t_read / t_save)
    line(f"{kind}: load {rows} rows", mb / t_load, "MB/s", put_ratio=t_put / t_load)
    line(f"{kind}: peak RSS growth during save / bytes", rss_growth / nbytes, "ratio")
    return {
        "rows": rows,
        "bytes": nbytes,
        "save_s": t_save,
        "read_s": t_read,
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
