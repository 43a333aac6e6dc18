"""``Holders``: which clients that hold leases are alive (liveness, never progress).

A lease is taken by a *holder*: one client handle, named ``name/token`` (a host and process,
or a stage host's name, and a token each handle draws). A connected handle sends an ``alive``
heartbeat every ``HOLDER_BEAT_S`` from its first ``get_meta`` on, on a thread of its own (so a
process busy in its own work still beats); the controller's timer asks this table which
holders of active leases went silent, and returns their rows (``Queues.return_holders``)::

    holder          last heard (clock)   beats
    host:412/9f3a   1031.2               yes     a connected handle
    host:412/77c1   1030.9               no      an in-process handle: only its close ends it

The rule: a holder that beats and has been silent for ``dead_after_s`` is gone, and so are
its leases; one that beats is never given up on, however long it holds a batch (a long
episode stays with the worker that is still working on it). An in-process holder (embedded)
never beats: its leases end by ack, deadline, or its handle's close. So rows of a dead holder
come back within ``dead_after_s`` plus the timer's tick (0.5 s) of its last beat.

After a controller restart (journaled state) this table starts empty: a holder of a restored
lease is first heard of at the restart and gets ``grace_s`` to beat again (its handle's
heartbeat thread goes on sending through the restart) before its leases are returned.

The controller's own stalls do not count as holders' silence: when the timer finds it was not
run for longer than ``dead_after_s / 2``, every holder is credited with the gap
(:meth:`stalled`). This is plain state with an injected clock; the service's timer calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from transferqueue.wire.liveness import DEFAULT_LIVENESS, HOLDER_BEAT_S

__all__ = ["HOLDER_BEAT_S", "HOLDER_DEAD_AFTER_S", "HOLDER_GRACE_S", "Holders"]

HOLDER_DEAD_AFTER_S = DEFAULT_LIVENESS.holder_dead_after_s
"""Silence of a beating holder after which its leases are returned (the controller's knob)."""
HOLDER_GRACE_S = DEFAULT_LIVENESS.holder_grace_s
"""How long a restarted controller waits for holders of restored leases to beat again."""

_FORGET_AFTER = 10  # a holder with no lease, silent this many dead_after_s, is forgotten


class Holders:
    """Last heartbeat of each holder (see the module)."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        dead_after_s: float = HOLDER_DEAD_AFTER_S,
        grace_s: float = HOLDER_GRACE_S,
    ) -> None:
        for name, value in (("dead_after_s", dead_after_s), ("grace_s", grace_s)):
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(
                    f"Holders {name} must be a positive number of seconds, got {value!r}"
                )
        if dead_after_s < 2 * HOLDER_BEAT_S:
            raise ValueError(
                f"holder_dead_after_s={dead_after_s} must be at least twice the holders' "
                f"heartbeat ({HOLDER_BEAT_S} s), or live holders would be declared gone"
            )
        self._clock = clock
        self.dead_after_s = float(dead_after_s)
        self.grace_s = float(grace_s)
        self._heard: dict[str, float] = {}
        self._beats: set[str] = set()
        self.holders_lost = 0  # holders gone with leases (silent, closed or replaced)

    def __len__(self) -> int:
        return len(self._beats)

    def beat(self, holder: str) -> None:
        """``holder`` sent its heartbeat: alive now, and watched from now on."""
        self._heard[holder] = self._clock()
        self._beats.add(holder)

    def seen(self, holder: str) -> None:
        """``holder`` took a lease (a ``get_meta``): alive now."""
        self._heard[holder] = self._clock()

    def gone(self, holder: str) -> None:
        """``holder`` is gone for good (its leases are being returned): forget it."""
        self._heard.pop(holder, None)
        self._beats.discard(holder)

    def stalled(self, gap_s: float) -> None:
        """The controller itself did not look for ``gap_s`` seconds: credit every holder."""
        for holder in self._heard:
            self._heard[holder] += gap_s

    def silent(self, held: Iterable[str]) -> list[str]:
        """The holders among ``held`` (those of active leases) that are gone by the rule.
        One never heard of (a lease restored by a restart) is heard of now, with
        ``grace_s`` to beat."""
        now = self._clock()
        held = set(held)
        out = []
        for holder in held:
            heard = self._heard.get(holder)
            if heard is None:
                self._heard[holder] = now + self.grace_s - self.dead_after_s
                self._beats.add(holder)
            elif holder in self._beats and now - heard > self.dead_after_s:
                out.append(holder)
        forget = now - _FORGET_AFTER * self.dead_after_s
        for holder in [h for h, t in self._heard.items() if t < forget and h not in held]:
            del self._heard[holder]
            self._beats.discard(holder)
        return sorted(out)

    @staticmethod
    def named(holders: Iterable[str], name: str, keep: str | None = None) -> list[str]:
        """The holders called ``name`` (``name/token``) other than ``keep``."""
        return [h for h in holders if h.rpartition("/")[0] == name and h != keep]
