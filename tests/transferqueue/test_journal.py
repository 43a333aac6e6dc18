"""The controller's journal: a core driven through a random mix of calls, recovered from its
state directory at several cut points (and across snapshots), is the same core."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transferqueue.controller.journal import SNAPSHOT, JournalSettings, read_records
from transferqueue.controller.journaled import JournaledController, open_controller
from transferqueue.controller.rereplicate import CopyPlan
from transferqueue.controller.service import ControllerService
from transferqueue.errors import CheckpointError, TQError
from transferqueue.schema import FieldSpec
from transferqueue.wire.replies import TaskImport

PARTS = ["p0", "p1", "kv"]
TASKS: list[tuple[str, list[str], str, dict[str, Any]]] = [
    ("a", ["x"], "fifo", {}),
    ("b", ["x", "y"], "fifo", {}),
    ("g", ["x"], "group", {"group_size": 2, "order": "group"}),  # (p1 declares a, b only)
    ("d", ["x"], "balanced", {"dp_size": 2}),
]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _make(clock: FakeClock, replicas: int = 1) -> JournaledController:
    return JournaledController(
        3, clock=clock, allocation_s=5.0, replicas=replicas, max_lease_s=60.0
    )


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.tolist())
    if isinstance(value, msgspec.Struct):
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def state(ctl: JournaledController, *, ids: bool = True) -> dict[str, Any]:
    """What a client can observe of the core, and the leases it holds (``ids``: with their
    ids; two cores that drew their own compare without)."""
    out: dict[str, Any] = {"stats": ctl.stats(), "next": ctl.rows.next_index}
    leases = []
    for part in ctl.partitions:
        name = part.name
        leases += ctl.leases.of_partition(part.id)
        st_ = ctl.status.status(name)
        out[f"status {name}"] = _plain(st_)
        for task in part.tasks:
            out[f"status {name} {task}"] = _plain(ctl.status.status(name, task=task))
            out[f"queue {name} {task}"] = _plain(part.tasks[task].sampler.queued())
        out[f"export {name}"] = _plain(ctl.snapshots.export_partition(name))
        out[f"keys {name}"] = _plain(ctl.keys.list_keys(name, None, False))
    out["leases"] = sorted(
        (
            lease.lease_id if ids else 0,
            lease.task,
            lease.indexes.tolist(),
            lease.deadline,
            lease.remaining,
        )
        for lease in leases
    )
    out["lost"] = ctl.rows.lost(np.arange(ctl.rows.next_index + 1)).tolist()
    live = np.flatnonzero(ctl.rows.header["live"])
    indexes = np.sort(ctl.rows.header["index"][live])
    pos, metas = ctl.status.custom_of(indexes)
    out["custom"] = list(zip(indexes[pos].tolist(), metas, strict=True))
    out["copies"] = [
        ctl.rows.header[k][live].tolist() for k in ("index", "unit", "replica", "copying")
    ]
    out["epochs"] = ctl.copies.unit_epochs.tolist()
    return out


SPECS = {
    "x": FieldSpec.dense("float32", (2,)),
    "y": FieldSpec.object(),
    "img": FieldSpec.shaped("uint8", 3),  # (ndim goes through the journal too)
}


class Driver:
    """Random calls of every kind that changes a controller (errors included: a call that
    raises is journaled and must raise again when replayed)."""

    def __init__(
        self, ctl: JournaledController, clock: FakeClock, seed: int, *, setup: bool = True
    ) -> None:
        self.ctl = ctl
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.leases: list[int] = []
        self.plan: CopyPlan | None = None  # (a copy under way)
        self.errors = 0
        if not setup:
            return
        for part in (*PARTS, "kv"):  # (specs are per partition)
            ctl.rows.register_fields(SPECS, part)
        ctl.queues.declare_tasks("p1", ["a", "b"])

    def step(self) -> None:
        r, ctl = self.rng, self.ctl
        self.clock.t += float(r.exponential(0.5))
        op = int(r.integers(0, 20))
        part = PARTS[int(r.integers(0, 2))]
        try:
            if op <= 4:
                meta = ctl.writes.allocate(
                    int(r.integers(1, 8)), part, groups=int(r.integers(0, 40))
                )
                if r.random() < 0.85:  # (else left uncommitted: reclaimed later)
                    fields = ["x"] if r.random() < 0.5 else ["x", "y"]
                    copies = meta.replica_units if r.random() < 0.8 else None
                    ctl.writes.commit(
                        meta.indexes, fields, versions=int(r.integers(0, 3)), copies=copies
                    )
            elif op <= 8:
                task, fields, sampler, options = TASKS[int(r.integers(0, len(TASKS)))]
                got, _ = ctl.queues.poll(
                    task=task,
                    partition=part,
                    fields=fields,
                    sampler=sampler,
                    sampler_options=options,
                    batch_size=int(r.integers(1, 6)),
                    lease_s=float(r.uniform(0.5, 4.0)),
                    short_ok=bool(r.random() < 0.5),
                    min_version=1 if r.random() < 0.1 else None,
                    consume=bool(r.random() < 0.3),  # (at most once: acked as handed out)
                    # (a few ids, often the same: a call sent again, or a lease of another task)
                    request_id=int(r.integers(1, 4)) if r.random() < 0.3 else None,
                )
                if got is not None and got.lease_id is not None:
                    self.leases.append(got.lease_id)
            elif op <= 11 and self.leases:
                lid = self.leases.pop(int(r.integers(0, len(self.leases))))
                lease = ctl.leases.active(lid)
                kind = int(r.integers(0, 4))
                if kind == 0 and lease is not None and lease.indexes.size > 1:
                    ctl.queues.ack(lid, lease.indexes[:1])
                    self.leases.append(lid)
                elif kind == 1:
                    ctl.queues.release(lid)
                elif kind == 2:
                    ctl.queues.renew(lid, 3.0)
                    self.leases.append(lid)
                else:
                    ctl.queues.ack(lid)
            elif op == 12:
                ctl.queues.expire()
                ctl.health.reclaim()
            elif op == 13:
                keys = [f"k{int(k)}" for k in r.integers(0, 12, size=3)]
                rows = ctl.keys.key_rows("kv", sorted(set(keys)), create=True)
                if rows.created.size:
                    ctl.writes.commit(rows.meta.indexes[rows.created], ["x"])
                if r.random() < 0.3:
                    ctl.keys.delete_keys("kv", [keys[0]])
            elif op == 14 and r.random() < 0.3:
                ctl.retirement.retire_groups(part, [int(r.integers(0, 40))], None)
            elif op == 15 and r.random() < 0.3:
                unit = int(r.integers(0, 3))
                ctl.health.lose_unit(unit)
                ctl.health.unit_back(unit)
            elif op == 15:  # (re-replication: a copy planned, done or failed later)
                if self.plan is None:
                    self.plan = ctl.copies.plan_copies(int(r.integers(1, 6)), 1 << 20)
                else:
                    plan, self.plan = self.plan, None
                    ok = bool(r.random() < 0.8)
                    ctl.copies.copies_made(plan.plan_id, plan.target, plan.indexes, plan.epoch, ok)
            elif op == 16:
                live = np.flatnonzero(ctl.rows.header["live"])
                if live.size:
                    idx = ctl.rows.header["index"][live[:2]]
                    ctl.status.set_custom_meta(idx, [b"m%d" % i for i in idx.tolist()])
            elif op == 17 and r.random() < 0.2:
                ctl.queues.reset_consumption(part, "a")
            elif op == 18 and r.random() < 0.1:
                ctl.queues.finish(part)
            elif op == 19 and r.random() < 0.05:
                ctl.queues.clear(part)
                ctl.rows.register_fields(SPECS, part)  # (a cleared partition forgot them)
        except (TQError, ValueError, KeyError):
            self.errors += 1


def _recovered(src: Path, dst: Path, clock: FakeClock, replicas: int = 1) -> JournaledController:
    """The controller recovered from a copy of ``src`` (the original journal goes on)."""
    shutil.copytree(src, dst)
    ctl, recovered = open_controller(
        dst, lambda: _make(clock, replicas), JournalSettings(fsync="never")
    )
    assert recovered
    return ctl


@pytest.mark.parametrize(("seed", "replicas"), [(0, 1), (1, 2), (2, 1), (3, 2)])
def test_a_recovered_controller_equals_the_one_that_journaled(
    seed: int, replicas: int, tmp_path: Path
) -> None:
    clock = FakeClock()
    ctl, recovered = open_controller(
        tmp_path / "live", lambda: _make(clock, replicas), JournalSettings(fsync="never")
    )
    assert not recovered
    drive = Driver(ctl, clock, seed)
    checked = 0
    for step in range(1, 601):
        drive.step()
        if step == 300:
            assert ctl.journal is not None
            ctl.journal.snapshot(ctl)  # (the log rotates: older segments go)
        if step % 150 == 0 and step < 600:
            copy = _recovered(tmp_path / "live", tmp_path / f"cut{step}", clock, replicas)
            assert state(copy) == state(ctl)
            checked += 1
            # the recovered one goes on as the original would: same calls, same answers
            t = clock.t
            twin = Driver(copy, clock, step, setup=False)
            twin.leases = list(drive.leases)
            twin.plan = drive.plan
            for _ in range(30):
                twin.step()
            clock.t = t
            drive.rng = np.random.default_rng(step)
            for _ in range(30):
                drive.step()
            assert state(copy, ids=False) == state(ctl, ids=False)
    assert checked == 3
    stats = ctl.stats()
    assert stats["rows_lost"] > 0 or stats["rows_retired"] > 0  # (the mix reached them)
    if replicas == 2:
        assert stats["rows_recopied"] > 0 and stats["copies_refused"] > 0
    assert drive.errors > 0


def test_a_torn_last_record_is_cut_and_the_rest_replays(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    drive = Driver(ctl, clock, 7)
    for _ in range(50):
        drive.step()
    want = state(ctl)
    assert ctl.journal is not None
    seg = ctl.journal.segments_from(0)[-1]
    n = sum(1 for _ in read_records(seg))
    with open(seg, "ab") as f:
        f.write(struct.pack("<II", 1000, 0) + b"torn")  # a write cut by a SIGKILL
    got = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    assert state(got) == want
    copy_seg = tmp_path / "copy" / os.path.basename(seg)
    assert sum(1 for _ in read_records(str(copy_seg))) == n
    assert os.path.getsize(copy_seg) == os.path.getsize(seg) - 12  # (cut at the last record)


def test_a_lease_taken_before_the_restart_acks_after_it(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    ctl.queues.declare_tasks("p", ["t"])
    meta = ctl.writes.allocate(10, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    first, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=4, lease_s=30)
    assert first is not None and first.lease_id is not None
    ctl.queues.ack(first.lease_id)
    held, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=4, lease_s=30)
    assert held is not None and held.lease_id is not None
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    back.queues.ack(held.lease_id, held.indexes)  # the same lease id, still open
    back.queues.ack(held.lease_id, held.indexes)  # (again: its reply died with the old one)
    rest, _ = back.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=10, lease_s=30, short_ok=True
    )
    assert rest is not None
    assert rest.indexes.tolist() == meta.indexes[8:].tolist()  # nothing acked comes back
    assert back.stats()["partitions"]["p"]["rows_freed"] == 8


def test_a_lease_whose_reply_was_lost_is_its_request_s_again_after_the_restart(
    tmp_path: Path,
) -> None:
    """A get_meta's lease is journaled, then its controller dies before the reply leaves: the
    restarted one answers the same call sent again (its request_id) with that lease's batch,
    and leases nothing more; once the lease has ended, the same id takes new rows."""
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    ctl.queues.declare_tasks("p", ["t"])
    meta = ctl.writes.allocate(10, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    ask: dict[str, Any] = dict(task="t", partition="p", fields=["x"], batch_size=4, lease_s=30)
    lost, _ = ctl.queues.poll(**ask, request_id=77)
    assert lost is not None and lost.lease_id is not None
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    clock.t += 5.0
    again, changes = back.queues.poll(**ask, request_id=77)
    assert again is not None and not changes.woken
    assert again.lease_id == lost.lease_id and again.reason == lost.reason == "full"
    assert again.indexes.tolist() == lost.indexes.tolist() == meta.indexes[:4].tolist()
    assert back.stats()["active_leases"] == 1  # (before: a second lease, the first orphaned)
    other, _ = back.queues.poll(**ask, request_id=78)  # another call: the next rows
    assert other is not None and other.indexes.tolist() == meta.indexes[4:8].tolist()
    stranger, _ = back.queues.poll(**ask, request_id=77, owner="k2", short_ok=True)
    assert stranger is not None and stranger.lease_id != lost.lease_id  # (another key's)
    back.queues.ack(again.lease_id)
    after, _ = back.queues.poll(**{**ask, "batch_size": 10}, request_id=77, short_ok=True)
    assert after is not None and after.lease_id != lost.lease_id and len(after) == 0


def test_arrays_of_every_shape_replay_as_they_were_journaled(tmp_path: Path) -> None:
    """A put's header given as one value for every row (a 0-d array: ``group=first``), and
    a header array that is a strided view, recover as the rows had them."""
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    one = ctl.writes.allocate(4, "p", groups=np.array(7), versions=np.array(3))
    strided = ctl.writes.allocate(3, "p", groups=np.arange(6)[::2], lengths=np.arange(10, 16)[::2])
    ctl.writes.commit(np.r_[one.indexes, strided.indexes], ["x"])
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    assert back.stats() == ctl.stats()
    got, _ = back.queues.poll(task="t", partition="p", fields=["x"], batch_size=7, lease_s=30)
    assert got is not None
    header = {
        i: (g, v, n)
        for i, g, v, n in zip(got.indexes, got.groups, got.versions, got.lengths, strict=True)
    }
    assert [header[i][:2] for i in one.indexes] == [(7, 3)] * 4
    assert [(header[i][0], header[i][2]) for i in strided.indexes] == [(0, 10), (2, 12), (4, 14)]


def test_deadlines_from_a_clock_that_went_back_are_clamped(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    meta = ctl.writes.allocate(3, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    got, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=3, lease_s=30)
    assert got is not None and got.lease_id is not None
    clock.t = 10.0  # (another boot: monotonic time starts again)
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    lease = back.leases.active(got.lease_id)
    assert lease is not None and lease.deadline == 10.0 + 60.0  # (was 1030: past max_lease_s)


def test_a_snapshot_of_another_format_version_is_refused(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    assert ctl.journal is not None
    ctl.journal.close()
    path = tmp_path / "d" / SNAPSHOT
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", 99)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"format version 99.*empty state_dir"):
        open_controller(tmp_path / "d", lambda: _make(clock))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / SNAPSHOT).write_bytes(b"not a snapshot at all")
    with pytest.raises(CheckpointError, match="not a TransferQueue controller snapshot"):
        open_controller(tmp_path / "e", lambda: _make(clock))


def test_a_second_controller_or_one_of_other_units_is_refused(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    with pytest.raises(CheckpointError, match="in use by another running controller"):
        open_controller(tmp_path / "d", lambda: _make(clock))
    assert ctl.journal is not None
    ctl.journal.close()
    with pytest.raises(CheckpointError, match="3 units"):
        open_controller(tmp_path / "d", lambda: JournaledController(2, clock=clock))


def test_the_state_dir_is_the_controllers_alone(tmp_path: Path) -> None:
    clock = FakeClock()
    open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="always"))
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120), replicas=st.sampled_from([1, 2]))
def test_any_cut_recovers_the_same_state(
    seed: int, steps: int, replicas: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.mktemp("cut")
    clock = FakeClock()
    ctl, _ = open_controller(
        base / "d", lambda: _make(clock, replicas), JournalSettings(fsync="never")
    )
    drive = Driver(ctl, clock, seed)
    for _ in range(steps):
        drive.step()
    shutil.copytree(base / "d", base / "copy")
    back, _ = open_controller(base / "copy", lambda: _make(clock, replicas))
    assert state(back) == state(ctl)


def test_a_load_from_a_save_is_journaled_too(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "L")
    n = np.int64
    meta = ctl.snapshots.import_rows(
        "L",
        np.arange(6),
        np.zeros(6, dtype=n),
        np.full(6, -1),
        first=True,
        keys=["k0", "k5"],  # string keys of two rows come back too
        key_rows=np.array([0, 5]),
    )
    ctl.writes.commit(meta.indexes, ["x"])
    idx = meta.indexes
    task = TaskImport("t", ["x"], "fifo", {}, idx[:2], idx[2:4][::-1].copy(), [idx[4:5]])
    ctl.snapshots.import_tasks("L", [task], ["t"], True)
    assert ctl.stats()["partitions"]["L"]["tasks"]["t"]["done"] == 2
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    assert state(back) == state(ctl)
    assert back.status.status("L", task="t").rows("queued").size == 4
    assert back.keys.export_keys("L")["L"]["keys"] == ["k0", "k5"]


def test_a_reset_service_starts_its_state_dir_afresh(tmp_path: Path) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    Driver(ctl, clock, 3).step()

    async def nothing(unit: int, indexes: np.ndarray) -> None:
        return None

    async def go() -> None:
        service = ControllerService(ctl, nothing)
        await service.reset()
        fresh = service.controller
        assert isinstance(fresh, JournaledController) and fresh.journal is not None
        fresh.rows.register_fields({"z": FieldSpec.object()}, "p")
        await service.close()  # (a clean stop: a last snapshot)

    asyncio.run(go())
    back, _ = open_controller(tmp_path / "d", lambda: _make(clock))
    assert list(back.rows.specs_of("p")) == ["z"] and back.stats()["next_index"] == 0


def test_a_journal_that_cannot_be_written_refuses_calls_until_a_snapshot_heals_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    ctl, _ = open_controller(tmp_path / "d", lambda: _make(clock), JournalSettings(fsync="never"))
    ctl.rows.register_fields({"x": FieldSpec.dense("float32", (2,))}, "p")
    assert ctl.journal is not None

    def full(rec: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ctl.journal, "append", full)
    with pytest.raises(CheckpointError, match=r"allocate: .*could not be written"):
        ctl.writes.allocate(4, "p")  # (the rows exist now, unrecorded)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="refuses calls until a snapshot succeeds"):
        ctl.writes.allocate(4, "p")
    ctl.journal_tick()  # the disk has room again: a snapshot takes the whole state
    meta = ctl.writes.allocate(4, "p")
    assert meta.indexes.tolist() == [4, 5, 6, 7]
    back = _recovered(tmp_path / "d", tmp_path / "copy", clock)
    assert state(back) == state(ctl)
