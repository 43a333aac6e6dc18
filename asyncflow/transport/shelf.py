"""A receiver's shelf of versions: the newest, and the older ones its caller pinned.

Every receiver keeps its arrived versions here; its background threads :meth:`offer` them
and its caller (the generator host) uses the :class:`~asyncflow.transport.base.WeightReceiver`
methods, which each receiver forwards to its shelf. Only the newest version and pinned ones
are kept: when a newer version arrives, the previous newest is dropped unless pinned (its
memory, a shared-memory mapping or a staged buffer, goes with the last reference).

| field      | what                                                              |
|------------|-------------------------------------------------------------------|
| `_states`  | version -> state (name -> host tensor), the newest plus pinned     |
| `_extras`  | version -> what the receiver keeps beside it (a buffer, a header) |
| `_pins`    | version -> number of ``get`` calls not yet released               |
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

import torch

from asyncflow.transport.base import TransportClosedError, TransportError, VersionError

__all__ = ["VersionShelf"]


class VersionShelf:
    """The versions one receiver holds; thread-safe (one condition variable)."""

    def __init__(self, member: str) -> None:
        self.member = member
        self._cond = threading.Condition()
        self._states: dict[int, Mapping[str, torch.Tensor]] = {}
        self._extras: dict[int, object] = {}
        self._pins: Counter[int] = Counter()
        self._newest = -1
        self._closed = False
        self._error: BaseException | None = None
        self._watchers: list[Callable[[], None]] = []

    # -- the receiver's background side ---------------------------------------------------

    def offer(self, version: int, state: Mapping[str, torch.Tensor], extra: object = None) -> bool:
        """Keep ``version`` if it is newer than the newest; wake waiters. Returns whether it
        was kept (an older or equal version, or a closed shelf, drops it)."""
        with self._cond:
            if self._closed or version <= self._newest:
                return False
            previous = self._newest
            self._states[version] = state
            self._extras[version] = extra
            self._newest = version
            self._drop_unless_pinned(previous)
            self._cond.notify_all()
            watchers = list(self._watchers)
        for watcher in watchers:  # (outside the lock: a watcher may call back in)
            watcher()
        return True

    def watch(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """Call ``watcher()`` (on the receiver's background thread: it must only hand the
        news on, e.g. ``loop.call_soon_threadsafe``) each time a newer version is kept;
        returns the function that stops it."""
        with self._cond:
            self._watchers.append(watcher)

        def stop() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._watchers.remove(watcher)

        return stop

    def extra(self, version: int) -> object:
        """What was offered beside ``version`` (None when it is not held)."""
        with self._cond:
            return self._extras.get(version)

    def latest(self) -> int:
        """The newest version, without the checks of :meth:`newest` (for background threads)."""
        with self._cond:
            return self._newest

    def fail(self, error: BaseException) -> None:
        """A background thread died: later calls raise a :class:`TransportError` from it."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # -- the caller's side (WeightReceiver) ------------------------------------------------

    def newest(self) -> int:
        with self._cond:
            self._check()
            return self._newest

    def wait_newer(self, version: int, timeout_s: float) -> int:
        if not isinstance(timeout_s, int | float) or timeout_s < 0:
            raise ValueError(f"timeout_s must be a number >= 0, got {timeout_s!r}")
        deadline = time.monotonic() + float(timeout_s)
        with self._cond:
            while True:
                self._check()
                left = deadline - time.monotonic()
                if self._newest > version or left <= 0:
                    return self._newest
                self._cond.wait(left)

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        with self._cond:
            self._check()
            state = self._states.get(version)
            if state is None:
                pinned = sorted(v for v in self._states if v != self._newest)
                raise VersionError(
                    f"receiver {self.member!r}: version {version} is not available; it has the "
                    f"newest {self._newest} and pinned {pinned}; call get(newest())"
                )
            self._pins[version] += 1
            return state

    def release(self, version: int) -> None:
        with self._cond:
            if self._pins[version] <= 0:
                self._pins.pop(version, None)
                return
            self._pins[version] -= 1
            if self._pins[version] == 0:
                del self._pins[version]
                if version != self._newest:
                    self._drop_unless_pinned(version)

    def close(self) -> None:
        """Drop every version and wake waiters (who then raise TransportClosedError)."""
        with self._cond:
            self._closed = True
            self._states.clear()
            self._extras.clear()
            self._pins.clear()
            self._cond.notify_all()

    # -- internals -------------------------------------------------------------------------

    def _drop_unless_pinned(self, version: int) -> None:
        if version >= 0 and not self._pins.get(version):
            self._states.pop(version, None)
            self._extras.pop(version, None)

    def _check(self) -> None:
        if self._error is not None:
            raise TransportError(
                f"receiver {self.member!r} stopped: {type(self._error).__name__}: {self._error}"
            ) from self._error
        if self._closed:
            raise TransportClosedError(f"receiver {self.member!r} is closed")
