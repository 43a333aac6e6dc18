"""Field specs are per partition: the same name may have another shape, dtype or kind in
another partition, a partition that holds no rows takes new specs, and a put that disagrees
with its partition's spec is a SchemaError that names the field, the partition and both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from transferqueue import Client, FieldSpec, Ragged, SchemaError, Shaped


def _x(n: int, width: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + n * width, dtype=torch.float32).reshape(n, width)


def test_same_field_other_shape_dtype_kind_in_other_partitions(client: Client) -> None:
    a = client.put({"x": _x(4, 2)}, partition="a")
    b = client.put({"x": _x(3, 5, 100.0)}, partition="b")
    c = client.put({"x": torch.arange(2, dtype=torch.int16)}, partition="c")
    d = client.put({"x": ["one", "two"]}, partition="d")
    r = client.put({"x": [torch.ones(3), torch.ones(1)]}, partition="r")
    assert torch.equal(client.get_data(a, ["x"])["x"], _x(4, 2))  # type: ignore[arg-type]
    assert torch.equal(client.get_data(b, ["x"])["x"], _x(3, 5, 100.0))  # type: ignore[arg-type]
    got_c = client.get_data(c, ["x"])["x"]
    assert isinstance(got_c, torch.Tensor) and got_c.dtype == torch.int16
    assert client.get_data(d, ["x"])["x"] == ["one", "two"]
    got_r = client.get_data(r, ["x"])["x"]
    assert isinstance(got_r, Ragged) and got_r.lengths.tolist() == [3, 1]
    assert client.specs("a")["x"] == FieldSpec.dense("float32", (2,))
    assert client.specs("b")["x"] == FieldSpec.dense("float32", (5,))
    assert client.specs("d")["x"] == FieldSpec.object()
    # every partition keeps serving its own rows through a task
    got = client.get_meta("t", ["x"], 3, partition="b", timeout_s=1)
    assert torch.equal(client.get_data(got)["x"], _x(3, 5, 100.0))  # type: ignore[arg-type]


def test_mixed_kinds_in_one_partition_refused_naming_field_partition_and_kinds(
    client: Client,
) -> None:
    meta = client.put({"x": _x(4, 2)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'.*dense float32 \[2\].*object") as e:
        client.put({"x": ["a", "b"]}, partition="p")
    assert "partition" in str(e.value)
    with pytest.raises(SchemaError, match=r"'x'.*'p'.*dense float32 \[2\].*\[3\]"):
        client.put({"x": _x(2, 3)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'"):
        client.kv_put("k", {"x": "text"}, partition="p")
    # nothing stored is lost and the store keeps serving
    assert torch.equal(client.get_data(meta, ["x"])["x"], _x(4, 2))  # type: ignore[arg-type]
    more = client.put({"x": _x(2, 2, 50.0)}, partition="p")
    assert torch.equal(client.get_data(more, ["x"])["x"], _x(2, 2, 50.0))  # type: ignore[arg-type]
    assert len(client.get_meta("t", ["x"], 6, partition="p", timeout_s=1)) == 6


def test_a_shaped_write_widens_a_dense_field_and_its_rows_read_back_shaped(
    tq: object,
) -> None:
    """A dense field of a partition that holds rows takes rows of any shape once a Shaped
    column of its dtype and number of axes is written: its rows, stored before and after,
    read back as one Shaped, bit for bit; a dense write of another shape stays refused (with
    the way to widen named), and a writer that still knows the field as dense is accepted."""
    client, stale = tq.client(), tq.client()  # type: ignore[attr-defined]
    before = client.put({"x": _x(3, 2)}, partition="p")
    stale.put({"x": _x(1, 2, 90.0)}, partition="p")  # (stale learns x as dense [2])
    with pytest.raises(SchemaError, match=r"'x'.*'p'.*dense float32 \[2\].*\[3\].*Shaped"):
        client.put({"x": _x(1, 3)}, partition="p")
    rows = [torch.tensor([1.5, -0.0, float("nan")]), torch.tensor([4.0])]
    client.put({"x": Shaped.from_tensors(rows)}, partition="p")
    assert client.specs("p")["x"] == FieldSpec.shaped("float32", 1)
    client.put({"x": _x(2, 4, 50.0)}, partition="p")  # dense now normalizes to shaped rows
    stale.put({"x": _x(1, 2, 70.0)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'.*shaped float32 ndim=1.*object"):
        client.put({"x": ["text"]}, partition="p")
    want = [*_x(3, 2).unbind(), _x(1, 2, 90.0)[0], *rows, *_x(2, 4, 50.0).unbind()]
    want.append(_x(1, 2, 70.0)[0])
    meta = client.get_meta("t", ["x"], 9, partition="p", timeout_s=5)
    got = client.get_data(meta)["x"]
    assert isinstance(got, Shaped) and len(got) == len(want) == 9
    for a, b in zip(got.unbind(), want, strict=True):
        assert a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
    old = client.get_data(before, ["x"])["x"]  # rows written before the widening only
    assert isinstance(old, Shaped) and old.shapes.tolist() == [[2]] * 3
    assert torch.equal(old.values, _x(3, 2).reshape(-1))
    # (a reader that knew the field dense reads its rows stored dense as the dense batch)
    assert torch.equal(stale.get_data(before, ["x"])["x"], _x(3, 2))


def test_unit_reads_rows_of_a_widened_field_across_its_columns() -> None:
    from transferqueue.storage.unit import StorageUnit

    unit = StorageUnit(0)
    two, shaped = FieldSpec.dense("float32", (2,)), FieldSpec.shaped("float32", 1)
    unit.write(np.arange(3), {"x": _x(3, 2)}, {"x": two}, create=True)
    rows = Shaped.from_tensors([torch.ones(3), torch.zeros(0)])
    unit.write(np.arange(3, 5), {"x": rows}, {"x": shaped}, create=True)
    got = unit.read(np.array([4, 0, 3, 2]), ["x"])["x"]
    assert isinstance(got, Shaped)
    assert got.shapes.tolist() == [[0], [2], [3], [2]]
    assert got.values.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 4.0, 5.0]


def test_cleared_partition_forgets_its_specs(client: Client) -> None:
    client.put({"x": _x(2, 2)}, partition="p")
    client.clear("p")
    assert client.specs("p") == {}
    meta = client.put({"x": ["now", "strings"]}, partition="p")
    assert client.get_data(meta, ["x"])["x"] == ["now", "strings"]
    client.clear()
    meta = client.put({"x": _x(2, 7)}, partition="p")
    assert torch.equal(client.get_data(meta, ["x"])["x"], _x(2, 7))  # type: ignore[arg-type]


def test_kv_shape_changes_once_every_key_is_gone(client: Client) -> None:
    client.kv_put("a", {"x": torch.zeros(2)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'"):
        client.kv_put("b", {"x": torch.zeros(3)}, partition="p")
    client.kv_clear("p")
    client.kv_put("b", {"x": torch.ones(3)}, partition="p")
    assert torch.equal(client.kv_get("b", partition="p")["x"], torch.ones(3))
    # a padded batch wider than the last, once the last is gone
    client.kv_batch_put(["c", "d"], {"y": torch.zeros(2, 4)}, partition="q")
    client.kv_delete(["c", "d"], partition="q")
    client.kv_batch_put(["c", "d"], {"y": torch.ones(2, 6)}, partition="q")
    got = client.kv_batch_get(["c", "d"], partition="q")["y"]
    assert torch.equal(got, torch.ones(2, 6))  # type: ignore[arg-type]


def test_consumed_partition_takes_new_specs(client: Client) -> None:
    """Rows freed once every declared task acked them: the emptied partition takes another
    shape, and a reader that learnt the old one reads the new one."""
    reader = client
    client.declare_tasks(["t"], partition="p")
    client.put({"x": _x(2, 2)}, partition="p")
    got = reader.get_meta("t", ["x"], 2, partition="p", timeout_s=1)
    assert reader.get_data(got)["x"].shape == (2, 2)  # type: ignore[union-attr]
    reader.ack(got)
    client.put({"x": _x(4, 3, 9.0)}, partition="p")
    got = reader.get_meta("t", ["x"], 4, partition="p", timeout_s=1)
    assert torch.equal(reader.get_data(got)["x"], _x(4, 3, 9.0))  # type: ignore[arg-type]


def test_reader_with_stale_specs_after_another_client_rewrote_the_partition(
    tq: object,
) -> None:
    writer, reader = tq.client(), tq.client()  # type: ignore[attr-defined]
    meta = writer.put({"x": _x(4, 2), "o": ["a"] * 4}, partition="p")
    assert reader.get_data(meta, ["x", "o"])["x"].shape == (4, 2)
    writer.clear("p")
    meta = writer.put({"x": _x(4, 3), "o": [torch.ones(2)] * 4}, partition="p")
    cols = reader.get_data(meta, ["x", "o"])
    assert torch.equal(cols["x"], _x(4, 3))
    assert isinstance(cols["o"], Ragged)
    # and a writer whose cache is stale puts the partition's new spec
    reader.put({"x": _x(1, 3)}, partition="p")
    assert reader.status("p").indexes.size == 5


def test_unit_keeps_one_column_per_spec_and_drops_unused_ones() -> None:
    from transferqueue.storage.unit import StorageUnit

    unit = StorageUnit(0)
    two, three = FieldSpec.dense("float32", (2,)), FieldSpec.dense("float32", (3,))
    unit.write(np.arange(4), {"x": _x(4, 2)}, {"x": two}, create=True)
    unit.write(np.arange(4, 6), {"x": _x(2, 3)}, {"x": three}, create=True)
    assert torch.equal(unit.read(np.arange(4), ["x"])["x"], _x(4, 2))  # type: ignore[arg-type]
    assert torch.equal(unit.read(np.arange(4, 6), ["x"])["x"], _x(2, 3))  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match="different specs"):
        unit.read(np.arange(3, 5), ["x"])
    unit.free(np.arange(4))
    assert unit.stats()["fields"] == {"x": "dense float32 [3]"}


def test_a_writer_with_stale_specs_is_refused_at_commit(tq: object) -> None:
    """A writer that learnt ``x`` as [2] before another client cleared the partition and
    wrote [3] is refused (the partition holds [3] rows), not mixed into it; its next put
    learns the new spec."""
    stale, other = tq.client(), tq.client()  # type: ignore[attr-defined]
    stale.put({"x": _x(2, 2)}, partition="p")
    other.clear("p")
    fresh = other.put({"x": _x(2, 3)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x' of partition 'p'.*\[3\].*\[2\]"):
        stale.put({"x": _x(2, 2)}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'"):
        stale.kv_put("k", {"x": torch.zeros(2)}, partition="p")
    stale.put({"x": _x(1, 3)}, partition="p")
    assert len(other.status("p")) == 3
    assert torch.equal(stale.get_data(fresh, ["x"])["x"], _x(2, 3))
