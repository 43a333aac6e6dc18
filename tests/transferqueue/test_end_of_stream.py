"""End of stream after losses: a consumer reaches ``end`` once nothing it can read is left,
whatever the order of declare, put, loss (a storage unit's death), retire, poll and finish.

Rows lost or retired before a task first polls count as lost or retired for that task (they
were pending for it), so its end-of-stream condition holds; a group consumer whose group lost
a row ends with the survivors unread (the group can never be whole). The property test draws
event orders and runs them against the embedded deployment (a unit's death is what the
controller's server does when it misses the unit: lose it, the unit comes back empty) and a
local service (the unit process SIGKILLed and restarted by its supervisor).
"""

from __future__ import annotations

import itertools
import os
import signal
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tq_helpers import until

import transferqueue
from transferqueue import BatchMeta, Client, FinishedError, TransferQueue
from transferqueue.client.handle import TransferQueue as Handle
from transferqueue.controller.core import Controller
from transferqueue.controller.handlers import handlers
from transferqueue.controller.service import ControllerService
from transferqueue.deploy.local_links import LocalControllerLink, LocalUnitLink
from transferqueue.errors import BadRequestError
from transferqueue.loop import LoopThread
from transferqueue.storage.unit import StorageUnit

LOSS_BOUND_S = transferqueue.Liveness().bound_s + 45.0  # death noticed, unit restarted (loaded)
END_CALLS = 64  # get_meta calls a drain may take (each returns at once or at its timeout)


def _controller() -> Controller:
    ctl = Controller(2, spread_bytes=0)
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")
    return ctl


def _drain(
    ctl: Controller, task: str, sampler: str = "fifo", **options: object
) -> tuple[list[int], str | None]:
    """Poll ``task`` (no wait: the reply the service would give once nothing changes) and
    ack each batch until ``end`` or a poll that would wait; the rows read and the last reason."""
    got: list[int] = []
    for _ in range(END_CALLS):
        meta, _ = ctl.queues.poll(
            task=task,
            partition="p",
            fields=["x"],
            batch_size=4,
            lease_s=60,
            sampler=sampler,
            sampler_options=options,
        )
        if meta is None:
            return got, None  # (the service would wait here: forever, the partition finished)
        got += meta.indexes.tolist()
        if meta.lease_id is not None:
            ctl.queues.ack(meta.lease_id, meta.indexes)
        if meta.reason == "end":
            return got, "end"
    return got, "no end"


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("gone", ["lost", "retired"])
def test_rows_gone_before_a_task_first_polls_count_for_it(declared: bool, gone: str) -> None:
    ctl = _controller()
    if declared:
        ctl.queues.declare_tasks("p", ["a", "b"])
    meta = ctl.writes.allocate(8, "p", groups=np.arange(8) // 2)
    ctl.writes.commit(meta.indexes, ["x"])
    assert meta.units.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    if gone == "lost":
        ctl.health.lose_unit(1)  # rows 4-7, groups 2 and 3
    else:
        ctl.retirement.retire_groups("p", [2, 3], unless_leased_by=None)
    ctl.queues.finish("p")
    for task in ("a", "b"):
        got, reason = _drain(ctl, task)
        assert (sorted(got), reason) == ([0, 1, 2, 3], "end")
        counts = ctl.stats()["partitions"]["p"]["tasks"][task]
        assert (counts[gone], counts["done"], counts["waiting"]) == (4, 4, 0)
    if gone == "lost":  # the rows lost before the task existed are in its loss log
        assert ctl.retirement.lost_rows("p", "a").groups.tolist() == [2, 2, 3, 3]


def test_retired_rows_end_the_stream_of_a_task_that_had_polled() -> None:
    ctl = _controller()
    meta = ctl.writes.allocate(8, "p", groups=np.arange(8) // 2)
    ctl.writes.commit(meta.indexes, ["x"])
    first, _ = ctl.queues.poll(task="a", partition="p", fields=["x"], batch_size=2, lease_s=60)
    assert first is not None and first.lease_id is not None
    ctl.queues.ack(first.lease_id, first.indexes)
    ctl.retirement.retire_groups("p", [3], unless_leased_by=None)
    ctl.queues.finish("p")
    got, reason = _drain(ctl, "a")
    assert (sorted(got), reason) == ([2, 3, 4, 5], "end")


def test_a_group_consumer_ends_when_a_lost_row_left_its_group_incomplete() -> None:
    ctl = _controller()
    meta = ctl.writes.allocate(6, "p", groups=np.array([0, 0, 1, 1, 2, 2]))
    ctl.writes.commit(meta.indexes, ["x"])
    assert meta.units.tolist() == [0, 0, 0, 1, 1, 1]  # group 1 straddles both units
    ctl.health.lose_unit(1)
    ctl.queues.finish("p")
    got, reason = _drain(ctl, "g", sampler="group", group_size=2)
    assert (got, reason) == ([0, 1], "end")  # row 2 alone can never make a whole group


def test_clear_forgets_what_was_lost_and_retired() -> None:
    ctl = _controller()
    meta = ctl.writes.allocate(4, "p", groups=np.arange(4))
    ctl.writes.commit(meta.indexes, ["x"])
    _drain(ctl, "a")
    ctl.retirement.retire_groups("p", [0], unless_leased_by=None)
    ctl.health.lose_unit(1)
    ctl.queues.clear("p")
    ctl.health.unit_back(1)
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")  # (forgot)
    meta = ctl.writes.allocate(4, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    ctl.queues.finish("p")
    for task in ("a", "late"):
        got, reason = _drain(ctl, task)
        assert (sorted(got), reason) == (meta.indexes.tolist(), "end")
    assert ctl.retirement.lost_rows("p", "late").indexes.size == 0  # (the new task starts afresh)


# -- the run: a local service whose unit is SIGKILLed before the task ever polls -----
@pytest.mark.slow
@pytest.mark.service
def test_a_consumer_that_starts_after_a_unit_was_killed_reaches_end() -> None:
    with (
        transferqueue.serve(num_units=2, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["t"])
        meta = c.put({"x": torch.arange(200).view(200, 1)})
        survivors = meta.indexes[meta.units == 0].tolist()
        assert len(survivors) == 100
        os.kill(svc.pids[1], signal.SIGKILL)
        until(lambda: c.stats()["controller"]["rows_lost"] == 100, LOSS_BOUND_S, "loss")
        c.finish()
        got: list[int] = []
        reasons = []
        for _ in range(6):  # 100 rows in batches of 32: four batches, the last one `end`
            batch = c.get_meta("t", ["x"], 32, timeout_s=5)
            got += batch.indexes.tolist()
            reasons.append(batch.reason)
            if len(batch):
                c.ack(batch)
            if batch.is_end or not len(batch):
                break
        assert sorted(got) == survivors
        assert reasons[-1] == "end", reasons  # (before the fix: timeout, forever)
        task = c.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
        assert (task["done"], task["lost"], task["waiting"]) == (100, 100, 0)


# -- event orders, drawn: every consumer reaches end ---------------------------------------
TASKS = {"a": {}, "b": {"sampler": "group", "group_size": 2}}  # fifo, and whole groups
_RUN = itertools.count()  # (hypothesis reseeds `random`: partitions named by a counter)


@dataclass
class Model:
    """What the run did, to check each task's deliveries against."""

    units: dict[int, int] = field(default_factory=dict)  # row -> unit
    groups: dict[int, int] = field(default_factory=dict)  # row -> group
    lost: set[int] = field(default_factory=set)
    retired: set[int] = field(default_factory=set)
    read: dict[str, Counter[int]] = field(default_factory=lambda: {t: Counter() for t in TASKS})
    finished: bool = False


class Deployment:
    """A TransferQueue of two units whose unit 1 can die (and come back empty)."""

    tq: TransferQueue
    kills = 0

    def kill_unit_1(self) -> None:
        raise NotImplementedError


class Embedded(Deployment):
    """The embedded deployment, built from its parts so the test can play the server that
    notices a dead unit: the controller service loses it, the unit comes back empty."""

    def __init__(self) -> None:
        self.io = LoopThread("eos-test")
        self.executor = ThreadPoolExecutor(2)
        self.units = [StorageUnit(i) for i in range(2)]
        self.links = links = [LocalUnitLink(u, self.executor) for u in self.units]

        async def free_rows(unit: int, indexes: np.ndarray) -> None:
            await links[unit].free(indexes)

        async def make() -> ControllerService:
            service = ControllerService(Controller(2, spread_bytes=0), free_rows)
            await service.start()
            return service

        self.service = self.io.run(make())

        def close() -> None:
            self.io.run(self.service.close(), timeout=10)
            self.executor.shutdown(wait=True)

        self.tq = Handle(
            self.io, LocalControllerLink(*handlers(self.service)), links, closers=[close]
        )

    def kill_unit_1(self) -> None:
        async def die() -> None:
            self.service.lose_unit(1)
            await self.links[1].reset()  # (a restarted unit is empty)
            self.service.unit_back(1)

        self.io.run(die())
        self.kills += 1


class Service(Deployment):
    def __init__(self, svc: transferqueue.LocalService) -> None:
        self.svc = svc
        self.tq = transferqueue.connect(svc.address)

    def kill_unit_1(self) -> None:
        os.kill(self.svc.pids[1], signal.SIGKILL)
        self.kills += 1
        c = self.tq.client()
        until(
            lambda: (
                c.stats()["controller"]["units_lost"] == self.kills
                and c.stats()["controller"]["units_alive"] == [True, True]
            ),
            LOSS_BOUND_S,
            "unit 1 lost and back",
        )


EVENTS = st.one_of(
    st.tuples(st.just("put"), st.integers(1, 6)),
    st.tuples(st.just("lose")),
    st.tuples(st.just("retire"), st.integers(0, 8)),
    st.tuples(st.just("poll"), st.sampled_from(sorted(TASKS)), st.booleans()),
    st.tuples(st.just("declare")),
    st.tuples(st.just("finish")),
)


def _run_events(dep: Deployment, events: list[tuple[object, ...]]) -> None:
    partition = f"run-{next(_RUN)}"
    c = dep.tq.client()
    model = Model()
    next_group = 0
    declared = False
    for event in events:
        kind = event[0]
        if kind == "put":
            n = int(event[1])  # type: ignore[call-overload]
            groups = [next_group + i // 2 for i in range(n)]  # groups of 2 (the last may be 1)
            next_group += (n + 1) // 2
            if model.finished:
                with pytest.raises(FinishedError):
                    c.put(
                        {"x": torch.zeros(n, 1, dtype=torch.int64)},
                        group=groups,
                        partition=partition,
                    )
                continue
            meta = c.put(
                {"x": torch.zeros(n, 1, dtype=torch.int64)}, group=groups, partition=partition
            )
            model.units.update(zip(meta.indexes.tolist(), meta.units.tolist(), strict=True))
            model.groups.update(zip(meta.indexes.tolist(), groups, strict=True))
        elif kind == "lose":
            live = _live(c, partition)
            dep.kill_unit_1()
            model.lost |= {i for i in live if model.units[i] == 1}
        elif kind == "retire":
            wanted = [int(event[1])]  # type: ignore[call-overload]
            live = _live(c, partition)
            retired = c.retire_groups(wanted, partition=partition, unless_leased_by=None)
            gone = {i for i in live if model.groups[i] in wanted}
            assert retired.rows == len(gone)
            model.retired |= gone
        elif kind == "poll":
            task, ack = str(event[1]), bool(event[2])
            meta = c.get_meta(task, ["x"], 4, partition=partition, timeout_s=0, **TASKS[task])
            _consume(c, model, task, meta, ack)
        elif kind == "declare" and not declared:
            c.declare_tasks(sorted(TASKS), partition=partition)
            declared = True
        elif kind == "finish":
            c.finish(partition)
            model.finished = True
    if not model.finished:
        c.finish(partition)
    for task, sampler in TASKS.items():
        for _ in range(END_CALLS):
            meta = c.get_meta(task, ["x"], 4, partition=partition, timeout_s=2, **sampler)
            _consume(c, model, task, meta, True)
            if meta.is_end or meta.reason == "timeout":  # (nothing else runs: stuck for good)
                break
        else:
            raise AssertionError(f"task {task!r} did not reach end in {END_CALLS} calls")
        assert meta.reason == "end", (task, meta.reason, c.stats()["controller"]["partitions"])
    put = set(model.units)
    for task, read in model.read.items():
        assert max(read.values(), default=1) == 1, f"{task}: a row read twice"
        unread = put - set(read) - model.lost - model.retired
        if task == "a":
            assert not unread, f"{task}: rows {sorted(unread)} were never read"
        else:  # whole groups only: unread is what can never be whole (a loss, a short group)
            sizes = Counter(model.groups.values())
            broken = {model.groups[i] for i in model.lost - set(read)}
            broken |= {g for g, n in sizes.items() if n < 2}
            assert {model.groups[i] for i in unread} <= broken, sorted(unread)


def _live(c: Client, partition: str) -> set[int]:
    """The rows of ``partition`` the controller holds (none: it does not know it yet)."""
    try:
        return set(c.status(partition).indexes.tolist())
    except BadRequestError:
        return set()


def _consume(c: Client, model: Model, task: str, meta: BatchMeta, ack: bool) -> None:
    if not len(meta):
        return
    if ack:
        c.ack(meta)
        model.read[task].update(meta.indexes.tolist())
    else:
        c.release(meta)


@pytest.fixture(scope="module")
def embedded() -> Iterator[Embedded]:
    dep = Embedded()
    yield dep
    dep.tq.close()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(events=st.lists(EVENTS, max_size=14))
def test_every_consumer_reaches_end_whatever_the_order_embedded(
    embedded: Embedded, events: list[tuple[object, ...]]
) -> None:
    _run_events(embedded, events)


@pytest.fixture(scope="module")
def service() -> Iterator[Service]:
    with transferqueue.serve(num_units=2, spread_bytes=0, max_restarts=1000) as svc:
        dep = Service(svc)
        yield dep
        dep.tq.close()


@pytest.mark.service
@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(events=st.lists(EVENTS, max_size=12))
def test_every_consumer_reaches_end_whatever_the_order_service(
    service: Service, events: list[tuple[object, ...]]
) -> None:
    _run_events(service, events)
