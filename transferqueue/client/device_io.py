"""The client's device columns: a put of CUDA tensors written to a unit a pinned chunk at a
time, reads landed on a device (``get_data(meta, device=...)``), and columns shared by handle
(``put(share=[...])``, :mod:`transferqueue.device.shared`).

The mechanics (the pool, the copy streams, the chunking) are
:mod:`transferqueue.device.staging`'s; this module runs them from the client's I/O loop: the
blocking steps (queueing copies, which may wait for a free chunk; waiting for a copy to end)
go to worker threads, so the loop serves other calls meanwhile, and two chunks are in flight:
while chunk ``i`` is written to its unit, chunk ``i + 1`` is being copied off the device.

A put records, on the thread that calls it, an event on each device's current stream
(:func:`ready_events`): the copies wait for the kernels that produced the tensors, whichever
thread runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from transferqueue.client.links import ControllerLink, UnitLink
from transferqueue.device.shared import DeviceExporter, DeviceImporter
from transferqueue.device.staging import DeviceStaging, StagedChunk, is_device
from transferqueue.loop import LoopThread
from transferqueue.ragged import Ragged
from transferqueue.schema import FieldSpec
from transferqueue.wire import messages as m

__all__ = ["DeviceSide", "device_of", "ready_events", "to_device", "write_device"]


class DeviceSide:
    """What the clients of one handle share for device columns: the pinned chunks and copy
    streams (``staging``), and the exporter and importer of shared columns, each made when
    first needed; ``close`` releases them (the handle's close does)."""

    def __init__(self, io: LoopThread, controller: ControllerLink) -> None:
        self._io = io
        self._ctl = controller
        self.staging = DeviceStaging()
        self._exporter: DeviceExporter | None = None
        self._importer: DeviceImporter | None = None
        self._lock = threading.Lock()

    def exporter(self) -> DeviceExporter:
        with self._lock:
            if self._exporter is None:
                self._exporter = DeviceExporter(self._live_rows)
            return self._exporter

    def importer(self) -> DeviceImporter:
        with self._lock:
            if self._importer is None:
                self._importer = DeviceImporter()
            return self._importer

    def _live_rows(self, partition: str) -> np.ndarray:
        """The partition's live rows (the exporter's poll thread asks)."""
        status = self._io.run(self._ctl.call(m.Status(partition=partition)), timeout=30.0)
        return np.asarray(status.indexes)

    def close(self) -> None:
        self.staging.close()
        with self._lock:
            for end in (self._exporter, self._importer):
                if end is not None:
                    end.close()


def ready_events(data: Mapping[str, Any]) -> dict[torch.device, Any]:
    """An event on the calling thread's current stream of every CUDA device ``data`` holds
    tensors on (empty without any)."""
    events: dict[torch.device, Any] = {}
    for col in data.values():
        if not is_device(col):
            continue
        t = col.values if isinstance(col, Ragged) else col[0] if isinstance(col, list) else col
        if t.device.type == "cuda" and t.device not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events[t.device] = event
    return events


def device_of(part: Mapping[str, Any]) -> torch.device | None:
    for col in part.values():
        if is_device(col):
            return col.values.device if isinstance(col, Ragged) else col.device
    return None


async def write_device(
    link: UnitLink,
    indexes: np.ndarray,
    part: Mapping[str, Any],
    specs: Mapping[str, FieldSpec],
    staging: DeviceStaging,
    ready: dict[torch.device, Any],
    *,
    create: bool,
    grant: bytes | None,
) -> None:
    """Write rows ``indexes`` (a part holding device columns) to ``link`` a chunk at a time,
    through the pinned pool (see the module doc)."""
    device = device_of(part)
    chunks = staging.chunks_to_host(part, len(indexes), ready.get(device) if device else None)
    pending: deque[StagedChunk] = deque()

    async def flush(staged: StagedChunk) -> None:
        try:
            await asyncio.to_thread(staged.fence.synchronize)
            rows = indexes[staged.a : staged.b]
            await link.write(rows, staged.columns, specs, create=create, grant=grant)
        finally:
            staging.release(staged)

    try:
        while True:
            staged = await asyncio.to_thread(next, chunks, None)  # queues its copy
            if staged is None:
                break
            pending.append(staged)
            if len(pending) >= 2:
                await flush(pending.popleft())
        while pending:
            await flush(pending.popleft())
    finally:
        for staged in pending:  # a write failed: the copies still own their chunks
            with contextlib.suppress(Exception):
                await asyncio.to_thread(staged.fence.synchronize)
            staging.release(staged)
        chunks.close()


async def to_device(
    cols: dict[str, Any], device: str | torch.device, staging: DeviceStaging
) -> dict[str, Any]:
    """``cols`` (host columns) on ``device``, through pinned chunks (off the I/O loop)."""
    target = torch.device(device)
    if target.type == "cpu":
        return cols
    return await asyncio.to_thread(staging.to_device, cols, target)
