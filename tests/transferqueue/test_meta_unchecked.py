"""``BatchMeta.unchecked`` (the controller's row table builds every get_meta's batch with
it) makes the same BatchMeta as the checked constructor, for the columns it is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from transferqueue.controller.core import Controller
from transferqueue.meta import BatchMeta
from transferqueue.schema import FieldSpec


def _same(a: BatchMeta, b: BatchMeta) -> None:
    for f in dataclasses.fields(BatchMeta):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_unchecked_equals_the_constructor_for_the_row_tables_columns() -> None:
    idx = np.arange(5, 9, dtype=np.int64)
    cols = (idx, np.array([0, 1, 0, 1], np.int32), idx * 2, np.zeros(4, np.int64), idx + 1)
    kw = {"fields": ("x",), "task": "t", "lease_id": 7, "lease_s": 3.0, "reason": "full"}
    _same(BatchMeta.unchecked(*cols, "p", **kw), BatchMeta(*cols, "p", **kw))
    _same(BatchMeta.unchecked(*cols, "p"), BatchMeta(*cols, "p"))  # (the defaults)
    with pytest.raises(TypeError, match="lease"):  # (a misspelt field, as the constructor)
        BatchMeta.unchecked(*cols, "p", lease=7)


def test_the_controllers_batches_are_valid_batch_metas() -> None:
    ctl = Controller(2, replicas=2)
    ctl.rows.register_fields({"x": FieldSpec.dense("int64")}, "p")
    put = ctl.writes.allocate(8, "p", groups=np.arange(8))
    ctl.writes.commit(put.indexes, ["x"])
    meta, _ = ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=8, lease_s=5.0)
    assert meta is not None
    checked = BatchMeta(  # (converts a column of another dtype, which _same then sees)
        **{f.name: getattr(meta, f.name) for f in dataclasses.fields(BatchMeta) if f.init}
    )
    _same(meta, checked)
    assert meta.replica_units is not None and meta.replica_units.dtype == np.int32
