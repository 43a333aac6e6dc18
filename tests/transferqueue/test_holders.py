"""Leases that end with their holder: a client that dies holding rows gives them back within
the holder liveness bound (not at its lease's deadline), a live client keeps its rows however
long it works on them, a closed or replaced handle gives them back at once, and a late ack of
a returned lease is refused, so each row still reaches its task exactly once.

Waits are on events with generous bounds: the machine may be loaded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tq_helpers import until

import transferqueue
from transferqueue import LeaseExpiredError, Liveness
from transferqueue.client.beats import beats_for
from transferqueue.controller.core import Controller
from transferqueue.controller.holders import Holders

LEASE_S = 600.0  # far beyond every bound here: only the holder's death may return the rows
SLACK_S = 10.0  # a loaded 2-core machine may stall a process for seconds


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ctl(client: transferqueue.Client) -> dict[str, Any]:
    return client.stats()["controller"]  # type: ignore[no-any-return]


# -- the parts, no I/O -------------------------------------------------------------------------
def test_the_silence_rule_watches_beating_holders_only_and_credits_the_controllers_stalls() -> None:
    clock = _Clock()
    h = Holders(clock, dead_after_s=5.0, grace_s=12.0)
    h.beat("a/1")
    h.seen("embedded/2")  # took a lease in-process: never beats, never silent
    clock.now += 4.9
    assert h.silent(["a/1", "embedded/2"]) == []
    clock.now += 0.2
    assert h.silent(["a/1", "embedded/2"]) == ["a/1"]
    h.beat("a/1")
    h.stalled(30.0)  # the controller itself did not look for 30 s
    clock.now += 30.0
    assert h.silent(["a/1"]) == []
    # a holder of a restored lease (after a restart), never heard of: grace_s to beat again
    assert h.silent(["restored/3"]) == []
    clock.now += 11.9
    assert h.silent(["restored/3"]) == []
    clock.now += 0.2
    assert h.silent(["restored/3"]) == ["restored/3"]
    assert Holders.named(["s/1", "s/2", "t/3", "sx/4"], "s", keep="s/2") == ["s/1"]
    with pytest.raises(ValueError, match="twice"):
        Holders(clock, dead_after_s=1.0)


def test_returned_leases_requeue_their_rows_once_and_refuse_a_late_ack() -> None:
    ctl = Controller(1)
    ctl.rows.register_fields({"x": transferqueue.FieldSpec.dense("int64", ())}, "p")
    meta = ctl.writes.allocate(6, "p")
    ctl.writes.commit(meta.indexes, ["x"])
    a, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=4, lease_s=LEASE_S, holder="dead/1"
    )
    b, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=2, lease_s=LEASE_S, holder="live/2"
    )
    assert a is not None and b is not None and a.lease_id and b.lease_id
    changes = ctl.queues.return_holders(["dead/1"])
    assert changes.woken  # the task's waiters look again
    assert (ctl.leases.returned, ctl.leases.rows_returned) == (1, 4)
    with pytest.raises(LeaseExpiredError, match="holder"):
        ctl.queues.ack(a.lease_id, a.indexes)
    again, _ = ctl.queues.poll(
        task="t", partition="p", fields=["x"], batch_size=4, lease_s=LEASE_S, holder="live/2"
    )
    assert again is not None
    assert sorted(again.indexes.tolist()) == sorted(a.indexes.tolist())
    ctl.queues.ack(again.lease_id, again.indexes)
    ctl.queues.ack(b.lease_id, b.indexes)  # the live holder's lease was never touched
    stats = ctl.stats()
    task = stats["partitions"]["p"]["tasks"]["t"]
    assert (task["done"], task["leased"], task["queued"]) == (6, 0, 0)
    assert (stats["returned_leases"], stats["returned_rows"]) == (1, 4)


# -- real processes on the local service -------------------------------------------------------
_CONSUMER = textwrap.dedent(
    """
    import sys, time
    import transferqueue
    tq = transferqueue.connect(sys.argv[1])
    c = tq.client()
    meta = c.get_meta("t", ["x"], int(sys.argv[2]), timeout_s=60, lease_s=600)
    print(" ".join(str(i) for i in meta.indexes.tolist()), flush=True)
    time.sleep(600)  # holds its batch until killed
    """
)


def test_a_consumer_process_killed_holding_rows_gives_them_back_within_the_bound() -> None:
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.put({"x": torch.arange(40).view(40, 1)})
        proc = subprocess.Popen(
            [sys.executable, "-c", _CONSUMER, svc.address, "16"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        try:
            assert proc.stdout is not None
            held = [int(i) for i in proc.stdout.readline().split()]
            assert len(held) == 16
            os.kill(proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            until(lambda: _ctl(c)["returned_rows"] == 16, 5.0 + SLACK_S, "rows returned")
            back_s = time.monotonic() - killed_at
        finally:
            proc.kill()
            proc.wait(10)
        print(f"consumer process killed holding 16 rows: back in {back_s:.2f} s")
        assert back_s < 5.0 + SLACK_S
        # every row reaches the task once: the 16 held ones again, the other 24 for the first time
        seen: list[int] = []
        while len(seen) < 40:
            meta = c.get_meta("t", ["x"], 40, timeout_s=10)
            assert len(meta), f"only {len(seen)} rows came back"
            seen += meta.indexes.tolist()
            c.ack(meta)
        assert sorted(seen) == list(range(40))
        assert set(held) <= set(seen)
        stats = _ctl(c)
        assert stats["returned_leases"] == 1 and stats["holders_lost"] == 1


def test_a_live_consumer_keeps_its_batch_longer_than_the_liveness_bound() -> None:
    fast = Liveness(holder_dead_after_s=3.0)
    with (
        transferqueue.serve(num_units=1, liveness=fast) as svc,
        transferqueue.connect(svc.address) as tq,
        transferqueue.connect(svc.address) as other,
    ):
        c = tq.client()
        c.put({"x": torch.arange(8).view(8, 1)})
        held = c.get_meta("t", ["x"], 8, timeout_s=10, lease_s=LEASE_S)
        assert len(held) == 8
        time.sleep(2 * fast.holder_dead_after_s)  # "working": no call into TransferQueue
        nothing = other.client().get_meta("t", ["x"], 8, timeout_s=0.5)
        assert len(nothing) == 0  # nobody else was given these rows
        c.ack(held)  # the lease still stands
        stats = _ctl(c)
        assert stats["returned_leases"] == 0
        assert stats["partitions"]["default"]["tasks"]["t"]["done"] == 8


_BUSY_CONSUMER = textwrap.dedent(
    """
    import sys, time
    import transferqueue
    tq = transferqueue.connect(sys.argv[1])
    c = tq.client()
    meta = c.get_meta("t", ["x"], 8, timeout_s=60, lease_s=600)
    print(" ".join(str(i) for i in meta.indexes.tolist()), flush=True)
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:  # working on the batch: CPU-bound, no call into TQ
        sum(i * i for i in range(20000))
    c.ack(meta)
    print("acked", flush=True)
    tq.close()
    """
)


def test_a_busy_consumer_process_keeps_its_batch_longer_than_the_liveness_bound() -> None:
    """A consumer in its own process, computing for twice the liveness bound without a
    call into TransferQueue: its heartbeat thread beats meanwhile, nobody else is given its
    rows, none is returned, and its ack after the work is taken."""
    fast = Liveness(holder_dead_after_s=3.0)
    work_s = 2.0 * fast.holder_dead_after_s
    with (
        transferqueue.serve(num_units=1, liveness=fast) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.put({"x": torch.arange(8).view(8, 1)})
        proc = subprocess.Popen(
            [sys.executable, "-c", _BUSY_CONSUMER, svc.address, str(work_s)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
        try:
            assert proc.stdout is not None
            held = [int(i) for i in proc.stdout.readline().split()]
            assert len(held) == 8
            started = time.monotonic()
            while time.monotonic() - started < work_s - 1.0:  # while it works, often
                assert len(c.get_meta("t", ["x"], 8, timeout_s=0.5)) == 0
                assert _ctl(c)["returned_leases"] == 0
            assert proc.stdout.readline().strip() == "acked"
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait(10)
        stats = _ctl(c)
        assert stats["returned_leases"] == 0 and stats["holders_lost"] == 0
        assert stats["partitions"]["default"]["tasks"]["t"]["done"] == 8


def test_the_holders_of_one_process_beat_together_and_keep_their_leases() -> None:
    """Twelve handles of one process, each holding a lease past the liveness bound: the
    controller reads one ``alive`` per beat for all of them (not one per handle), and none
    of their rows is returned; a handle that closes leaves the beat, the others stay in."""
    fast = Liveness(holder_dead_after_s=2.0)
    n = 12
    with transferqueue.serve(num_units=1, liveness=fast) as svc:
        handles = [transferqueue.connect(svc.address) for _ in range(n)]
        try:
            c = handles[0].client()
            c.put({"x": torch.arange(n).view(n, 1)})
            held = [
                h.client().get_meta("t", ["x"], 1, timeout_s=10, lease_s=LEASE_S) for h in handles
            ]
            assert sorted(int(m.indexes[0]) for m in held) == list(range(n))

            def alives() -> int:
                return int(c.stats()["controller"]["requests"]["kinds"]["alive"]["requests"])

            before, t0 = alives(), time.monotonic()
            time.sleep(2 * fast.holder_dead_after_s)  # silent in every other way
            beats = (alives() - before) / (time.monotonic() - t0)
            assert beats < 3.0, f"{beats:.1f} alive/s from {n} holders: they beat one by one"
            assert _ctl(c)["returned_leases"] == 0
            beating = beats_for(svc.address)
            assert sorted(beating.holders()) == sorted(h.holder.id for h in handles)
            handles[-1].close()
            assert handles[-1].holder.id not in beating.holders()
            for h, meta in zip(handles[:-1], held[:-1], strict=True):
                h.client().ack(meta)  # every lease still stands
            assert _ctl(c)["returned_leases"] == 1  # (the closed handle's: given back at once)
        finally:
            for h in handles:
                h.close()
        assert not beating.holders()


def test_a_closed_handle_and_a_replaced_holder_give_their_rows_back_at_once() -> None:
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        c.put({"x": torch.arange(12).view(12, 1)})
        first = transferqueue.connect(svc.address, holder="rollout")
        a = first.client().get_meta("t", ["x"], 4, timeout_s=10, lease_s=LEASE_S)
        second = transferqueue.connect(svc.address)
        b = second.client().get_meta("t", ["x"], 4, timeout_s=10, lease_s=LEASE_S)
        second.close()  # a handle closed holding rows: back now, not at its silence
        assert _ctl(c)["returned_rows"] == 4
        # a restarted stage host, named as the earlier one, says it replaces it
        restarted = transferqueue.connect(svc.address, holder="rollout")
        try:
            assert restarted.replace_earlier_holders() == 4
            with pytest.raises(LeaseExpiredError, match="holder"):
                first.client().ack(a)  # the earlier one's late ack is refused
            seen: list[int] = []
            while len(seen) < 12:
                meta = restarted.client().get_meta("t", ["x"], 12, timeout_s=10)
                assert len(meta)
                seen += meta.indexes.tolist()
                restarted.client().ack(meta)
            assert sorted(seen) == list(range(12))
            assert set(a.indexes.tolist()) | set(b.indexes.tolist()) <= set(seen)
        finally:
            restarted.close()
            first.close()
        assert _ctl(c)["returned_leases"] == 2


def test_embedded_leases_are_held_but_never_silent() -> None:
    with transferqueue.start() as tq:
        c = tq.client()
        c.put({"x": torch.arange(4).view(4, 1)})
        meta = c.get_meta("t", ["x"], 4, lease_s=LEASE_S)
        assert len(meta) == 4
        time.sleep(0.1)
        assert tq.holder.started  # (no heartbeat needed in-process)
        c.ack(meta)
        assert c.stats()["controller"]["returned_leases"] == 0


@pytest.mark.slow
def test_a_restarted_controller_waits_its_grace_for_holders_then_returns_the_dead_ones(
    tmp_path: Path,
) -> None:
    """A consumer process and the journaled controller SIGKILLed together: the restarted
    controller restores both leases, keeps the live consumer's (its heartbeat goes on), and
    returns the dead one's after ``holder_grace_s``, not before."""
    grace = Liveness(holder_grace_s=6.0)
    with (
        transferqueue.serve(num_units=1, state_dir=tmp_path / "state", liveness=grace) as svc,
        transferqueue.connect(svc.address, ride_through_s=120.0) as tq,
    ):
        c = tq.client()
        c.put({"x": torch.arange(20).view(20, 1)})
        mine = c.get_meta("t", ["x"], 10, timeout_s=10, lease_s=LEASE_S)
        proc = subprocess.Popen(
            [sys.executable, "-c", _CONSUMER, svc.address, "10"], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            theirs = [int(i) for i in proc.stdout.readline().split()]
            assert len(theirs) == 10
            os.kill(proc.pid, signal.SIGKILL)
            old = svc.pids[-1]
            os.kill(old, signal.SIGKILL)  # before the consumer's silence is noticed
        finally:
            proc.kill()
            proc.wait(10)
        until(lambda: svc.controller_restarts[0] == 1 and svc.pids[-1] != old, 60, "restart")
        back_at = time.monotonic()
        assert _ctl(c)["returned_rows"] == 0  # within the grace: nothing returned yet
        until(lambda: _ctl(c)["returned_rows"] == 10, 6.0 + SLACK_S, "the dead holder's rows")
        assert time.monotonic() - back_at >= 6.0 - 1.0  # not before its grace (less a tick)
        c.ack(mine)  # the live holder's lease survived the restart and its grace
        again = c.get_meta("t", ["x"], 10, timeout_s=10)
        assert sorted(again.indexes.tolist()) == sorted(theirs)
        c.ack(again)
