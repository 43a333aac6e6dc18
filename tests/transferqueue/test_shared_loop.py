"""Many handles in one process (``connect(shared_loop=True)``): they run on one event loop
thread between them, each with its own connections, holder and leases; one closing leaves
the others serving; the loop ends with the last of them."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import transferqueue

HANDLES = 24


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("transferqueue-client")]


@pytest.mark.service
def test_handles_on_a_shared_loop_are_independent_clients_on_one_thread() -> None:
    with transferqueue.serve(num_units=1) as svc:
        before = len(_loop_threads())
        handles = [transferqueue.connect(svc.address, shared_loop=True) for _ in range(HANDLES)]
        try:
            assert len(_loop_threads()) == before + 1  # one thread for all of them
            handles[0].client().declare_tasks(["t"], partition="p")

            async def cycle(i: int) -> list[int]:
                c = handles[i].async_client()
                await c.put({"x": np.full((2, 1), i, dtype=np.int64)}, partition="p")
                meta = await c.get_meta("t", ["x"], 2, partition="p", timeout_s=30)
                cols = await c.get_data(meta)
                await c.ack(meta)
                return [int(v) for v in np.asarray(cols["x"]).ravel()]

            async def everyone() -> list[list[int]]:
                return list(
                    await asyncio.gather(*(h.run_async(cycle(i)) for i, h in enumerate(handles)))
                )

            got = asyncio.run(everyone())
            assert sorted(v for vs in got for v in vs) == sorted(list(range(HANDLES)) * 2)
            holders = {h.holder.id for h in handles}
            assert len(holders) == HANDLES  # each its own holder, so its own leases

            # one handle closes holding a lease: its rows go back, the others go on
            c0 = handles[0].client()
            c0.put({"x": np.zeros((1, 1), dtype=np.int64)}, partition="p")
            held = c0.get_meta("t", ["x"], 1, partition="p", timeout_s=30)
            handles[0].close()
            other = handles[1].client()
            again = other.get_meta("t", ["x"], 1, partition="p", timeout_s=30)
            assert again.indexes.tolist() == held.indexes.tolist()
            other.ack(again)
            assert len(_loop_threads()) == before + 1
        finally:
            for h in handles:
                h.close()
        assert len(_loop_threads()) == before  # the last one took the loop with it
        # a later handle gets a new shared loop
        with transferqueue.connect(svc.address, shared_loop=True) as later:
            later.client().put({"x": np.ones((1, 1), dtype=np.int64)}, partition="q")
