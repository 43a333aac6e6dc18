"""``balanced``: a batch split across data-parallel ranks with balanced token totals.

Long-tail generation makes a plain split leave ranks waiting on the one that got the longest
sequences. This sampler takes a batch like ``fifo`` (or like ``group`` when ``group_size`` is
given, with ``group``'s options: ``order``, ``window``, and ``max_group`` on ``get_meta``), then
splits it into ``dp_size`` parts of equal row count (±1) whose summed ``length``
headers are as even as a greedy longest-first assignment makes them. The split travels with the
batch: ``meta.split()`` returns one part per rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transferqueue.controller.samplers.base import HeaderView, Sampler, Selection
from transferqueue.controller.samplers.fifo import FifoSampler
from transferqueue.controller.samplers.group import GroupSampler
from transferqueue.controller.samplers.registry import register_sampler
from transferqueue.meta import balance_lengths

__all__ = ["BalancedSampler"]


@register_sampler("balanced")
class BalancedSampler(Sampler):
    """A fifo (or whole-group) batch, split into ``dp_size`` length-balanced parts."""

    def __init__(
        self,
        header: HeaderView,
        *,
        dp_size: int,
        group_size: int | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(dp_size, int) or dp_size < 1:
            raise ValueError(f"balanced sampler needs dp_size >= 1, got {dp_size!r}")
        self.dp_size = dp_size
        # the options are the base sampler's (it rejects what it does not take)
        self._base: Sampler = (
            FifoSampler(header, **options)
            if group_size is None
            else GroupSampler(header, group_size=group_size, **options)
        )
        super().__init__(header)
        self.supports_max_group = self._base.supports_max_group

    def add(self, indexes: np.ndarray, *, returned: bool = False) -> None:
        self._base.add(indexes, returned=returned)

    def available(self, max_group: int | None = None) -> int:
        return self._base.available(max_group)

    def held(self) -> int:
        return self._base.held()

    def batch_rows(self, batch_size: int) -> int:
        return self._base.batch_rows(batch_size)

    def check_batch_size(self, batch_size: int) -> None:
        self._base.check_batch_size(batch_size)
        if batch_size < self.dp_size:
            raise ValueError(
                f"batch_size {batch_size} is smaller than dp_size {self.dp_size}: "
                "every rank needs at least one row"
            )

    def sample(self, batch_size: int, max_group: int | None = None) -> Selection:
        sel = self._base.sample(batch_size, max_group)
        parts = balance_lengths(self.header.lengths(sel.indexes), self.dp_size)
        return Selection(sel.indexes, parts)

    def drop_below(self, min_version: int) -> np.ndarray:
        return self._base.drop_below(min_version)

    def queued(self) -> np.ndarray | None:
        return self._base.queued()

    def clear(self) -> None:
        self._base.clear()
