"""The embedded deployment: controller and storage units as objects in this process.

No serialization at all: a put copies each column once into a unit's preallocated buffers, a
read gathers once into the returned batch. Large copies run on a small thread pool so the I/O
loop keeps answering other clients meanwhile. A blocking call runs that loop on the calling
thread (its daemon thread lends it, and takes it back for the controller's timers once
callers leave it alone: :class:`~transferqueue.loop.LoopThread`), so a thread calling back to
back never waits for another thread to be scheduled.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from transferqueue.client.handle import TransferQueue
from transferqueue.controller.core import SPREAD_BYTES, Controller
from transferqueue.controller.handlers import handlers
from transferqueue.controller.placement import check_replicas
from transferqueue.controller.service import ControllerService
from transferqueue.deploy.local_links import LocalControllerLink, LocalUnitLink
from transferqueue.loop import LoopThread
from transferqueue.storage.unit import StorageUnit

__all__ = ["start"]


def start(
    num_units: int = 2,
    *,
    capacity_rows: int | None = None,
    unit_capacity_bytes: int | None = None,
    spread_bytes: int = SPREAD_BYTES,
    replicas: int = 1,
) -> TransferQueue:
    """Start an in-process TransferQueue with ``num_units`` storage units.

    ``capacity_rows`` bounds the rows held at once: a put that would exceed it waits for
    consumers to free rows (back-pressure). ``unit_capacity_bytes`` bounds each unit's memory.
    A put spreads over one unit per ``spread_bytes`` of payload (0: always over all units).
    ``replicas=2`` writes each row to two units, as a service does (in one process no unit
    dies alone: it costs a second copy and buys nothing, but behaves the same; see
    :mod:`transferqueue.client.replicas`).
    """
    if num_units < 1:
        raise ValueError(f"num_units must be >= 1, got {num_units}")
    check_replicas(replicas)
    io = LoopThread("transferqueue-embedded", lend=True)
    executor = ThreadPoolExecutor(max_workers=max(2, num_units), thread_name_prefix="tq-copy")
    units = [StorageUnit(i, capacity_bytes=unit_capacity_bytes) for i in range(num_units)]
    links = [LocalUnitLink(u, executor) for u in units]

    async def free_rows(unit_id: int, indexes: np.ndarray) -> None:
        await links[unit_id].free(indexes)

    async def make() -> ControllerService:
        service = ControllerService(
            Controller(
                num_units,
                capacity_rows=capacity_rows,
                spread_bytes=spread_bytes,
                replicas=replicas,
            ),
            free_rows,
        )
        await service.start()
        return service

    service = io.run(make())

    def close_service() -> None:
        if not io.closed:
            io.run(service.close(), timeout=10)

    return TransferQueue(
        io,
        LocalControllerLink(*handlers(service)),
        links,
        closers=[close_service, lambda: executor.shutdown(wait=True)],
        mode="embedded",
    )
