"""A whole process in Linux's ``SCHED_BATCH`` (:mod:`transferqueue.sched`): every thread it
has, the threads started after, and ZeroMQ's I/O threads; each probe runs in a fresh
interpreter, which it changes for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's SCHED_BATCH")

_PROBE = r"""
import ctypes, json, os, threading, time, zmq
# glibc remembers the class of a thread that asked for it (Ray's worker processes do), and
# libzmq starts its threads in the remembered class: ask it first, as they do
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_ulong
libc.pthread_getschedparam.argtypes = [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_void_p]
asked = (ctypes.c_int(), ctypes.c_int())
libc.pthread_getschedparam(libc.pthread_self(), ctypes.byref(asked[0]), ctypes.byref(asked[1]))
from transferqueue.sched import batch_process, in_batch, zmq_in_batch

stop = threading.Event()
earlier = threading.Thread(target=stop.wait, name="earlier")
earlier.start()
was = in_batch()
moved = batch_process()
later = threading.Thread(target=stop.wait, name="later")
later.start()
ctx = zmq.Context()
zmq_in_batch(ctx)
sock = ctx.socket(zmq.PAIR)  # (its first socket starts the context's threads)
sock.bind("inproc://probe")
deadline = time.monotonic() + 30
while True:  # (libzmq's threads set their class, then their name, once running)
    threads = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            threads[f.read().strip() + ":" + tid] = os.sched_getscheduler(int(tid))
    named = {n.split(":")[0] for n in threads}
    if {"ZMQbg/Reaper", "ZMQbg/IO/0"} <= named or time.monotonic() > deadline:
        break
    time.sleep(0.01)
stop.set()
ids = {"earlier": earlier.native_id, "later": later.native_id}
print(json.dumps({"was": was, "moved": moved, "now": in_batch(), "threads": threads, "ids": ids}))
sock.close(0)
ctx.term()
"""


def _probe(code: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_every_thread_of_the_process_and_every_later_one_is_in_sched_batch() -> None:
    out = _probe(_PROBE)
    threads = out["threads"]
    assert isinstance(threads, dict)
    assert out["was"] is False and out["now"] is True
    assert isinstance(out["moved"], int) and out["moved"] >= 2  # the main thread and "earlier"
    ids = out["ids"]
    assert isinstance(ids, dict)
    tids = {name.split(":")[1] for name in threads}
    assert {str(ids["earlier"]), str(ids["later"])} <= tids  # started before and after
    names = {name.split(":")[0] for name in threads}
    assert {"ZMQbg/Reaper", "ZMQbg/IO/0"} <= names, names  # the context's threads
    not_batch = {n: p for n, p in threads.items() if p != os.SCHED_BATCH}
    assert not not_batch, f"threads left out of SCHED_BATCH: {not_batch}"


def test_a_process_left_alone_is_not_moved() -> None:
    """Without :func:`batch_process` nothing changes, ZeroMQ's threads included: the class
    comes from the call, not from importing the module."""
    out = _probe(_PROBE.replace("moved = batch_process()", "moved = 0"))
    threads = out["threads"]
    assert isinstance(threads, dict)
    assert out["now"] is False
    assert set(threads.values()) == {os.SCHED_OTHER}
