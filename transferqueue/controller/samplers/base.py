"""The sampler seam: which ready rows a task's next batch gets.

A sampler is owned by one consumer task. The controller tells it, incrementally, which rows
became ready for the task (``add``), asks how many it could hand out (``available``) and takes
a batch (``sample``). It never scans all rows: each call costs O(rows added or taken), so a
``get_meta`` costs O(batch) however many rows the system holds.

Samplers hold global row indexes and read header columns (group, version, length) through a
:class:`HeaderView`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from transferqueue.limits import MAX_ROWS

__all__ = ["HeaderView", "Sampler", "Selection"]


class HeaderView(Protocol):
    """Read access to row headers, by global index (vectorized)."""

    def groups(self, indexes: np.ndarray) -> np.ndarray: ...

    def versions(self, indexes: np.ndarray) -> np.ndarray: ...

    def lengths(self, indexes: np.ndarray) -> np.ndarray: ...


@dataclass
class Selection:
    """What a sampler hands out: row indexes, and optionally a split across ranks."""

    indexes: np.ndarray  # int64 [B]
    splits: list[np.ndarray] | None = None  # positions into indexes, one array per rank


class Sampler(ABC):
    """Chooses rows for one task. Subclasses register with ``@register_sampler("name")``."""

    name: ClassVar[str] = ""
    supports_max_group = False
    """Whether ``sample``/``available`` honour a ``max_group`` bound (see the group sampler)."""

    def __init__(self, header: HeaderView, **options: Any) -> None:
        if options:
            raise TypeError(
                f"sampler {self.name!r} takes no options {sorted(options)}; "
                "check the sampler name and its documented options"
            )
        self.header = header

    @abstractmethod
    def add(self, indexes: np.ndarray, *, returned: bool = False) -> None:
        """Rows became ready for the task (ascending index order), or came back from an
        expired or released lease (``returned=True``: they go before newer rows)."""

    @abstractmethod
    def available(self, max_group: int | None = None) -> int:
        """Rows a ``sample`` with a large enough ``batch_size`` would hand out now."""

    @abstractmethod
    def sample(self, batch_size: int, max_group: int | None = None) -> Selection:
        """Take up to ``batch_size`` rows (fewer only when fewer are available); with
        ``max_group``, only rows of groups with id <= max_group (if supported)."""

    @abstractmethod
    def drop_below(self, min_version: int) -> np.ndarray:
        """Remove and return queued rows whose version is below ``min_version``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every queued row."""

    def queued(self) -> np.ndarray | None:
        """The queued rows in the order ``sample`` would hand them out, or None when the
        sampler cannot say (a save then records index order; see
        :mod:`transferqueue.controller.snapshot`). Called when a snapshot of the controller is
        taken; it changes nothing."""
        return None

    def held(self) -> int:
        """Rows it holds, whether ``sample`` could hand them out now or not (a group
        sampler's incomplete groups too): the controller's end-of-stream count."""
        return self.available()

    def batch_rows(self, batch_size: int) -> int:
        """Rows in a full batch of ``batch_size`` (a group sampler rounds down to groups)."""
        return batch_size

    def check_batch_size(self, batch_size: int) -> None:
        """Raise ValueError when ``batch_size`` cannot work with this sampler."""
        if not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_ROWS:
            raise ValueError(f"batch_size must be 1..{MAX_ROWS}, got {batch_size!r}")
