"""The client calls of :mod:`transferqueue.controller.status`: status queries and custom
metadata; of :mod:`transferqueue.controller.queues`: consumption resets; and of
:mod:`transferqueue.controller.retire`: loss logs and retiring groups. ``StatusCalls`` is a
part of :class:`~transferqueue.client.async_client.AsyncClient`, which (and the blocking
``Client``) offers its calls; each sends one controller message kind and works unchanged over
every deployment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from transferqueue.client.links import ControllerLink
from transferqueue.errors import BadRequestError
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.wire import messages as m
from transferqueue.wire.checks import encode_meta
from transferqueue.wire.replies import LostRows, PartitionStatus, Retired

__all__ = ["StatusCalls"]

Indexes = BatchMeta | np.ndarray | Sequence[int]
"""Rows named by a ``BatchMeta`` (of ``put`` or ``get_meta``) or by their global indexes."""


def _indexes(rows: Indexes) -> np.ndarray:
    if isinstance(rows, BatchMeta):
        return rows.indexes
    arr = np.asarray(rows)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise BadRequestError(
            f"indexes must be a BatchMeta or a 1-D sequence of row indexes, got "
            f"{arr.dtype} of shape {arr.shape}"
        )
    return arr.astype(np.int64, copy=False)


class StatusCalls:
    """``status``, ``reset_consumption``, ``set_custom_meta``, ``get_custom_meta``,
    ``lost_rows``, ``retire_groups``, ``claim``."""

    def __init__(self, io: LoopThread, controller: ControllerLink) -> None:
        self._io = io
        self._ctl = controller

    async def status(
        self,
        partition: str = "default",
        *,
        fields: Sequence[str] | None = None,
        task: str | None = None,
        meta: bool = False,
    ) -> PartitionStatus:
        """The live rows of ``partition`` (put, not yet freed or cleared), in index order.

        With ``fields``: per field, a bool array saying which rows have it written
        (production status). With ``task``: ``states``, the task's state of each row, a code
        of :data:`~transferqueue.controller.status.STATES` (``waiting``, ``queued``, ``leased``,
        ``done``; ``rows("done")`` lists the rows it consumed). An unknown partition, field
        or task is an error naming the known ones. With ``meta``: ``meta``, the same rows as
        a ``BatchMeta`` that leases nothing, for ``get_data`` of rows whatever their state
        (no task's consumption changes).
        """
        msg = m.Status(
            partition=partition,
            fields=None if fields is None else list(fields),
            task=task,
            meta=meta,
        )
        return await self._io.run_async(self._ctl.call(msg))

    async def reset_consumption(self, task: str, partition: str = "default") -> int:
        """Replay ``partition`` to ``task``: every live row the task leased or consumed goes
        back to its queue and is handed out once more, once. The task's open leases on the
        partition close first: acking (or putting with) one of them afterwards raises
        :class:`~transferqueue.errors.UnknownLeaseError` and consumes nothing. Rows already
        freed (every declared task acknowledged them) are gone; see
        :mod:`transferqueue.controller.status`. Other tasks are untouched. Returns the rows given
        back.
        """
        msg = m.ResetConsumption(partition=partition, task=task)
        return await self._io.run_async(self._ctl.call(msg))

    async def set_custom_meta(self, indexes: Indexes, metas: Sequence[Mapping[str, Any]]) -> None:
        """Attach a small dict of msgpack values to each row (one per index; ``{}`` removes
        a row's), kept without payload until the row is freed or cleared. At most
        ``MAX_META_BYTES`` per row as msgpack (:mod:`transferqueue.limits`); larger is a
        :class:`~transferqueue.errors.BadRequestError` naming the limit."""
        rows = _indexes(indexes)
        if isinstance(metas, Mapping) or len(metas) != rows.size:
            got = "a single dict" if isinstance(metas, Mapping) else f"{len(metas)} metas"
            raise BadRequestError(f"set_custom_meta: {rows.size} rows but {got}; one per row")
        raw = [
            encode_meta(dict(d) if isinstance(d, Mapping) else d, f"metas[{i}]")
            for i, d in enumerate(metas)
        ]
        msg = m.SetCustomMeta(indexes=rows, metas=raw)
        await self._io.run_async(self._ctl.call(msg))

    async def get_custom_meta(self, indexes: Indexes) -> list[dict[str, Any]]:
        """The custom metadata of each row (``{}`` where none was set), fresh dicts."""
        msg = m.GetCustomMeta(indexes=_indexes(indexes))
        raw = await self._io.run_async(self._ctl.call(msg))
        return [msgspec.msgpack.decode(r) for r in raw]

    async def lost_rows(self, task: str, partition: str = "default", after: int = 0) -> LostRows:
        """Rows of ``partition`` lost with a dead storage unit before ``task`` consumed them,
        with their group ids, logged after cursor ``after`` (0: from the start); pass the
        reply's ``next`` next time. A row the task held leased counts only if the lease ended
        unacknowledged: an acked batch was consumed. ``missed`` > 0: rows the log no longer
        holds (the reader fell more than ``LOSS_LOG_ROWS`` behind). See
        :mod:`transferqueue.controller.retire`."""
        msg = m.GetLostRows(partition=partition, task=task, after=after)
        return await self._io.run_async(self._ctl.call(msg))

    async def retire_groups(
        self,
        groups: Sequence[int] | np.ndarray,
        partition: str = "default",
        *,
        unless_leased_by: str | None = None,
    ) -> Retired:
        """Free every live row of ``groups`` (in every task's queue and lease) so that they
        can be put again whole; late writes to them raise ``RowsLostError``. Groups a row of
        which task ``unless_leased_by`` holds leased are left alone and returned in ``busy``
        (ask again once that lease ends). See :mod:`transferqueue.controller.retire`."""
        arr = np.asarray(groups, dtype=np.int64).reshape(-1)
        msg = m.RetireGroups(partition=partition, groups=arr, unless_leased_by=unless_leased_by)
        return await self._io.run_async(self._ctl.call(msg))

    async def claim(
        self, name: str, indexes: Indexes | None = None, *, partition: str = "default"
    ) -> BatchMeta:
        """Bind ``name`` to the rows ``indexes`` unless it is bound already, atomically on
        the controller; returns the rows ``name`` is bound to (without ``indexes``: a lookup,
        an empty batch when unbound). For consumers that must share one batch (the ranks of
        a data-parallel group): each takes a batch (``get_meta``), claims it under a name they
        agree on, and releases its own batch if the claim returns other rows. The batch
        returned holds no lease (read it with ``get_data``). See
        :mod:`transferqueue.controller.claims`."""
        rows = None if indexes is None else _indexes(indexes)
        msg = m.Claim(partition=partition, name=name, indexes=rows)
        return await self._io.run_async(self._ctl.call(msg))
