"""Which rows a unit's failure lost: asked of the controller after a read or write failed.

Only the controller knows whether a storage unit died or restarted (and lost its rows): a
client whose read or write of some rows failed on a unit asks it (the ``lost`` message
kind) which of those rows were lost, to raise :class:`~transferqueue.errors.RowsLostError`
naming them instead of the unit's error.
"""

from __future__ import annotations

import asyncio

import numpy as np

from transferqueue.client.links import ControllerLink
from transferqueue.errors import PeerGoneError, UnknownRowError
from transferqueue.wire import messages as m

__all__ = ["LOST_WAIT_S", "lost_with_unit"]

LOST_WAIT_S = 6.0
"""How long a failed read or write asks the controller which rows were lost: the controller
may declare the unit dead a little after the client gave up on it, or be restarting itself
(then it is asked again until it answers)."""


async def lost_with_unit(
    controller: ControllerLink,
    indexes: np.ndarray,
    error: BaseException,
    units: list[int],
    *,
    raise_unreachable: bool = False,
) -> np.ndarray | None:
    """The rows of ``indexes`` lost with a unit, when ``error`` (of a unit) may be due to
    that; None when none is (then ``error`` stands). ``units``: those the read or write used.

    The controller may be restarting itself (both killed at once): it is asked again until
    it answers, for ``LOST_WAIT_S``. If it never does, the loss is unknown: with
    ``raise_unreachable`` that is a PeerGoneError (retry later), else None (the unit's error
    stands; a caller that must undo its rows first passes False). An UnknownRowError must not
    stand then: a read of rows the unit lost in a restart would pass for the caller's
    mistake."""
    if not isinstance(error, PeerGoneError | UnknownRowError):
        return None
    loop = asyncio.get_running_loop()
    give_up = loop.time() + LOST_WAIT_S  # (the controller unreachable)
    deadline = loop.time() + (LOST_WAIT_S if isinstance(error, PeerGoneError) else 0.0)
    while True:
        try:
            lost: np.ndarray = await controller.call(m.Lost(indexes=indexes, units=units))
        except PeerGoneError as gone:  # the controller is gone too, or restarting
            if loop.time() < give_up:
                await asyncio.sleep(0.25)
                continue
            if not raise_unreachable:
                return None
            raise PeerGoneError(
                f"rows {indexes[:5].tolist()} could not be read from units {units} "
                f"({type(error).__name__}: {error}), and whether a unit lost them in a "
                "restart cannot be known while the controller does not answer "
                f"({gone}); call again once it is back (a consumer: release the batch, "
                "or let its lease expire)"
            ) from error
        except Exception:  # the controller refused: the unit's error stands
            return None
        if lost.size:
            return lost
        if loop.time() >= deadline:
            return None
        await asyncio.sleep(0.25)
