"""Loss logs and retiring groups (transferqueue.controller.retire): what an RL driver needs to
regenerate the groups a dead storage unit took, each exactly once.

A task's loss log must hold every row lost before the task consumed it, and no row it
consumed: rows waiting or queued are logged at the loss, rows it held leased only when the
lease ends unacknowledged (released or expired), never when acked. Retiring groups must free
every live row of them from every queue and lease, leave a group the named task holds leased
alone, and make late writes to retired rows fail as lost.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import transferqueue
from transferqueue import Client, RowsLostError
from transferqueue.controller.core import Controller
from transferqueue.errors import BadRequestError


def _controller(groups: list[int], now: list[float]) -> tuple[Controller, np.ndarray]:
    ctl = Controller(2, spread_bytes=0, clock=lambda: now[0])
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")
    meta = ctl.writes.allocate(len(groups), "p", groups=np.array(groups))
    ctl.writes.commit(meta.indexes, ["x"])
    return ctl, meta.units


def _lease(ctl: Controller, task: str, n: int, lease_s: float = 60.0) -> transferqueue.BatchMeta:
    got, _ = ctl.queues.poll(task=task, partition="p", fields=["x"], batch_size=n, lease_s=lease_s)
    assert got is not None and got.lease_id is not None
    return got


def test_the_loss_log_holds_what_the_task_did_not_consume_and_nothing_it_did() -> None:
    now = [0.0]
    # rows 0-4 on unit 0, rows 5-9 on unit 1; group 1 straddles both
    ctl, units = _controller([0, 0, 0, 1, 1, 1, 2, 2, 3, 3], now)
    assert units.tolist() == [0] * 5 + [1] * 5
    healthy = _lease(ctl, "train", 5)  # rows 0-4
    released = _lease(ctl, "train", 2)  # rows 5, 6
    acked = _lease(ctl, "train", 1)  # row 7
    expiring = _lease(ctl, "train", 1, lease_s=10.0)  # row 8; row 9 stays queued
    assert [released.indexes.tolist(), acked.indexes.tolist(), expiring.indexes.tolist()] == [
        [5, 6],
        [7],
        [8],
    ]
    mid_put = ctl.writes.allocate(2, "p", groups=np.array([4, 4]))  # a put not committed yet
    assert mid_put.units.tolist() == [0, 1]
    ctl.health.lose_unit(1)
    page = ctl.retirement.lost_rows("p", "train")  # (the put fails: its producer puts it again)
    assert (page.indexes.tolist(), page.groups.tolist(), page.next) == ([9], [3], 1)
    # a batch whose every row was lost stays open until its holder says what it did
    ctl.queues.ack(acked.lease_id)  # consumed (read before the unit died): never logged
    ctl.queues.ack(healthy.lease_id)
    ctl.queues.release(released.lease_id)  # given back unconsumed: logged
    now[0] = 11.0
    ctl.queues.expire()  # its holder vanished: logged
    page = ctl.retirement.lost_rows("p", "train", after=1)
    assert (page.indexes.tolist(), page.groups.tolist(), page.next) == ([5, 6, 8], [1, 2, 3], 4)
    assert page.missed == 0
    everything = ctl.retirement.lost_rows("p", "train")
    assert everything.indexes.tolist() == [9, 5, 6, 8]
    assert ctl.retirement.lost_rows("p", "train", after=4).indexes.size == 0
    with pytest.raises(BadRequestError, match="cursor 5 is past the end"):
        ctl.retirement.lost_rows("p", "train", after=5)
    # a task yet to poll lost every committed row (it consumed none): read at its first poll
    assert ctl.retirement.lost_rows("p", "never-polled").indexes.tolist() == [5, 6, 7, 8, 9]
    assert ctl.stats()["partitions"]["p"]["tasks"]["train"]["lost"] == 6  # (the put's too)


def test_retiring_groups_frees_them_everywhere_but_leaves_a_group_the_task_holds() -> None:
    now = [0.0]
    ctl, _ = _controller([0, 0, 1, 1, 2, 2, 3, 3], now)
    ctl.queues.declare_tasks("p", ["gen", "train"])
    gen = _lease(ctl, "gen", 8)
    ctl.queues.ack(gen.lease_id, gen.indexes[:4])  # gen consumed rows 0-3, holds 4-7
    held = _lease(ctl, "train", 2)  # group 0
    assert held.indexes.tolist() == [0, 1]
    retired, changes = ctl.retirement.retire_groups("p", [0, 1, 2], unless_leased_by="train")
    assert retired.rows == 4 and retired.busy.tolist() == [0]
    assert sorted(np.concatenate(changes.freed).tolist()) == [2, 3, 4, 5]  # freed on units
    with pytest.raises(RowsLostError, match="retired"):  # gen's late write to its old rows
        ctl.writes.commit(np.array([4, 5]), ["x"], lease_id=gen.lease_id)
    st = ctl.stats()
    assert st["rows_retired"] == 4 and st["partitions"]["p"]["rows_retired"] == 4
    train = st["partitions"]["p"]["tasks"]["train"]
    assert (train["retired"], train["leased"], train["queued"], train["waiting"]) == (4, 2, 2, 0)
    g = st["partitions"]["p"]["tasks"]["gen"]
    assert (g["retired"], g["done"], g["leased"], g["waiting"]) == (2, 4, 2, 0)
    # train's queue holds only what is left; retiring never writes the loss log
    rest, _ = ctl.queues.poll(
        task="train", partition="p", fields=["x"], batch_size=8, lease_s=60, short_ok=True
    )
    assert rest is not None and rest.indexes.tolist() == [6, 7]
    assert ctl.retirement.lost_rows("p", "train").indexes.size == 0
    # once train consumed group 0 it is gone (every declared task acked): nothing to retire
    ctl.queues.ack(held.lease_id)
    retired, _ = ctl.retirement.retire_groups("p", [0], unless_leased_by="train")
    assert retired.rows == 0 and retired.busy.size == 0


def test_loss_log_and_retire_over_every_deployment(client: Client) -> None:
    groups = np.repeat(np.arange(4), 2)
    client.put({"x": torch.arange(8).view(8, 1)}, group=groups, partition="p")
    held = client.get_meta(
        "train", ["x"], 2, partition="p", sampler="group", group_size=2, order="group"
    )
    assert held.groups.tolist() == [0, 0]
    retired = client.retire_groups([0, 1, 3], partition="p", unless_leased_by="train")
    assert isinstance(retired, transferqueue.Retired)
    assert retired.rows == 4 and retired.busy.tolist() == [0]
    rest = client.get_meta(
        "train",
        ["x"],
        8,
        partition="p",
        sampler="group",
        group_size=2,
        order="group",
        timeout_s=0,
    )
    assert rest.groups.tolist() == [2, 2]
    assert client.get_data(rest)["x"].view(-1).tolist() == [4, 5]
    page = client.lost_rows("train", partition="p")
    assert isinstance(page, transferqueue.LostRows)
    assert (page.indexes.size, page.next, page.missed) == (0, 0, 0)
    with pytest.raises(BadRequestError, match="past the end"):  # typed, across the wire
        client.lost_rows("train", partition="p", after=3)
    client.ack(held)
    client.ack(rest)
