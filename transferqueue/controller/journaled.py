"""``JournaledController``: the controller core whose changes are journaled, and recovery.

The core (:class:`~transferqueue.controller.core.Controller`) is synchronous and deterministic
given its inputs, its clock and the lease ids it draws. This subclass records each call of a
method that changes it (the outermost call only: a method calling another is one record)
with the clock value the call saw (the clock stands still during a call, so a replay sees
the same one) and the lease ids drawn (:mod:`transferqueue.controller.journal` writes them).
Replaying the records in order into the last snapshot gives back the exact state.

Who calls what: the controller's server builds it with :func:`open_controller` (recovering
from ``state_dir`` when it holds state), the service calls its methods as it would a plain
controller's, and its timer calls :meth:`JournaledController.journal_tick` (fsync, snapshot).

Time after a restart: the clock is ``time.monotonic``, which goes on across processes on the
same host, so lease and allocation deadlines keep their meaning. A restart on another host
(or after a reboot) is not promised: deadlines further in the future than their maximum are
clamped by :meth:`JournaledController.clamp_deadlines` (the restarted controller calls it).
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from transferqueue.controller.core import Changes, Controller
from transferqueue.controller.journal import (
    Journal,
    JournalSettings,
    Record,
    read_records,
    read_snapshot,
)
from transferqueue.controller.leases import random_lease_id
from transferqueue.controller.snapshot import end_loading, import_rows, import_tasks
from transferqueue.errors import CheckpointError

__all__ = ["JournalClock", "JournaledController", "call_function", "open_controller"]

log = logging.getLogger(__name__)


class JournalClock:
    """The core's clock: ``base`` (monotonic), standing still at ``now`` during a call."""

    def __init__(self, base: Callable[[], float] = time.monotonic) -> None:
        self.base = base
        self.now: float | None = None

    def __call__(self) -> float:
        return self.base() if self.now is None else self.now


class LeaseIds:
    """Where the lease table draws ids: at random (recorded), or replayed from a record."""

    def __init__(self) -> None:
        self.drawn: list[int] = []
        self.forced: list[int] | None = None

    def __call__(self) -> int:
        if self.forced is not None:
            if not self.forced:
                raise CheckpointError("a replayed call drew more lease ids than recorded")
            return self.forced.pop(0)
        lid = random_lease_id()
        self.drawn.append(lid)
        return lid


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "import_rows": import_rows,
    "import_tasks": import_tasks,
    "end_loading": end_loading,
}
"""Functions of :mod:`transferqueue.controller.snapshot` that change the core (journaled via
apply)."""


def _unchanged_expire(ctl: Controller) -> Any:
    return ctl.leases.expired


def _unchanged_reclaim(ctl: Any) -> Any:
    marks = ctl._marks
    return (len(marks), marks[0] if marks else None, marks[-1] if marks else None,
            ctl._reclaimed_below)  # fmt: skip


def _unchanged_plans(ctl: Controller) -> Any:
    return ctl._next_plan


def _unchanged_partition(ctl: Controller) -> Any:
    return len(ctl._partitions)


# method -> None (always recorded), or a fingerprint of the state it may change: a call that
# leaves it as it was and raised nothing is not recorded (timer calls that found nothing due)
_JOURNALED: dict[str, Callable[[Any], Any] | None] = {
    "register_fields": None,
    "partition": _unchanged_partition,
    "allocate": None,
    "commit": None,
    "declare_tasks": None,
    "poll": None,
    "ack": None,
    "release": None,
    "renew": None,
    "expire": _unchanged_expire,
    "reclaim": _unchanged_reclaim,
    "discard": None,
    "finish": None,
    "clear": None,
    "lose_unit": None,
    "lose_rows": None,
    "unit_back": None,
    "drop_copies": None,
    "plan_copies": _unchanged_plans,
    "copies_made": None,
    "abandon_copies": None,
    "retire_groups": None,
    "reset_consumption": None,
    "set_custom_meta": None,
    "key_rows": None,
    "delete_keys": None,
    "restore_keys": None,
    "apply": None,
    "set_unit_host": None,
    "reclaim_uncommitted": None,
    "advance_index": None,
    "clamp_deadlines": None,
}


class JournaledController(Controller):
    """A :class:`Controller` whose changing calls go to ``journal`` (None: not recorded)."""

    def __init__(self, num_units: int = 1, **kwargs: Any) -> None:
        base = kwargs.pop("clock", time.monotonic)
        super().__init__(num_units, clock=JournalClock(base), **kwargs)
        self._ids = LeaseIds()
        self.leases.new_id = self._ids
        self.journal: Journal | None = None
        self._depth = 0
        self._replaying: tuple[float, list[int]] | None = None
        self._broken: OSError | None = None  # (the journal failed: see journal_tick)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["journal"] = None
        state["_depth"] = 0
        state["_replaying"] = None
        state["_broken"] = None
        return state

    # -- calls the restart needs (journaled like the others) ----------------------------------
    def apply(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call one of :mod:`transferqueue.controller.snapshot`'s functions that change the core."""
        return _FUNCTIONS[function](self, *args, **kwargs)

    def set_unit_host(self, unit: int, host: str) -> None:
        """The host of unit ``unit`` (replicas go to another host's unit)."""
        self._check_unit(unit)
        self.placement.set_host(unit, host)

    def reclaim_uncommitted(self) -> Changes:
        """Discard every row allocated and not committed (a restarted controller: the puts
        that allocated them failed with the old one); freed on their units, remembered as
        reclaimed (a late commit learns they were lost)."""
        h = self._h
        return self._reclaim_slots(np.flatnonzero(h["live"] & ~h["committed"]))

    def advance_index(self, first: int) -> None:
        """New rows get indexes ``first`` or later (a unit holds rows up to ``first - 1``)."""
        self._next_index = max(self._next_index, int(first))

    def clamp_deadlines(self) -> None:
        """Deadlines further away than their maximum (a clock that restarted) come closer."""
        now = self.clock()
        table = self.leases
        latest = now + table.max_lease_s
        moved = False
        for lease in table._active.values():
            if lease.deadline > latest:
                lease.deadline, moved = latest, True
        if moved:
            table._heap = [(lease.deadline, lid) for lid, lease in table._active.items()]
            heapq.heapify(table._heap)
        self._marks = type(self._marks)((min(t, now), i) for t, i in self._marks)

    # -- recording and replay -----------------------------------------------------------------
    def _journaled(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        method = _BASE[name]
        if self._depth:
            return method(self, *args, **kwargs)
        if self._broken is not None and self.journal is not None:
            raise CheckpointError(
                f"the controller's journal in {self.journal.state_dir} could not be written "
                f"({self._broken}); it refuses calls until a snapshot succeeds (free disk space)"
            )
        clock, ids = self.clock, self._ids
        assert isinstance(clock, JournalClock)
        replay = self._replaying
        if replay is not None:
            clock.now, ids.forced = replay[0], list(replay[1])
        else:
            clock.now, ids.drawn = clock.base(), []
        fingerprint = _JOURNALED[name]
        before = None if fingerprint is None else fingerprint(self)
        failed = True
        self._depth = 1
        try:
            result = method(self, *args, **kwargs)
            failed = False
            return result
        finally:
            self._depth = 0
            now, clock.now = clock.now, None
            ids.forced = None
            journal = self.journal
            record = replay is None and journal is not None and now is not None
            if record and (failed or fingerprint is None or fingerprint(self) != before):
                assert journal is not None and now is not None
                try:
                    journal.append((name, now, ids.drawn, failed, list(args), kwargs))
                except OSError as e:  # (the call's reply says so; the next snapshot heals)
                    self._broken = e
                    raise CheckpointError(
                        f"{name}: the controller's journal could not be written ({e})"
                    ) from e

    def replay(self, rec: Record) -> None:
        """Apply one record (recovery): the same call, at the same clock, with the same ids."""
        name, now, ids, failed, args, kwargs = rec
        if name not in _JOURNALED:
            raise CheckpointError(f"a journal record names an unknown call {name!r}")
        self._replaying = (now, ids)
        try:
            getattr(self, name)(*args, **kwargs)
        except Exception as e:
            if not failed:
                raise CheckpointError(
                    f"replaying {name} raised {e!r} although it succeeded when recorded; the "
                    "journal does not match its snapshot"
                ) from e
        else:
            if failed:
                raise CheckpointError(
                    f"replaying {name} succeeded although it raised when recorded; the "
                    "journal does not match its snapshot"
                )
        finally:
            self._replaying = None

    def journal_tick(self) -> None:
        """Between calls (the service's timer): sync the log, snapshot when due. A journal
        that could not be written is healed by a snapshot (the whole state: what the failed
        record missed included); until one succeeds every call is refused."""
        journal = self.journal
        if journal is None:
            return
        try:
            journal.sync()
            if journal.snapshot_due() or self._broken is not None:
                journal.snapshot(self)
                self._broken = None
        except OSError as e:
            if self._broken is None:
                log.error("the controller's journal in %s fails: %r", journal.state_dir, e)
            self._broken = e


def call_function(ctl: Controller, function: str, *args: Any, **kwargs: Any) -> Any:
    """``function`` of :mod:`transferqueue.controller.snapshot` on ``ctl`` (journaled when it
    is)."""
    if isinstance(ctl, JournaledController):
        return ctl.apply(function, *args, **kwargs)
    return _FUNCTIONS[function](ctl, *args, **kwargs)


def _make_method(name: str) -> Callable[..., Any]:
    def method(self: JournaledController, *args: Any, **kwargs: Any) -> Any:
        return self._journaled(name, args, kwargs)

    method.__name__ = name
    method.__doc__ = _BASE[name].__doc__
    return method


_BASE: dict[str, Callable[..., Any]] = {n: getattr(JournaledController, n) for n in _JOURNALED}
"""The unjournaled method of each journaled name (the Controller's, or this module's)."""
for _name in _JOURNALED:
    setattr(JournaledController, _name, _make_method(_name))


def open_controller(
    state_dir: str | os.PathLike[str],
    make: Callable[[], JournaledController],
    settings: JournalSettings | None = None,
) -> tuple[JournaledController, bool]:
    """The controller of ``state_dir``: recovered from its snapshot and log (True), or made
    new by ``make`` (False) and snapshotted at once; journaling into the directory."""
    journal = Journal(state_dir, settings or JournalSettings())
    try:
        return _open(journal, make)
    except BaseException:
        journal.close()
        raise


def _open(
    journal: Journal, make: Callable[[], JournaledController]
) -> tuple[JournaledController, bool]:
    loaded = read_snapshot(journal.state_dir)
    if loaded is None:
        if journal.segments_from(0):
            raise CheckpointError(
                f"state_dir {journal.state_dir} has log segments but no snapshot; it was not "
                "written by a TransferQueue controller (or was damaged): start with an empty "
                "directory"
            )
        ctl = make()
        ctl.journal = journal
        journal.open_segment(0)
        journal.snapshot(ctl)
        return ctl, False
    ctl, first = loaded
    if not isinstance(ctl, JournaledController):
        raise CheckpointError(f"state_dir {journal.state_dir} holds no controller snapshot")
    fresh = make()
    if (fresh.num_units, fresh.placement.replicas) != (ctl.num_units, ctl.placement.replicas):
        raise CheckpointError(
            f"state_dir {journal.state_dir} holds a controller of {ctl.num_units} units and "
            f"replicas={ctl.placement.replicas}; this one has {fresh.num_units} units and "
            f"replicas={fresh.placement.replicas}. Start it as it was, or with an empty state_dir"
        )
    assert isinstance(ctl.clock, JournalClock)
    ctl.clock.base = fresh.clock.base if isinstance(fresh.clock, JournalClock) else time.monotonic
    paths = journal.segments_from(first)
    for k, path in enumerate(paths):
        for rec in read_records(path, repair=k == len(paths) - 1):
            ctl.replay(rec)
    last = int(os.path.basename(paths[-1]).split(".")[1]) if paths else first
    journal.open_segment(last + 1)
    ctl.journal = journal
    ctl.clamp_deadlines()
    return ctl, True
