"""The stage runner over a real (embedded) TransferQueue: what it writes, the adapter metrics it
keeps, and adapters that write other fields than they declare."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import transferqueue
from adapters import Adapter, StageOutput
from asyncflow.metrics import Timeline
from asyncflow.stage_runner import StageError, StageRunner
from transferqueue import BatchMeta
from transferqueue.aio import within
from transferqueue.schema import Column

ROWS = 7
BOUND_S = 60.0  # every wait below ends on an event long before this


class _Doubler(Adapter):
    """Writes ``y = 2 x`` (or what ``writes`` names) and reports two metrics per batch."""

    task = "double"
    input_fields = ("x",)
    output_fields = ("y",)
    batch_size = 3

    def __init__(self, writes: tuple[str, ...] = ("y",)) -> None:
        self.writes = writes
        self.batches: list[tuple[int, float]] = []  # (rows, x_mean or NaN) per batch

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        x = cols["x"]
        assert isinstance(x, torch.Tensor)
        # a short batch has no verdict (NaN): the runner must leave it out of the mean
        m = float(x.double().mean()) if len(meta) == self.batch_size else math.nan
        self.batches.append((len(meta), m))
        return StageOutput(
            columns={name: x * 2 for name in self.writes},
            metrics={"x_mean": m, "one": 1.0},
        )


@pytest.fixture
def tq() -> Iterator[transferqueue.TransferQueue]:
    with transferqueue.start(num_units=2) as handle:
        client = handle.client()
        client.declare_tasks(["double", "check", "check_z"], partition="p")
        client.put({"x": torch.arange(ROWS)}, group=np.arange(ROWS), partition="p")
        client.finish("p")
        yield handle


def _run(tq: transferqueue.TransferQueue, adapter: Adapter) -> StageRunner:
    runner = StageRunner("double", adapter, tq.async_client(), Timeline(), partition="p")

    async def go() -> None:
        await within(runner.run(), BOUND_S)

    asyncio.run(go())
    return runner


def test_runner_writes_the_output_and_keeps_row_weighted_adapter_metrics(
    tq: transferqueue.TransferQueue,
) -> None:
    adapter = _Doubler()
    runner = _run(tq, adapter)
    assert sum(n for n, _ in adapter.batches) == ROWS and runner.samples == ROWS
    valid = [(n, m) for n, m in adapter.batches if not math.isnan(m)]
    assert valid and len(valid) < len(adapter.batches)  # a short batch (NaN) was left out
    want = sum(n * m for n, m in valid) / sum(n for n, _ in valid)
    assert runner.drain_metrics() == {"x_mean": pytest.approx(want), "one": 1.0}
    assert runner.drain_metrics() == {}  # drained: the next record starts afresh
    client = tq.client()
    meta = client.get_meta("check", ["x", "y"], ROWS, partition="p", timeout_s=BOUND_S)
    cols = client.get_data(meta)
    assert len(meta) == ROWS and torch.equal(cols["y"], cols["x"] * 2)  # type: ignore[operator]


@pytest.mark.parametrize(
    ("writes", "message"),
    [
        (("y", "z"), r"declares output_fields \['y'\] but wrote \['y', 'z'\] .*undeclared \['z'\]"),
        ((), None),  # nothing written: a plain ack, allowed
    ],
    ids=["undeclared", "ack-only"],
)
def test_an_adapter_writing_undeclared_fields_fails_its_stage(
    tq: transferqueue.TransferQueue, writes: tuple[str, ...], message: str | None
) -> None:
    adapter = _Doubler(writes)
    if message is None:
        _run(tq, adapter)
        return
    with pytest.raises(StageError, match=message):
        _run(tq, adapter)
    # the batch was refused before its put: nothing of it reached TransferQueue
    client = tq.client()
    for task, field in (("check", "y"), ("check_z", "z")):
        meta = client.get_meta(task, [field], ROWS, partition="p", timeout_s=0)
        assert len(meta) == 0, field


def test_an_adapter_missing_a_declared_field_fails_its_stage_instead_of_starving_the_next(
    tq: transferqueue.TransferQueue,
) -> None:
    class _Declares(_Doubler):
        output_fields = ("y", "z")  # a later stage waits for z: it would never come

    with pytest.raises(StageError, match=r"wrote \['y'\] \(missing \['z'\], undeclared \[\]\)"):
        _run(tq, _Declares())


class _StepHolder(Adapter):
    """No output; holds its leases for units of three batches (``holds_leases``), noting after
    each batch how many rows the task then holds leased."""

    task = "check"
    input_fields = ("x",)
    batch_size = 2
    holds_leases = True

    def __init__(self, tq: transferqueue.TransferQueue) -> None:
        self.watch = tq.client()
        self.batches = 0
        self.leased: list[int] = []

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        self.batches += 1
        return StageOutput()

    def settled(self) -> bool:
        return self.batches % 3 == 0

    async def after_batch(self) -> None:
        stats = await asyncio.to_thread(self.watch.stats)
        self.leased.append(int(stats["controller"]["partitions"]["p"]["tasks"]["check"]["leased"]))


def test_an_adapter_that_holds_leases_has_its_batches_acknowledged_once_settled(
    tq: transferqueue.TransferQueue,
) -> None:
    """Rows of a unit of work stay leased until the adapter says it is complete (a train step
    whose rank 0 may die mid-step: its replacement gets every row of it back), then all of it
    is acknowledged."""
    adapter = _StepHolder(tq)
    runner = StageRunner("check", adapter, tq.async_client(), Timeline(), partition="p")
    asyncio.run(within(runner.run(), BOUND_S))
    # batches of 2, 2, 2, 1 rows: held 2, 4, then 6 (acknowledged after), then 1
    assert adapter.leased == [2, 4, 6, 1]
    stats = tq.client().stats()["controller"]["partitions"]["p"]["tasks"]["check"]
    assert stats["done"] == 6, stats  # the last batch's unit never completed: never acked


class _Gated(_Doubler):
    """A doubler whose first batch waits until ``go`` is set (``started`` says it holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.go = asyncio.Event(), asyncio.Event()

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        self.started.set()
        await self.go.wait()
        return await super().process(meta, cols)


def test_a_stopped_runner_finishes_the_batch_it_holds_and_takes_no_other(
    tq: transferqueue.TransferQueue,
) -> None:
    """``stop`` while a batch is in hand (a reward worker drained before it leaves): that batch
    is written, no other is taken, ``run`` returns; a second runner of the same task then
    processes exactly the rest: every row once."""
    first, rest = _Gated(), _Doubler()

    async def go() -> None:
        runner = StageRunner("double", first, tq.async_client(), Timeline(), partition="p")
        running = asyncio.ensure_future(within(runner.run(), BOUND_S))
        await within(first.started.wait(), BOUND_S)
        runner.stop()
        first.go.set()
        await running  # (returns: it took no new batch)
        other = StageRunner("double", rest, tq.async_client(), Timeline(), partition="p")
        await within(other.run(), BOUND_S)

    asyncio.run(go())
    assert [n for n, _ in first.batches] == [_Doubler.batch_size]
    assert sum(n for n, _ in rest.batches) == ROWS - _Doubler.batch_size
    meta = tq.client().get_meta("check", ["y"], batch_size=ROWS, partition="p", timeout_s=5)
    assert sorted(meta.indexes) == list(range(ROWS))  # every row written, none twice
