"""``FusedAdapter``: two stages as one; the second sees the first's output as TransferQueue
would give it, the fused stage reads what the second needs from TransferQueue and writes
both outputs; stages that cannot be fused are refused, naming them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from adapters import Adapter, FusedAdapter, StageOutput
from transferqueue import BatchMeta
from transferqueue.schema import Column


class _Double(Adapter):
    task = "first"
    input_fields = ("x",)
    output_fields = ("y",)
    batch_size = 4

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        x = cols["x"]
        assert isinstance(x, torch.Tensor)
        return StageOutput(columns={"y": x * 2}, version=np.arange(len(x)), metrics={"a": 1.0})


class _Sum(Adapter):
    task = "second"
    input_fields = ("y", "z")
    output_fields = ("s",)
    seen: dict[str, Column] = {}  # noqa: RUF012 - the test reads what the last call saw

    async def process(self, meta: BatchMeta, cols: dict[str, Column]) -> StageOutput:
        type(self).seen = dict(cols)
        y, z = cols["y"], cols["z"]
        assert isinstance(y, torch.Tensor) and isinstance(z, torch.Tensor)
        return StageOutput(columns={"s": y + z}, metrics={"b": 2.0})


class _Holding(_Sum):
    holds_leases = True


def test_the_second_stage_scores_the_first_ones_output_and_both_are_written() -> None:
    fused = FusedAdapter(_Double(), _Sum())
    assert fused.task == "first" and fused.batch_size == 4
    assert fused.input_fields == ("x", "z")  # z: the second's own input, read with the first's
    assert fused.output_fields == ("y", "s")
    meta = BatchMeta.empty("train")
    x, z = torch.tensor([1, 2, 3]), torch.tensor([10, 20, 30])
    out = asyncio.run(fused.process(meta, {"x": x, "z": z}))
    assert torch.equal(out.columns["y"], x * 2) and torch.equal(out.columns["s"], x * 2 + z)
    assert set(_Sum.seen) == {"y", "z"}  # exactly its inputs
    assert out.version is not None and list(out.version) == [0, 1, 2]  # the first's headers
    assert out.metrics == {"a": 1.0, "b": 2.0}


def test_stages_that_hold_leases_or_write_the_same_field_are_refused() -> None:
    with pytest.raises(ValueError, match="'second' stage holds its leases"):
        FusedAdapter(_Double(), _Holding())
    with pytest.raises(ValueError, match=r"'first' and 'first' both write \['y'\]"):
        FusedAdapter(_Double(), _Double())
