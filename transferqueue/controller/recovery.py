"""A restarted controller meets its storage units again (``state_dir``, see
:mod:`transferqueue.controller.journaled`).

The controller recovered its rows from its snapshot and log; the units went on meanwhile,
and one may have restarted (empty) or hold rows the controller never heard of. Before the
restarted controller serves, :func:`reconcile` asks every unit for its inventory
(:class:`~transferqueue.wire.messages.UnitInventory`) and:

- discards the rows allocated and never committed (their puts failed with the old process:
  a late commit learns they were lost, see
  :meth:`~transferqueue.controller.health.UnitHealth.reclaim_uncommitted`);
- loses the rows a unit should hold and does not (it restarted while the controller was
  down): as when a unit dies (:meth:`~transferqueue.controller.health.UnitHealth.lose_rows`), the
  rows leave their tasks and are counted lost;
- frees on a unit the rows the controller does not know (discarded above, freed by the old
  process in a request that never arrived, or written under a grant it gave just before it
  died);
- never hands out an index a unit holds: new rows start above every unit's highest;
- forgets the copies under way (re-replication, :mod:`transferqueue.controller.rereplicate`): the
  rows they wrote are unknown rows on their target, freed as above; the rows are planned
  again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transferqueue.controller.journaled import JournaledController
from transferqueue.controller.service import ControllerService
from transferqueue.wire import messages as m
from transferqueue.wire.rpc import RpcClient

__all__ = ["Reconciled", "reconcile"]

log = logging.getLogger(__name__)


@dataclass
class Reconciled:
    """What a restarted controller changed to agree with its units."""

    reclaimed: int = 0  # rows allocated and never committed, discarded
    lost: int = 0  # rows a unit no longer had
    freed: int = 0  # rows on units the controller did not know, freed there


async def reconcile(
    service: ControllerService, units: Sequence[RpcClient], *, wait_s: float
) -> Reconciled:
    """Make the recovered controller of ``service`` and the live ``units`` agree (see the
    module). Called by the controller's server before it serves."""
    ctl = service.controller
    if not isinstance(ctl, JournaledController):
        raise TypeError("reconcile needs the journaled controller of a restarted service")
    alive = ctl.placement.alive
    asked = [u for u in range(len(units)) if alive[u]]
    held = await asyncio.gather(*(units[u].call(m.UnitInventory(), wait_s=wait_s) for u in asked))
    out = Reconciled()
    before = ctl.health.rows_reclaimed
    ctl.health.reclaim_uncommitted()  # (its frees are not sent: the inventories name those rows)
    ctl.copies.abandon_copies()  # (copies the old process made are freed below: none names them)
    out.reclaimed = ctl.health.rows_reclaimed - before
    h = ctl.rows.header
    for u, rows in zip(asked, held, strict=True):
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size:
            ctl.rows.advance_index(int(rows.max()) + 1)
        live = np.flatnonzero(h["live"])
        known = h["index"][live[(h["unit"][live] == u) | (h["replica"][live] == u)]]
        missing = known[~np.isin(known, rows)]
        if missing.size:
            service.lose_rows(u, missing)
            out.lost += int(missing.size)
        extra = rows[~np.isin(rows, known)]
        if extra.size:
            await units[u].call(m.Free(indexes=extra), wait_s=wait_s)
            out.freed += int(extra.size)
    log.warning(
        "controller recovered: %d rows live; %d uncommitted rows discarded, %d rows lost "
        "with units that restarted meanwhile, %d unknown rows freed on units",
        ctl.rows.live,
        out.reclaimed,
        out.lost,
        out.freed,
    )
    return out
