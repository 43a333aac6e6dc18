"""A producer that shares a column (``put(share=[...])``) from a process of its own, driven
over a pipe by tests/transferqueue/test_shared_columns.py (a module of its own, so that the
spawned process imports it by name)."""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch

import transferqueue


def column(seed: int, rows: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, 3, generator=g)


def produce(address: str, conn: Connection) -> None:
    with transferqueue.connect(address) as tq:
        client = tq.client()
        conn.send("ready")
        while True:
            command, *args = conn.recv()
            if command == "put":
                seed, partition, *device = args
                x = column(seed).to(device[0] if device else "cpu")
                meta = client.put(
                    {"x": x, "y": torch.arange(x.shape[0])},
                    share=["x"],
                    group=torch.arange(x.shape[0]) // 4,
                    partition=partition,
                )
                conn.send(meta.indexes.tolist())
            elif command == "kept":
                conn.send(tq._device.exporter().kept)
            else:
                conn.send("bye")
                return
