"""``JournaledController``: the controller core whose changes are journaled, and recovery.

The core (:class:`~transferqueue.controller.core.Controller`) is synchronous and deterministic
given its inputs, its clock and the lease ids it draws. A journaled controller records each
call of a method that changes it (the methods of its parts marked
:func:`~transferqueue.controller.journal.journaled`; the outermost call only: a method calling
another is one record) with the clock value the call saw (the clock stands still during a
call, so a replay sees the same one) and the lease ids drawn
(:mod:`transferqueue.controller.journal` writes them). Replaying the records in order into the
last snapshot gives back the exact state.

Who calls what: the controller's server builds it with :func:`open_controller` (recovering
from ``state_dir`` when it holds state), the service calls its parts as it would a plain
controller's, and its timer calls :meth:`JournaledController.journal_tick` (fsync, snapshot).

Time after a restart: the clock is ``time.monotonic``, which goes on across processes on the
same host, so lease and allocation deadlines keep their meaning. A restart on another host
(or after a reboot) is not promised: deadlines further in the future than their maximum are
clamped by :meth:`~transferqueue.controller.health.UnitHealth.clamp_deadlines` (the restarted
controller calls it).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from transferqueue.controller.core import Controller
from transferqueue.controller.journal import (
    Journal,
    JournalSettings,
    Record,
    journaled_methods,
    read_records,
    read_snapshot,
)
from transferqueue.controller.leases import random_lease_id
from transferqueue.errors import CheckpointError

__all__ = ["JournalClock", "JournaledController", "Recording", "open_controller"]

T = TypeVar("T")

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


class Recording:
    """Records the calls of a journaled controller's parts (see the module): the
    :class:`~transferqueue.controller.journal.Recorder` each part calls through."""

    def __init__(self, clock: JournalClock, ids: LeaseIds) -> None:
        self.clock = clock
        self.ids = ids
        self.journal: Journal | None = None
        self.broken: OSError | None = None  # (the journal failed: see journal_tick)
        self._depth = 0
        self._replaying: tuple[float, list[int]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(journal=None, broken=None, _depth=0, _replaying=None)
        return state

    def call(
        self,
        name: str,
        run: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fingerprint: Callable[[], Any] | None,
    ) -> T:
        if self._depth:
            return run(*args, **kwargs)
        if self.broken is not None and self.journal is not None:
            raise CheckpointError(
                f"the controller's journal in {self.journal.state_dir} could not be written "
                f"({self.broken}); it refuses calls until a snapshot succeeds (free disk space)"
            )
        clock, ids = self.clock, self.ids
        replay = self._replaying
        if replay is not None:
            clock.now, ids.forced = replay[0], list(replay[1])
        else:
            clock.now, ids.drawn = clock.base(), []
        before = None if fingerprint is None else fingerprint()
        failed = True
        self._depth = 1
        try:
            result = run(*args, **kwargs)
            failed = False
            return result
        finally:
            self._depth = 0
            now, clock.now = clock.now, None
            ids.forced = None
            journal = self.journal
            record = replay is None and journal is not None and now is not None
            if record and (failed or fingerprint is None or fingerprint() != before):
                assert journal is not None and now is not None
                try:
                    journal.append((name, now, ids.drawn, failed, list(args), kwargs))
                except OSError as e:  # (the call's reply says so; the next snapshot heals)
                    self.broken = e
                    raise CheckpointError(
                        f"{name}: the controller's journal could not be written ({e})"
                    ) from e

    def replay(self, rec: Record, method: Callable[..., Any]) -> None:
        """Apply one record through ``method`` (its call): the same call, at the same clock,
        with the same ids."""
        name, now, ids, failed, args, kwargs = rec
        self._replaying = (now, ids)
        try:
            method(*args, **kwargs)
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


class JournaledController(Controller):
    """A :class:`Controller` whose parts' changing calls go to ``journal`` (None: not
    recorded)."""

    def __init__(self, num_units: int = 1, **kwargs: Any) -> None:
        clock = JournalClock(kwargs.pop("clock", time.monotonic))
        super().__init__(num_units, clock=clock, **kwargs)
        ids = LeaseIds()
        self.leases.new_id = ids
        self.recording = Recording(clock, ids)
        for part in self.parts():
            part.recorder = self.recording
        self._calls: dict[str, Callable[..., Any]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_calls"] = None  # (bound methods: found again after a load)
        return state

    @property
    def journal(self) -> Journal | None:
        return self.recording.journal

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        self.recording.journal = journal

    def calls(self) -> dict[str, Callable[..., Any]]:
        """Every journaled call of the parts, by its name in the records."""
        calls = self._calls
        if calls is None:
            calls = {}
            for part in self.parts():
                for name, method in journaled_methods(part).items():
                    if name in calls:
                        raise TypeError(f"two parts of the controller journal a call {name!r}")
                    calls[name] = method
            self._calls = calls
        return calls

    def replay(self, rec: Record) -> None:
        """Apply one record (recovery): the same call, at the same clock, with the same ids."""
        method = self.calls().get(rec[0])
        if method is None:
            raise CheckpointError(f"a journal record names an unknown call {rec[0]!r}")
        self.recording.replay(rec, method)

    def journal_tick(self) -> None:
        """Between calls (the service's timer): sync the log, snapshot when due. A journal
        that could not be written is healed by a snapshot (the whole state: what the failed
        record missed included); until one succeeds every call is refused."""
        journal = self.journal
        if journal is None:
            return
        try:
            journal.sync()
            if journal.snapshot_due() or self.recording.broken is not None:
                journal.snapshot(self)
                self.recording.broken = None
        except OSError as e:
            if self.recording.broken is None:
                log.error("the controller's journal in %s fails: %r", journal.state_dir, e)
            self.recording.broken = e


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
    ctl.health.clamp_deadlines()
    return ctl, True
