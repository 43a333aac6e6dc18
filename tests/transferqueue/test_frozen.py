"""TransferQueue servers that are alive but frozen (SIGSTOP: a process swapped out, a host
stalled, a link partitioned), not dead: nothing restarts them, so liveness must find them.

- a frozen storage unit of a ``replicas=2`` service: reads of its rows come from their other
  copy, the unit is declared lost within the liveness bound and puts go on without it, and
  no row is lost or delivered twice; woken, it serves again;
- a frozen controller: a client call fails with a typed ``PeerGoneError`` within the liveness
  bound (never waits for its own, longer timeout), and once woken the controller serves the
  same rows: the failed ``get_meta`` may still land when the controller wakes (it was queued
  in the socket), and then its lease holds the rows at most ``lease_s``.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from test_replicas import LIVENESS, SLACK_S, _ctl, _kill_and_recover

import transferqueue
from transferqueue.errors import PeerGoneError

LEASE_S = 5.0


@pytest.mark.slow
@pytest.mark.service
def test_a_frozen_unit_with_replicas_loses_no_row_and_serves_once_woken() -> None:
    with (
        transferqueue.serve(num_units=3, spread_bytes=0, replicas=2) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        frozen = svc.pids[1]
        woken: list[float] = []

        def wake() -> bool:
            if not woken:
                os.kill(frozen, signal.SIGCONT)
                woken.append(time.monotonic())
            return True

        try:
            _kill_and_recover(c, lambda: os.kill(frozen, signal.SIGSTOP), wake, 3)
        finally:
            os.kill(frozen, signal.SIGCONT)
        assert svc.restarts[1] == 0 and svc.pids[1] == frozen  # the same process, woken
        assert all(_ctl(c)["units_alive"])


@pytest.mark.slow
@pytest.mark.service
def test_a_frozen_controller_fails_a_call_as_gone_within_the_liveness_bound() -> None:
    with (
        transferqueue.serve(num_units=1) as svc,
        transferqueue.connect(svc.address, call_timeout_s=600.0) as tq,
    ):
        c = tq.client()
        c.declare_tasks(["t"], partition="p")
        meta = c.put({"x": torch.arange(8)}, partition="p")
        ctl = svc.pids[-1]
        os.kill(ctl, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(PeerGoneError):
                c.get_meta("t", ["x"], 8, partition="p", timeout_s=None, lease_s=LEASE_S)
            waited = time.monotonic() - t0
        finally:
            os.kill(ctl, signal.SIGCONT)
        assert waited < LIVENESS.bound_s + SLACK_S, waited  # not the call's 600 s
        got = c.get_meta("t", ["x"], 8, partition="p", timeout_s=LEASE_S + SLACK_S)
        assert got.indexes.tolist() == meta.indexes.tolist()  # woken, it serves its rows
        assert torch.equal(c.get_data(got)["x"], torch.arange(8))
