"""``BatchMeta``: the handle of a batch of rows, without their payload.

``get_meta`` and ``put`` return one. It names the rows (global indexes), where each row is
stored (unit ids), their headers, and, for a batch handed to a consumer task, the lease that
must be acknowledged. Columns (numpy, one entry per row)::

    indexes   int64   global row index
    units     int32   storage unit holding the row's payload
    groups    int64   group id (e.g. the prompt shared by the n responses of a GRPO group)
    versions  int64   policy version that produced the row (-1: none)
    lengths   int64   length hint for balancing (-1: unknown)

and, from a service keeping two copies of each row (``replicas=2``), ``replica_units``
(int32, the unit of each row's second copy, -1: none left); None otherwise.

It goes on the wire as it is (its fields are its schema, see :mod:`transferqueue.wire.messages`);
``__post_init__`` checks what a decoded one holds.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["REASONS", "BatchMeta", "balance_lengths"]

REASONS = ("full", "timeout", "drain", "end", "put")
"""Why a batch has the size it has:

- ``full``: ``batch_size`` rows (a group sampler: as many whole groups as fit);
- ``timeout``: the wait ran out (short or empty);
- ``drain``: the partition is finished and these are the last queued rows (short), but other
  consumers of the task still hold leases whose rows may come back: keep asking;
- ``end``: the partition is finished and, after this batch, the task has nothing more to
  receive (short or empty): stop;
- ``put``: returned by ``put``, not a consumer batch."""

_COLUMNS = ("indexes", "units", "groups", "versions", "lengths")


def balance_lengths(lengths: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split positions ``0..n-1`` into ``parts`` lists of n//parts or n//parts+1 positions,
    greedily giving the longest remaining row to the lightest part that still has room.

    Returns position arrays in ascending order. Unknown lengths (< 0) count as 1.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = int(lengths.size)
    lens = np.where(lengths < 0, 1, lengths).astype(np.int64)
    cap = [n // parts + (1 if r < n % parts else 0) for r in range(parts)]
    heap = [(0, r) for r in range(parts)]  # (total, rank) of parts with room left
    out: list[list[int]] = [[] for _ in range(parts)]
    for pos in np.argsort(-lens, kind="stable").tolist():
        total, r = heapq.heappop(heap)
        out[r].append(pos)
        if len(out[r]) < cap[r]:
            heapq.heappush(heap, (total + int(lens[pos]), r))
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in out]


@dataclass(eq=False)
class BatchMeta:
    """Rows of one partition, optionally leased to a consumer task."""

    indexes: np.ndarray
    units: np.ndarray
    groups: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    partition: str
    fields: tuple[str, ...] = ()
    task: str | None = None
    lease_id: int | None = None
    lease_s: float | None = None
    reason: str = "put"
    splits: list[np.ndarray] | None = None
    acked: bool = field(default=False, repr=False)
    grants: dict[int, bytes] | None = field(default=None, repr=False)
    """Of new rows (``put``): per unit, the controller's grant to create them there."""
    replica_units: np.ndarray | None = field(default=None, repr=False)
    """Per row, the unit holding its second copy (-1: none); None: one copy is kept."""

    def __post_init__(self) -> None:
        n = self.indexes.size
        for name in _COLUMNS:
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.shape != (n,) or arr.dtype.kind not in "iu":
                got = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else repr(arr)
                raise ValueError(f"BatchMeta.{name} is {got:.60}, expected ({n},) integers")
            want = np.int32 if name == "units" else np.int64
            if arr.dtype != want:
                setattr(self, name, arr.astype(want))
        rep = self.replica_units
        if rep is not None:
            if not isinstance(rep, np.ndarray) or rep.shape != (n,) or rep.dtype.kind not in "iu":
                got = f"{rep.dtype} {rep.shape}" if isinstance(rep, np.ndarray) else repr(rep)
                raise ValueError(f"BatchMeta.replica_units is {got:.60}, expected ({n},) integers")
            if rep.dtype != np.int32:
                self.replica_units = rep.astype(np.int32)
        if self.reason not in REASONS:
            raise ValueError(f"BatchMeta.reason must be one of {REASONS}, got {self.reason!r}")

    def __len__(self) -> int:
        return int(self.indexes.size)

    def __repr__(self) -> str:
        lease = f", lease={self.lease_id}" if self.lease_id is not None else ""
        task = f", task={self.task!r}" if self.task else ""
        return (
            f"BatchMeta(rows={len(self)}, partition={self.partition!r}{task}{lease}, "
            f"reason={self.reason!r}, fields={list(self.fields)})"
        )

    @classmethod
    def unchecked(
        cls,
        indexes: np.ndarray,
        units: np.ndarray,
        groups: np.ndarray,
        versions: np.ndarray,
        lengths: np.ndarray,
        partition: str,
        **kw: Any,
    ) -> BatchMeta:
        """A BatchMeta built without :meth:`__post_init__`'s checks, from columns that have
        the shapes and dtypes it would make them (int32 ``units`` and ``replica_units``,
        int64 others) and a valid ``reason``: the controller's own row table, whose header
        columns have those dtypes, on the path of every ``get_meta`` (the checks took about
        a tenth of a ``poll``'s in-process time). Anything else goes through the
        constructor. ``kw`` names optional fields only, as the constructor's would."""
        if not kw.keys() <= _DEFAULTS.keys():
            unknown = sorted(kw.keys() - _DEFAULTS.keys())
            raise TypeError(f"BatchMeta has no optional field(s) {unknown}")
        meta = cls.__new__(cls)
        meta.__dict__.update(_DEFAULTS)
        meta.__dict__.update(kw)
        meta.indexes, meta.units, meta.groups = indexes, units, groups
        meta.versions, meta.lengths, meta.partition = versions, lengths, partition
        return meta

    @classmethod
    def empty(cls, partition: str, **kw: Any) -> BatchMeta:
        z = np.empty(0, dtype=np.int64)
        return cls(z, z.astype(np.int32), z, z, z, partition, **kw)

    @property
    def is_end(self) -> bool:
        """True when the task's stream is over: once this batch (if any) is acknowledged,
        nothing more will be handed out. A batch whose lease runs out instead goes back to
        the task, so a consumer that did not acknowledge it must keep asking."""
        return self.reason == "end"

    def select(self, positions: np.ndarray | list[int]) -> BatchMeta:
        """A sub-batch (same lease): acknowledging it acknowledges only these rows (of an
        acknowledged batch: acknowledged already)."""
        pos = np.asarray(positions, dtype=np.int64)
        return BatchMeta(
            self.indexes[pos],
            self.units[pos],
            self.groups[pos],
            self.versions[pos],
            self.lengths[pos],
            partition=self.partition,
            fields=self.fields,
            task=self.task,
            lease_id=self.lease_id,
            lease_s=self.lease_s,
            reason=self.reason,
            acked=self.acked,
            replica_units=None if self.replica_units is None else self.replica_units[pos],
        )

    def split(self, parts: int | None = None) -> list[BatchMeta]:
        """Split across data-parallel ranks.

        Uses the sampler's split when the batch came from the ``balanced`` sampler; otherwise
        balances the ``lengths`` headers (equal row counts ±1) into ``parts`` sub-batches.
        """
        if self.splits is not None and (parts is None or parts == len(self.splits)):
            return [self.select(p) for p in self.splits]
        if parts is None:
            raise ValueError("split() needs parts= unless the batch came with a split")
        return [self.select(p) for p in balance_lengths(self.lengths, parts)]


_DEFAULTS: dict[str, Any] = {
    f.name: f.default for f in dataclasses.fields(BatchMeta) if f.default is not dataclasses.MISSING
}
"""The optional fields' defaults, which :meth:`BatchMeta.unchecked` sets (none has a factory)."""
if len(_DEFAULTS) != len(dataclasses.fields(BatchMeta)) - len(_COLUMNS) - 1:
    raise AssertionError("a BatchMeta field has a default factory: BatchMeta.unchecked needs it")
