"""Claims: a name bound once to a batch of rows, for consumers that must share a batch.

A part of the controller core (:class:`~transferqueue.controller.core.Controller`). Several
processes that must receive the *same* rows (the ranks of one data-parallel group, each
pulling on its own) agree through one atomic create-if-absent on the controller:

- :meth:`Claims.claim` with ``indexes``: if ``name`` is unclaimed in the partition, bind it
  to those rows and return them; if it is claimed, return the rows it is bound to. The first
  caller wins; every later caller (before or after the winner's reply) gets the winner's rows;
- :meth:`Claims.claim` without ``indexes``: a lookup, the bound rows or an empty batch.

A caller that lost the race gives back the rows it had taken for its own claim (``release``
of its lease): the claim binds names, never leases or consumes anything itself::

    per partition   {name: int64 row indexes}   insertion order, at most MAX_CLAIMS names

Bounded: a partition keeps its latest ``MAX_CLAIMS`` names, the oldest dropped first (a
consumer that many batches behind its group claims anew); a cleared partition drops them
all. The reply is the rows' ``BatchMeta`` as the row table has them now; a claimed row freed
since is an :class:`~transferqueue.errors.UnknownRowError`. The ``claim`` message
(:mod:`transferqueue.wire.messages`) is answered from here; a journaled controller records
the calls that bind a name.
"""

from __future__ import annotations

import numpy as np

from transferqueue.controller.journal import Recorder, journaled_unless_same
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.rows import RowTable
from transferqueue.controller.state import PartitionState
from transferqueue.errors import BadRequestError
from transferqueue.limits import MAX_CLAIMS
from transferqueue.meta import BatchMeta

__all__ = ["Claims"]


def _bound(claims: Claims) -> int:
    return claims.bound


class Claims:
    """Names bound once to rows, per partition (see the module)."""

    recorder: Recorder | None = None  # (set by a journaled controller)

    def __init__(self, rows: RowTable, partitions: Partitions, limit: int = MAX_CLAIMS) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self._rows = rows
        self._partitions = partitions
        self._limit = limit
        self._names: dict[str, dict[str, np.ndarray]] = {}  # partition -> name -> indexes
        self.bound = 0  # names ever bound (a journal fingerprint: lookups change nothing)
        partitions.on_clear.append(self._drop)

    def count(self, partition: str) -> int:
        """The names a partition keeps."""
        return len(self._names.get(partition) or ())

    @journaled_unless_same(_bound)
    def claim(self, partition: str, name: str, indexes: np.ndarray | None = None) -> BatchMeta:
        """The rows ``name`` is bound to in ``partition``; an unclaimed ``name`` is bound to
        ``indexes`` first (None: only look; an empty batch when unclaimed)."""
        names = self._names.get(partition)
        got = None if names is None else names.get(name)
        if got is None and indexes is not None:
            got = np.asarray(indexes, dtype=np.int64).reshape(-1)
            if got.size == 0:
                raise BadRequestError(
                    f"claim {name!r}: indexes is empty; claim at least one row (or pass no "
                    "indexes to look the name up)"
                )
            self._rows.slots(got)  # (rows not live: UnknownRowError, nothing bound)
            if names is None:
                names = self._names[partition] = {}
            names[name] = got.copy()
            self.bound += 1
            if len(names) > self._limit:
                del names[next(iter(names))]  # (dicts keep insertion order: the oldest)
        if got is None:
            return self._rows.meta(np.empty(0, dtype=np.int64), partition)
        return self._rows.meta(self._rows.slots(got), partition)

    def _drop(self, part: PartitionState) -> None:
        self._names.pop(part.name, None)
