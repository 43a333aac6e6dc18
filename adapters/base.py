"""The adapter seam: one engine role as a producer-consumer stage of TransferQueue.

An adapter declares which fields it consumes and produces and converts between columns and
engine calls. The stage runner (``asyncflow.stage_runner``) does the rest: it leases a batch of rows
whose input fields are ready, reads them, calls :meth:`Adapter.process`, and writes the output
columns back onto the same rows, which acknowledges the lease.

Plugging a custom engine means implementing one engine Protocol (``engines.protocols``) and
handing it to the matching adapter, or subclassing an adapter and overriding ``process``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transferqueue import BatchMeta
from transferqueue.schema import Column

__all__ = ["Adapter", "StageOutput"]


@dataclass
class StageOutput:
    """What one processed batch gives back."""

    columns: dict[str, Any] = field(default_factory=dict)
    """Fields to write onto the batch's rows (empty: nothing to write, just acknowledge)."""
    version: np.ndarray | int | None = None
    """New ``version`` headers of the rows (the rollout sets the generating policy version)."""
    length: np.ndarray | int | None = None
    """New ``length`` headers (prompt + response tokens), for length-aware scheduling."""
    tokens: int = 0
    """Tokens this batch processed, for tokens/s accounting."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalars to log for this batch."""
    lane: str | None = None
    """Where the batch ran (e.g. the engine instance); the timeline records it per lane."""
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    """Where the batch ran when it ran in several places in turn: ``(lane, start, end)``
    (``time.perf_counter`` seconds) per part; the timeline records these instead of ``lane``
    (samples and tokens on the last part)."""


class Adapter(ABC):
    """One engine role as a stage. Subclasses set the class attributes and ``process``."""

    task: str = ""
    """TransferQueue consumer task name (one per role; several instances may share it)."""
    input_fields: tuple[str, ...] = ()
    output_fields: tuple[str, ...] = ()
    sampler: str = "fifo"
    sampler_options: dict[str, Any] = {}  # noqa: RUF012 - read-only default, replaced per instance
    batch_size: int = 1
    """Rows per batch (see ``request`` for per-call overrides)."""
    read_fields: tuple[str, ...] | None = None
    """Fields the stage runner reads for the whole batch before :meth:`process` (None: every
    input field). An adapter that has parts of a batch read elsewhere (data-parallel ranks
    each reading their share) names only what it needs of the whole batch."""

    def request(self) -> dict[str, Any]:
        """Arguments of the next ``get_meta`` (``batch_size``, and e.g. ``max_group``)."""
        return {"batch_size": self.batch_size}

    @abstractmethod
    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        """Run the engine on one batch; must not block the event loop (use threads)."""

    holds_leases: bool = False
    """The stage runner acknowledges a batch without output columns only once :meth:`settled`
    (checked after :meth:`after_batch`), not after :meth:`process`: a unit of work that spans
    batches (a train step) keeps all its rows leased until it is complete and reported, so a
    process that dies mid-unit gives every row of it back (``asyncflow.deploy.ray_ranks``)."""

    def settled(self) -> bool:
        """Whether the batches processed so far form complete units (``holds_leases``)."""
        return True

    async def after_batch(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Called by the stage runner once a processed batch is written and recorded (e.g. to
        report a finished step with that batch's time included)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release the engine's resources (called once when the stage stops)."""
