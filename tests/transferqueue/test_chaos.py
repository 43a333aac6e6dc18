"""Chaos soak: producers and consumers run against a local service while a driver SIGKILLs a
random storage unit, the controller, a producer or a consumer at random moments and restarts
it (units and the controller: the service's supervisor; the controller recovers its state
from its ``state_dir``). Bounded: ``CHAOS_S`` seconds of chaos (60 by default, what CI runs;
set ``TQ_CHAOS_S=600`` for a longer soak; on a starved machine it goes on, at most
``MORE_CHAOS_S`` more, until the clients have put more than 10 puts' rows and acked some), a
fixed seed (``TQ_CHAOS_SEED``), then a drain.

Two variants: replicas=1 (2 units; rows on a killed unit are lost) and replicas=2 (3 units,
a shorter soak: 40 s; a unit is killed only once the rows of the last one killed have two
copies again, see :mod:`transferqueue.controller.rereplicate`: then NO row is lost, and the soak
checks it). Invariants checked at the end:

- every row a consumer read is bit-exact (its payload is a function of its key);
- nothing is delivered to the task twice after its ack (no key acknowledged twice);
- every row a producer had acknowledged (its put returned) is consumed or reported lost in the
  task's loss log, save those a killed consumer acked without living to record them; no row
  reported lost is ever delivered; nothing stays queued, leased or waiting;
- no client call blocks past its bound (every call's duration is measured in the clients);
- ``/dev/shm`` goes back to its starting level once the dead producers' allocations are
  reclaimed.

A consumer whose ack met a dead controller does not record it (the ack may have been
journaled before the crash): such rows, like those a killed consumer acked, count as neither
acked nor lost, at most a batch per consumer per kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import transferqueue
from transferqueue import Liveness

pytestmark = [pytest.mark.service, pytest.mark.slow]

CHAOS_S = float(os.environ.get("TQ_CHAOS_S", "60"))
SEED = int(os.environ.get("TQ_CHAOS_SEED", "20261123"))
ROWS_PER_PUT = 16
ROW_FLOATS = 4096  # 16 KiB a row: a put of 256 KiB goes through shared memory
BATCH = 16
CALL_BOUND_S = 30.0  # no client call may take longer (liveness bound 4.5 s, lease 10 s)
ALLOCATION_S = 5.0  # a dead producer's allocation is reclaimed this long after
CHAOS_REPLICAS_S = float(os.environ.get("TQ_CHAOS_S", "40"))  # (replicas=2: a shorter soak)
MORE_CHAOS_S = 120.0  # (a starved machine: clients starting slowly; see the soak's loop)
REPAIR_BOUND_S = 90.0  # a unit's rows have two copies again within this (a loaded machine)
LIVENESS = Liveness()
BALLAST_PUT, BALLAST_PUTS = 64, 4  # (replicas=2: 256 rows of 32 KiB, kept to the end)

COMMON = f"ROW, N, B = {ROW_FLOATS}, {ROWS_PER_PUT}, {BATCH}\n" + textwrap.dedent(
    """
    import json, os, sys, time, torch, transferqueue
    from transferqueue import PeerGoneError, RowsLostError, TQError
    address, log_path, stop_path, name = sys.argv[1:5]
    log = open(log_path, "a")
    slowest = [0.0]
    def timed(f, *a, **k):
        t0 = time.monotonic()
        try:
            return f(*a, **k)
        finally:
            slowest[0] = max(slowest[0], time.monotonic() - t0)
    def record(**entry):
        log.write(json.dumps(entry) + "\\n")
        log.flush()
    def payload(keys):
        return keys.double().view(-1, 1) * 1e-3 + torch.arange(ROW, dtype=torch.float64)
    for attempt in range(6):  # (a client started while the controller restarts waits)
        try:
            tq = transferqueue.connect(address)
            break
        except PeerGoneError:
            if attempt == 5:
                raise
    c = tq.client()
    """
)

PRODUCER = COMMON + textwrap.dedent(
    """
    incarnation = int(time.time() * 1000) % 10**6
    seq = 0
    while not os.path.exists(stop_path):
        first = int(name) * 10**12 + incarnation * 10**6 + seq
        keys = torch.arange(N, dtype=torch.int64) + first
        seq += N
        try:
            meta = timed(c.put, {"k": keys, "v": payload(keys)}, partition="p", timeout_s=10)
        except (RowsLostError, PeerGoneError, TQError):  # nothing of it was stored: next
            time.sleep(0.2)
            continue
        record(put=meta.indexes.tolist(), keys=keys.tolist())
    record(slowest=slowest[0])
    """
)

CONSUMER = COMMON + textwrap.dedent(
    """
    while True:
        try:
            meta = timed(c.get_meta, "t", ["k", "v"], B, partition="p", timeout_s=2, lease_s=10)
        except (PeerGoneError, TQError):
            time.sleep(0.2)
            continue
        if len(meta):
            try:
                cols = timed(c.get_data, meta)
            except (RowsLostError, PeerGoneError):  # give the rest back: read again later
                try:
                    timed(c.release, meta)
                except TQError:
                    pass
                continue
            keys = cols["k"]
            if not torch.equal(cols["v"], payload(keys)):
                record(corrupt=meta.indexes.tolist())
            try:
                timed(c.ack, meta)
            except TQError as e:  # (a lease expired while this process was starved)
                record(ack_failed=repr(e))
                continue
            record(acked=meta.indexes.tolist(), keys=keys.tolist())
        elif meta.is_end:
            break
    record(slowest=slowest[0])
    """
)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _retried(call: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """``call()``, again while the controller is down (restarting; bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except transferqueue.PeerGoneError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _shm_bytes(pids: set[int]) -> int:
    """Bytes of the ``/dev/shm`` arenas that processes ``pids`` created (an arena's name starts
    with its creator's process id, :func:`transferqueue.storage.shm.new_token`): the arenas of tests
    running beside this one in another worker are not counted."""
    prefixes = tuple(f"tq-{pid & 0xFFFFFFFF:08x}" for pid in pids)
    total = 0
    for p in Path("/dev/shm").glob("tq-*"):
        if p.name.startswith(prefixes):
            with contextlib.suppress(FileNotFoundError):  # (freed meanwhile)
                total += p.stat().st_blocks * 512
    return total


def _entries(paths: list[Path]) -> list[dict[str, Any]]:
    out = []
    for p in paths:
        if p.exists():
            for line in p.read_text().splitlines():
                if line.endswith("}"):  # (a process killed mid-line leaves a torn one)
                    out.append(json.loads(line))
    return out


class _Clients:
    """Producer and consumer processes, each restartable under the same name."""

    def __init__(self, address: str, workdir: Path) -> None:
        self.address = address
        self.workdir = workdir
        self.stop = workdir / "stop"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, list[Path]] = {}
        self.pids = {os.getpid()}  # every process that made arenas: this one, each client

    def start(self, name: str) -> None:
        role, idx = name.split("-")
        code = PRODUCER if role == "producer" else CONSUMER
        log = self.workdir / f"{name}.{len(self.logs.get(name, []))}.jsonl"
        self.logs.setdefault(name, []).append(log)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-c", code, self.address, str(log), str(self.stop), idx]
        )
        self.pids.add(self.procs[name].pid)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def wait(self, role: str, timeout_s: float) -> None:
        for name, proc in self.procs.items():
            if name.startswith(role):
                assert proc.wait(timeout_s) == 0, f"{name} exited with {proc.returncode}"

    def entries(self, role: str) -> list[dict[str, Any]]:
        return _entries([p for n, ps in self.logs.items() if n.startswith(role) for p in ps])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def _worked(clients: _Clients) -> bool:
    """The producers put more than 10 puts' rows and the consumers acked some."""
    put = sum(len(e.get("put", [])) for e in clients.entries("producer"))
    return put > 10 * ROWS_PER_PUT and any("acked" in e for e in clients.entries("consumer"))


def _payload(keys: torch.Tensor) -> torch.Tensor:
    return keys.double().view(-1, 1) * 1e-3 + torch.arange(ROW_FLOATS, dtype=torch.float64)


def _put_ballast(client: transferqueue.Client, first: int) -> transferqueue.BatchMeta:
    keys = torch.arange(first, first + BALLAST_PUT, dtype=torch.int64)
    return client.put({"k": keys, "v": _payload(keys)}, partition="keep")


def _repaired(client: transferqueue.Client, last_kill: float, bound_s: float) -> float:
    """Wait (replicas=2) until the unit killed at ``last_kill`` was seen dead, is back, and
    every row has two copies again; the seconds waited. Another unit is killed only then:
    two copies survive one death at a time, not two within the repair."""
    t0 = time.monotonic()
    time.sleep(max(0.0, last_kill + LIVENESS.bound_s + 1.0 - t0))  # (seen dead by then)
    while True:
        ctl = _retried(lambda: client.stats())["controller"]
        if all(ctl["units_alive"]) and ctl["rows_one_copy"] == 0:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < bound_s, f"second copies not restored in {bound_s} s"
        time.sleep(0.2)


@pytest.mark.parametrize("replicas", [1, 2])
def test_chaos_soak_keeps_every_invariant(replicas: int, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    shm_before = _shm_bytes({os.getpid()})
    kills = {"unit": 0, "controller": 0, "producer": 0, "consumer": 0}
    chaos_s = CHAOS_S if replicas == 1 else CHAOS_REPLICAS_S
    order = list(kills)  # (replicas=2, a shorter soak: each kind of kill comes once first)
    rng.shuffle(order)
    last_unit_kill = -1e9
    repair_s: list[float] = []
    with (
        transferqueue.serve(
            num_units=2 if replicas == 1 else 3,
            replicas=replicas,
            spread_bytes=0,
            max_restarts=1000,
            allocation_s=ALLOCATION_S,
            liveness=LIVENESS,
            state_dir=tmp_path / "state",
        ) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        client = tq.client()
        client.declare_tasks(["t"], partition="p")
        if replicas == 2:  # rows kept all along (no task frees them): copied after each kill
            ballast = [_put_ballast(client, k * BALLAST_PUT) for k in range(BALLAST_PUTS)]
        clients = _Clients(svc.address, tmp_path)
        names = ["producer-1", "producer-2", "consumer-1", "consumer-2"]
        try:
            for name in names:
                clients.start(name)
            t_end = time.monotonic() + chaos_s
            # (a starved machine: the chaos goes on, bounded, until work was done under it)
            while time.monotonic() < t_end or (
                not _worked(clients) and time.monotonic() < t_end + MORE_CHAOS_S
            ):
                time.sleep(rng.uniform(2.0, 6.0))
                victim = rng.choice(["unit", "controller", "producer", "consumer"])
                if replicas == 2 and order:
                    victim = order.pop()
                if victim == "unit" and replicas == 2:
                    repair_s.append(_repaired(client, last_unit_kill, REPAIR_BOUND_S))
                if victim in ("unit", "controller"):
                    pid = svc.pids[rng.randrange(len(svc.pids) - 1) if victim == "unit" else -1]
                    if all(_running(p) for p in svc.pids):  # (one may still be restarting)
                        os.kill(pid, signal.SIGKILL)
                        kills[victim] += 1
                        if victim == "unit":
                            last_unit_kill = time.monotonic()
                else:
                    name = f"{victim}-{rng.randint(1, 2)}"
                    clients.kill(name)
                    kills[victim] += 1
                    clients.start(name)
            # the end: producers stop, the partition is finished, consumers drain it
            chaos_s = time.monotonic() - t_end + chaos_s  # (as it went)
            clients.stop.touch()
            clients.wait("producer", 120)
            _retried(lambda: client.finish("p"))  # (the controller may be restarting)
            clients.wait("consumer", 180)
        finally:
            clients.close()
        stats = _retried(lambda: client.stats())["controller"]
        if replicas == 2:  # the kept rows, read back whole after every kill
            n = BALLAST_PUT * BALLAST_PUTS
            fresh = client.get_meta("check", ["k", "v"], n, partition="keep", timeout_s=30)
            assert sorted(fresh.indexes.tolist()) == sorted(
                i for meta in ballast for i in meta.indexes.tolist()
            )
            got = client.get_data(fresh)
            assert torch.equal(got["v"], _payload(got["k"])), "a kept row differs"
            assert sorted(got["k"].tolist()) == list(range(n))
        lost: list[int] = []
        after = 0
        while True:
            page = client.lost_rows("t", partition="p", after=after)
            assert page.missed == 0
            if not page.indexes.size:
                break
            lost += page.indexes.tolist()
            after = page.next
        # the dead producers' allocations are reclaimed; their arenas are dropped
        deadline = time.monotonic() + ALLOCATION_S + 30
        while _shm_bytes(clients.pids) > shm_before + (8 << 20) and time.monotonic() < deadline:
            time.sleep(0.5)
        shm_after = _shm_bytes(clients.pids)
    produced = clients.entries("producer")
    consumed = clients.entries("consumer")
    put = [i for e in produced for i in e.get("put", [])]
    acked = [i for e in consumed for i in e.get("acked", [])]
    print(
        f"chaos {chaos_s:.0f} s seed {SEED} replicas={replicas}: kills {kills}; rows put "
        f"{len(put)}, acked {len(acked)}, lost {len(lost)}; unit restarts {svc.restarts}; "
        f"/dev/shm {shm_before >> 20} -> {shm_after >> 20} MiB; rows recopied "
        f"{stats['rows_recopied']}, waits for second copies {[round(t, 1) for t in repair_s]} s"
    )
    if replicas == 2:  # two copies, one unit killed at a time: nothing acknowledged is lost
        assert not lost and stats["rows_lost"] == 0, (len(lost), stats["rows_lost"])
        assert stats["rows_recopied"] >= BALLAST_PUT  # (the kept rows were copied again)
    assert all(kills.values()), kills  # chaos happened
    assert _worked(clients), (len(put), len(acked))  # and work went on under it
    assert not [e for e in consumed if "corrupt" in e]  # every read bit-exact
    assert len(acked) == len(set(acked))  # nothing delivered again after its ack
    assert not set(lost) & set(acked)  # a row reported lost is never delivered
    unaccounted = set(put) - set(acked) - set(lost)
    unrecorded = (kills["consumer"] + 2 * kills["controller"]) * BATCH
    assert len(unaccounted) <= unrecorded, sorted(unaccounted)[:20]
    task = stats["partitions"]["p"]["tasks"]["t"]
    assert (task["queued"], task["leased"], task["waiting"]) == (0, 0, 0), task
    slowest = max(e["slowest"] for e in produced + consumed if "slowest" in e)
    assert slowest < CALL_BOUND_S
    assert shm_after <= shm_before + (8 << 20)
