"""The stage runner: ``get_meta -> get_data -> adapter.process -> put`` in a loop.

One runner drives one adapter with ``concurrency`` workers (asyncio tasks); the stages of the
GRPO graph and their runners are built from the config by ``asyncflow.graph``. Each worker leases
a batch of rows whose input fields are ready, reads the columns, lets the adapter run its
engine, and writes the output columns onto the same rows, which acknowledges the lease (an
adapter with no output just acknowledges; one that ``holds_leases`` acknowledges its batches
only once its unit of work, a train step, is complete and reported). A worker that fails
leaves its lease open, so its rows go back to the task when the lease runs out (or its holder
dies), and the error propagates to the workflow, which stops every stage.

A batch that loses rows with a dead TransferQueue storage unit while the worker reads or
writes it (``RowsLostError``) is not a failure: the worker gives the rest of the batch back to
the task (``release``: they are handed out again) and goes on. The lost rows are in the task's
loss log, from which the driver regenerates their groups (``asyncflow.workflow``).

A batch whose lease was returned while the worker held it (``LeaseExpiredError`` on its put or
ack: the lease ran out, or its holder was declared gone, say a host frozen past TransferQueue's
holder liveness and woken again) is not a failure either: its rows were handed out again, so
the worker drops the batch (the put failed before writing anything), logs it once at WARNING
with the stage and the lease, counts it (``dropped_batches`` in the stage's metrics of the step
record) and goes on.

Every batch is recorded on the :class:`Timeline` (busy intervals per worker), so per-stage
busy/idle time, samples/s and tokens/s come from the same source as the Gantt charts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from adapters.base import Adapter, StageOutput
from asyncflow.metrics import Timeline
from asyncflow.progress import Work
from transferqueue import (
    AsyncClient,
    BatchMeta,
    LeaseExpiredError,
    PeerGoneError,
    RowsLostError,
)

__all__ = ["COUNT_METRICS", "StageError", "StageRunner"]

log = logging.getLogger(__name__)


class StageError(RuntimeError):
    """A stage failed; ``stage`` names it and ``__cause__`` is the original error.

    Picklable (a stage host in another process raises it through Ray): its ``args`` are
    ``(stage, cause)``, what the constructor takes.
    """

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(stage, cause)
        self.stage = stage
        self.__cause__ = cause

    def __str__(self) -> str:
        cause = self.args[1]
        text = f"stage {self.stage!r} failed: {type(cause).__name__}: {cause}"
        if isinstance(cause, PeerGoneError | RowsLostError):
            text += f" ({LOST_SERVER_HINT})"
        return text


LOST_SERVER_HINT = (
    "a TransferQueue server died and the run could not recover on its own (lost groups are "
    "regenerated while the controller serves; a controller restarted with its state, "
    "transferqueue.state_dir, is waited for transferqueue.ride_through_s); resume from the "
    "last checkpoint (asyncflow run --resume DIR; set checkpoint.every_steps)"
)


COUNT_METRICS = frozenset({"dropped_batches"})
"""Keys of :meth:`StageRunner.drain_metrics` that are counts (summed over a stage's hosts),
not means."""

HELD_LEASE_S = 86400.0
"""The lease of rows an adapter holds for a whole unit of work (``Adapter.holds_leases``): a
unit may last longer than any per-batch lease, and its rows come back when their holder dies
(TransferQueue's holder liveness), which is the only case in which they must."""


class StageRunner:
    """Runs one adapter against TransferQueue until stopped or the stream ends."""

    def __init__(
        self,
        name: str,
        adapter: Adapter,
        client: AsyncClient,
        timeline: Timeline,
        *,
        concurrency: int = 1,
        partition: str = "train",
        lease_s: float = 120.0,
        poll_s: float = 0.5,
    ) -> None:
        self.name = name
        self.adapter = adapter
        self.client = client
        self.timeline = timeline
        self.concurrency = concurrency
        self.partition = partition
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.batches = 0
        self.samples = 0
        self.tokens = 0
        self.lost_batches = 0  # batches given back because rows of them were lost
        self.dropped_batches = 0  # batches dropped: their lease was returned meanwhile
        self._dropped_drained = 0
        self.work = Work(name, f"rows of {sorted(adapter.input_fields)} from task {adapter.task!r}")
        """What this stage holds and has done (:mod:`asyncflow.progress`), for the stall
        watch."""
        self._held: list[BatchMeta] = []  # processed, not acknowledged yet (holds_leases)
        self._metrics: dict[str, list[float]] = {}  # name -> [sum weighted by rows, rows]
        self._workers: asyncio.TaskGroup | None = None  # (while it runs)
        self._stopping = False

    def drain_metrics(self) -> dict[str, float]:
        """Means of the adapter's :attr:`StageOutput.metrics` over the rows processed since the
        last drain (weighted by batch rows; NaN values, "no verdict", left out)."""
        out = {k: (s / n if n else math.nan) for k, (s, n) in self._metrics.items()}
        self._metrics = {}
        if self.dropped_batches > self._dropped_drained:  # a count, not a mean
            out["dropped_batches"] = float(self.dropped_batches - self._dropped_drained)
            self._dropped_drained = self.dropped_batches
        return out

    async def run(self) -> None:
        """Run the workers; returns when the stream ends, raises StageError on failure."""
        try:
            async with asyncio.TaskGroup() as tg:
                self._workers = tg
                for w in range(self.concurrency):
                    tg.create_task(self._worker(w))
        except ExceptionGroup as eg:  # a worker failed (cancellation propagates as is)
            first = eg.exceptions[0]
            raise StageError(self.name, first) from first

    def stop(self) -> None:
        """Take no new batch: each worker ends once the batch it holds is written (a
        ``get_meta`` in flight returns within ``poll_s``, its rows processed as any other),
        and :meth:`run` returns (a stage instance drained before it leaves the run)."""
        self._stopping = True

    def grow(self, concurrency: int) -> None:
        """At least ``concurrency`` workers from now on (a stage given more instances while
        it runs); never fewer: a worker left over only waits on the instances left."""
        if self._workers is None or concurrency <= self.concurrency:
            return
        for w in range(self.concurrency, concurrency):
            self._workers.create_task(self._worker(w))
        self.concurrency = concurrency

    async def _worker(self, worker: int) -> None:
        a = self.adapter
        lane = f"{self.name}/{worker}" if self.concurrency > 1 else self.name
        while not self._stopping:
            req = a.request()
            self.work.idle(worker)
            meta = await self.client.get_meta(
                a.task,
                list(a.input_fields),
                partition=self.partition,
                timeout_s=self.poll_s,
                # held for a whole unit of work: only the holder's death gives them back
                lease_s=HELD_LEASE_S if a.holds_leases else self.lease_s,
                sampler=a.sampler,
                **a.sampler_options,
                **req,
            )
            if len(meta):
                t0 = time.perf_counter()
                token = self.work.take(len(meta), meta.lease_id, worker=worker)
                try:
                    out = await self._process(meta, token)
                except RowsLostError as lost:
                    self.work.finish(token, done=False)
                    self.lost_batches += 1
                    log.warning(
                        "%s: rows of a batch of %d were lost with a storage unit (%s); the "
                        "rest go back to the task",
                        self.name,
                        len(meta),
                        lost,
                    )
                    await self.client.release(meta)
                    continue
                except LeaseExpiredError as gone:
                    self.work.finish(token, done=False)
                    self._drop(meta, gone)
                    continue
                except BaseException:
                    self.work.finish(token, done=False)
                    raise
                self.work.finish(token)
                t1 = time.perf_counter()
                if out.spans:
                    *parts, last = out.spans
                    for where, s, e in parts:
                        self.timeline.record(f"{self.name}/{where}", s, e, samples=0, tokens=0)
                    where, s, e = last
                    self.timeline.record(
                        f"{self.name}/{where}", s, e, samples=len(meta), tokens=out.tokens
                    )
                else:
                    where = lane if out.lane is None else f"{self.name}/{out.lane}"
                    self.timeline.record(where, t0, t1, samples=len(meta), tokens=out.tokens)
                self.batches += 1
                self.samples += len(meta)
                self.tokens += out.tokens
                for k, v in out.metrics.items():
                    acc = self._metrics.setdefault(k, [0.0, 0])
                    if math.isfinite(v):
                        acc[0] += float(v) * len(meta)
                        acc[1] += len(meta)
                await a.after_batch()
                if self._held and a.settled():
                    held, self._held = self._held, []
                    for m in held:
                        try:
                            await self.client.ack(m)
                        except LeaseExpiredError as gone:
                            self._drop(m, gone)
            if meta.is_end:
                return

    def _drop(self, meta: BatchMeta, why: LeaseExpiredError) -> None:
        """Drop a batch whose lease was returned while this worker held it: its rows went back
        to the task and are (or will be) processed by whoever leased them again."""
        self.dropped_batches += 1
        log.warning(
            "%s: dropped a batch of %d rows, lease %s: it was returned while this stage held "
            "it (%s); its rows are handed out again",
            self.name,
            len(meta),
            meta.lease_id,
            why,
        )

    async def _process(self, meta: BatchMeta, token: int) -> StageOutput:
        """Read the batch, run the adapter, write its output (or ack); ``token``: the batch's
        unit on :attr:`work`, whose phase follows."""
        a = self.adapter
        fields = None if a.read_fields is None else list(a.read_fields)
        cols = await self.client.get_data(meta, fields)
        self.work.phase(token, "process")
        out = await a.process(meta, cols)
        self.work.phase(token, "write")
        _check_outputs(a, out.columns)
        if out.columns:
            await self.client.put(
                out.columns,
                meta=meta,
                version=out.version,
                length=out.length,
                lease_s=self.lease_s,
            )
        elif a.holds_leases:
            self._held.append(meta)
        else:
            await self.client.ack(meta)
        return out


def _check_outputs(adapter: Adapter, columns: Mapping[str, Any]) -> None:
    """An adapter writes exactly the fields it declares (or nothing: a plain ack)."""
    if not columns:
        return
    declared = set(adapter.output_fields)
    if set(columns) != declared:
        missing, extra = sorted(declared - set(columns)), sorted(set(columns) - declared)
        raise RuntimeError(
            f"{type(adapter).__name__} (task {adapter.task!r}) declares output_fields "
            f"{sorted(declared)} but wrote {sorted(columns)} (missing {missing}, undeclared "
            f"{extra}); set output_fields to what process() returns"
        )
