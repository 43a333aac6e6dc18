"""The service ``bench.load`` runs its clients against: one storage unit, its servers as
processes of their own (``local``) or as Ray actors (``ray``); their CPU, memory and
descriptors; and, for the ``restart`` phase, a controller SIGKILLed and restarted with its
state (``state_dir``) under the clients' feet."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

RIDE_THROUGH_S = 60.0  # the clients' ride_through_s where the controller is restarted
RESTART_BOUND_S = 120.0  # a restarted controller answers within this, or the bench fails


@dataclass
class Served:
    """A running service: its address, its servers' process ids (the controller's as of
    now: a restart changes it), and how to restart its controller (None: not supported)."""

    address: str
    unit_pid: int
    controller_pid: Callable[[], int]
    restart: Callable[[], float] | None = None
    """SIGKILL the controller; returns once the restarted one answers a ping: seconds since
    the kill (its restart and recovery)."""


def proc_stats(pid: int) -> dict[str, float]:
    """A process's CPU seconds, resident MB and open descriptors (``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / tick
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return {"cpu_s": cpu_s, "rss_mb": rss / 2**20, "fds": fds}


def _first_answer(address: str, since: float) -> float:
    """Seconds from ``since`` until a controller at ``address`` answers a ping (pings are
    answered ahead of the backlog of the clients' calls sent again: this is the restart and
    recovery, not the queue behind them); bounded by ``RESTART_BOUND_S``."""
    import zmq

    from transferqueue.wire import codec as wire
    from transferqueue.wire import messages as m

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        rid = 0
        while time.monotonic() - since < RESTART_BOUND_S:
            rid += 1
            sock.send_multipart(wire.encode_request(rid, m.Ping()))
            if sock.poll(200):
                sock.recv_multipart()
                return time.monotonic() - since
        raise RuntimeError(f"no controller answered at {address} within {RESTART_BOUND_S} s")
    finally:
        sock.close(0)
        ctx.term()


@contextlib.contextmanager
def service(deploy: str, *, restartable: bool = False) -> Iterator[Served]:
    """A service of one unit: ``local`` (``transferqueue.serve``: processes of its own; with
    ``restartable``, a ``state_dir`` so that its controller can be killed and restarted) or
    ``ray`` (``launch_on_ray``, on the cluster the caller started)."""
    import transferqueue

    if deploy == "local":
        with contextlib.ExitStack() as stack:
            state = None
            if restartable:
                state = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "state"
            svc = stack.enter_context(transferqueue.serve(num_units=1, state_dir=state))

            def restart() -> float:
                old = svc.pids[-1]  # (the controller starts after the units)
                killed = time.monotonic()
                os.kill(old, signal.SIGKILL)
                took = _first_answer(svc.address, killed)
                if svc.pids[-1] == old:
                    raise RuntimeError("the controller answered but was never restarted")
                return took

            yield Served(
                svc.address, svc.pids[0], lambda: svc.pids[-1], restart if restartable else None
            )
        return
    import ray

    from transferqueue.deploy.ray import launch_on_ray

    start = launch_on_ray(num_units=1, spread=False)
    handle = start.handle()
    try:
        ctl, unit = start.actors[-1], start.actors[0]
        address, ctl_pid, unit_pid = ray.get(
            [ctl.address.remote(), ctl.pid.remote(), unit.pid.remote()], timeout=120
        )
        yield Served(str(address), int(unit_pid), lambda: int(ctl_pid))
    finally:
        handle.close()
