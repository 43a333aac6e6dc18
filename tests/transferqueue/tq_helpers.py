"""Helpers the TransferQueue tests import (``from tq_helpers import ...``): a module of its
own, because ``from conftest import`` finds whichever conftest.py pytest imported last when
several test directories are collected together."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from transferqueue import TransferQueue
from transferqueue.errors import PeerGoneError

Deploy = Callable[..., TransferQueue]


T = TypeVar("T")


def until(what: Callable[[], Any], timeout_s: float, label: str) -> Any:
    """Poll ``what`` until it returns something truthy (bounded: an AssertionError naming
    ``label`` after ``timeout_s``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{label}: not within {timeout_s} s")


def answered(call: Callable[[], T], timeout_s: float) -> T:
    """``call()`` once a restarted controller answers it: calls that meet the dead one or
    the restart fail with PeerGoneError, retried for at most ``timeout_s``."""
    t0 = time.monotonic()
    while True:
        try:
            return call()
        except PeerGoneError:
            if time.monotonic() - t0 > timeout_s:
                raise
            time.sleep(0.1)


def row_values(start: int, n: int) -> torch.Tensor:
    """Rows ``start..start+n`` whose every byte says which row they are (bit-exact checks)."""
    base = torch.arange(start, start + n, dtype=torch.float64).view(n, 1)
    return torch.cat([base, base * 0.5 + 0.25, -base, base / 3], dim=1)


def child_processes(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the children of process ``pid`` (Linux /proc)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as g:
                    out.append((int(child), g.read().replace(b"\0", b" ").decode()))
    return out
