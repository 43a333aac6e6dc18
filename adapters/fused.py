"""``FusedAdapter``: two adjacent stages of the graph run as one, in one process.

The rollout and a cheap reward (a rule-based function) are two stages that hand every batch
over through TransferQueue: the rollout puts its samples, the reward stage leases them, reads
them back, scores them and puts the rewards. Fused (``reward.colocate``), the reward adapter
runs on the rollout's output the moment a batch is generated, in the rollout's process, and
the batch is put once with both stages' columns:

| consumes                                  | produces                                    |
|-------------------------------------------|---------------------------------------------|
| the first's inputs, and the second's      | both stages' outputs, in one put            |
| inputs that the first does not produce    | (the first's row headers: version, length)  |

The graph does not change: the same columns reach the train stage, each row once, with the
same headers; only the second stage's consumer task is gone (its rows are never leased by
it), so its work needs no lease, get or put of its own. Its metrics are the fused stage's.
Both adapters keep every check of their own (the second sees exactly the columns it would
read from TransferQueue: the first's outputs are the same objects and dtypes a read returns).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from adapters.base import Adapter, StageOutput
from transferqueue import BatchMeta
from transferqueue.schema import Column

__all__ = ["FusedAdapter"]


class FusedAdapter(Adapter):
    """``first`` then ``then`` on each batch: the stage ``first.task``, writing both outputs.

    Neither may hold its leases past its batch (``holds_leases``: the train stage), and the
    two must not write the same field."""

    def __init__(self, first: Adapter, then: Adapter) -> None:
        for a in (first, then):
            if a.holds_leases:
                raise ValueError(
                    f"FusedAdapter: the {a.task!r} stage holds its leases past a batch and "
                    "cannot be fused"
                )
        both = set(first.output_fields) & set(then.output_fields)
        if both:
            raise ValueError(
                f"FusedAdapter: {first.task!r} and {then.task!r} both write {sorted(both)}"
            )
        self.first, self.then = first, then
        self.task = first.task
        self.batch_size = first.batch_size
        self.sampler = first.sampler
        self.sampler_options = first.sampler_options
        own = set(first.input_fields) | set(first.output_fields)
        self._extra = tuple(f for f in then.input_fields if f not in own)
        """The second's inputs read from TransferQueue with the first's."""
        self.input_fields = (*first.input_fields, *self._extra)
        if first.read_fields is not None:
            self.read_fields = (*first.read_fields, *self._extra)
        self.output_fields = (*first.output_fields, *then.output_fields)

    def request(self) -> dict[str, Any]:
        return self.first.request()

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        out = await self.first.process(meta, cols)
        missing = [f for f in self.then.input_fields if f not in out.columns and f not in cols]
        if missing:
            raise RuntimeError(
                f"FusedAdapter: the {self.then.task!r} stage reads {missing}, which the "
                f"{self.first.task!r} stage did not write"
            )
        seen = {f: out.columns[f] if f in out.columns else cols[f] for f in self.then.input_fields}
        scored = await self.then.process(meta, seen)
        return replace(
            out,
            columns={**out.columns, **scored.columns},
            metrics={**out.metrics, **scored.metrics},
        )

    def settled(self) -> bool:
        return self.first.settled() and self.then.settled()

    async def after_batch(self) -> None:
        await self.first.after_batch()
        await self.then.after_batch()

    async def close(self) -> None:
        try:
            await self.first.close()
        finally:
            await self.then.close()
