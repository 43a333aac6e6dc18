"""``Placement``: which storage units the rows of a put go to.

Part of the controller's state (it calls :meth:`Placement.place` from ``allocate`` and keeps
the live bytes per unit up to date as rows come and go); kept apart so that the controller
module holds the row bookkeeping and this one the placement policy.
"""

from __future__ import annotations

import numpy as np

from transferqueue.errors import PeerGoneError

__all__ = ["SPREAD_BYTES", "Placement"]

SPREAD_BYTES = 16 << 20
"""Bytes of a put per storage unit it spreads over (see :meth:`Placement.place`)."""
_MAX_PRODUCERS = 4096
"""Producers whose sticky unit the controller remembers (the least recently seen go)."""


class Placement:
    """Places puts on units, balancing the live payload the units hold."""

    def __init__(self, num_units: int, spread_bytes: int = SPREAD_BYTES) -> None:
        self.num_units = num_units
        self.spread_bytes = spread_bytes
        self._next_unit = 0
        # producer -> the unit of its small puts; in order of last use
        self._sticky: dict[str, int] = {}
        # bytes of the live rows on each unit, as their puts reported them
        self.unit_bytes = np.zeros(num_units, dtype=np.int64)
        # units that serve (a unit that died takes no rows until it is back)
        self.alive = np.ones(num_units, dtype=bool)
        self._live = np.arange(num_units, dtype=np.int32)

    def set_alive(self, unit: int, alive: bool) -> None:
        self.alive[unit] = alive
        self._live = np.flatnonzero(self.alive).astype(np.int32)

    def add_bytes(self, units: np.ndarray, nbytes: np.ndarray) -> None:
        """Rows on ``units`` came (``nbytes`` > 0) or went (< 0)."""
        self.unit_bytes += np.bincount(units, weights=nbytes, minlength=self.num_units).astype(
            np.int64
        )

    def place(self, n: int, nbytes: int | None = None, producer: str | None = None) -> np.ndarray:
        """Balanced contiguous chunks over as many units as the payload is worth.

        A put of ``nbytes`` spreads over ``nbytes // spread_bytes`` units (at least one, at
        most all): a unit's share of a large put moves in parallel with the others', while a
        small put costs one round trip to one unit instead of one per unit (on a loopback or
        a fast network, a few MB are cheaper in one message than in four). Without ``nbytes``
        every put spreads over all units.

        Small (one-unit) puts of a named ``producer`` are sticky: they go to the unit its
        last one went to while that unit holds less than ``spread_bytes`` more live payload
        than the least loaded unit, and otherwise to the least loaded unit. So memory stays
        balanced (for sticky puts, the units' live bytes differ by less than three
        ``spread_bytes``), and a producer whose rows are consumed as fast as they come keeps
        writing where the client's and the unit's buffers are warm in the caches. Measured
        on one host, 4.4 MB put+get cycles over 4 units: 8.0 ms when every put went to the
        next unit, 6.2-6.5 ms when a producer moved on after every ``spread_bytes`` of puts,
        5.1-5.2 ms staying on one unit (5.2-5.4 ms with a single unit). Producers start on
        different units. Puts without a producer, and larger puts, rotate their first unit
        by the units used.
        """
        live = self._live
        u = int(live.size)
        if u == 0:
            raise PeerGoneError(
                "no storage unit is alive to take new rows; the service restarts dead units "
                "(transferqueue serve): retry the put"
            )
        use = u
        if nbytes is not None and self.spread_bytes > 0:
            use = int(min(u, max(1, nbytes // self.spread_bytes)))
        if use == 1 and u > 1 and producer is not None and nbytes is not None:
            return np.full(n, self._sticky_unit(producer), dtype=np.int32)
        sizes = np.full(use, n // use, dtype=np.int64)
        sizes[: n % use] += 1
        order = (np.arange(use) + self._next_unit) % u
        step = use if use < u else max(n % u, 1 if n < u else 0)
        self._next_unit = (self._next_unit + step) % u
        return np.repeat(live[order], sizes)

    def _sticky_unit(self, producer: str) -> int:
        """The unit of ``producer``'s next small put (see :meth:`place`)."""
        sticky = self._sticky
        live = self._live
        unit = sticky.pop(producer, None)
        if unit is None or not self.alive[unit]:  # a new producer starts where the rotation is
            unit = int(live[self._next_unit % live.size])
            self._next_unit = (self._next_unit + 1) % live.size
        load = self.unit_bytes
        least = int(load[live].min())
        if int(load[unit]) - least >= self.spread_bytes:  # on to the least loaded live unit
            order = (np.arange(self.num_units) + unit + 1) % self.num_units
            order = order[self.alive[order]]
            unit = int(order[np.argmax(load[order] == least)])
        sticky[producer] = unit
        while len(sticky) > _MAX_PRODUCERS:  # forget the least recently seen producers
            del sticky[next(iter(sticky))]
        return unit
