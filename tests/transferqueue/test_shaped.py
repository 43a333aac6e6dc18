"""Shaped columns: tensors whose whole shape varies per row (images ``[3, H, W]``), one
values buffer plus per-row shapes. Bit-exact through every deployment, inferred from a list of
tensors that differ beyond their first axis or declared up front, read as row views or padded
with a mask, exported to Arrow, saved and loaded, and a kind mismatch in one partition refused
with nothing stored lost."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

import transferqueue
from transferqueue import Client, FieldSpec, ProtocolError, Ragged, SchemaError, Shaped
from transferqueue.arrow import column_from_arrow, column_to_arrow
from transferqueue.wire.codec import INLINE_BYTES, decode, encode

SIZES = [(7, 5), (2, 9), (1, 1), (6, 6), (3, 4)]


def _images(sizes: list[tuple[int, int]] = SIZES, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def _bits(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` values of ``dtype`` with random bits (NaNs, -0.0 and all)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _same_rows(got: object, want: list[torch.Tensor]) -> None:
    assert isinstance(got, Shaped)
    rows = got.unbind()
    assert [r.shape for r in rows] == [w.shape for w in want]
    assert [r.dtype for r in rows] == [w.dtype for w in want]
    for r, w in zip(rows, want, strict=True):  # by bits: NaN payloads and -0.0 included
        assert torch.equal(r.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


# -- the column --------------------------------------------------------------------------------
def test_rows_are_views_of_one_buffer_and_padding_has_a_mask() -> None:
    imgs = _images()
    s = Shaped.from_tensors(imgs)
    assert s.values.dim() == 1 and s.ndim == 3 and len(s) == len(imgs)
    assert s.shapes.tolist() == [[3, h, w] for h, w in SIZES]
    rows = s.unbind()
    assert rows[1].data_ptr() == s.values[int(s.offsets[1]) :].data_ptr()  # zero copy
    assert torch.equal(s[3], imgs[3]) and torch.equal(s[-1], imgs[-1])
    padded, mask = s.to_padded(pad_value=255)
    assert padded.shape == (5, 3, 7, 9) and mask.shape == padded.shape
    assert int(mask.sum()) == s.values.numel()
    assert torch.equal(padded[1, :, :2, :9], imgs[1]) and bool((padded[1, :, 2:] == 255).all())
    assert not bool(mask[2, :, 1:, :].any()) and bool(mask[2, :, :1, :1].all())
    assert Shaped.from_padded(padded, s.shapes) == s
    with pytest.raises(ValueError, match="does not hold every row"):
        s.to_padded(shape=(3, 6, 9))


def test_slice_take_clone_keep_shapes() -> None:
    imgs = _images()
    s = Shaped.from_tensors(imgs)
    _same_rows(s.slice(1, 4), imgs[1:4])
    _same_rows(s.take([4, 0, 2]), [imgs[4], imgs[0], imgs[2]])
    c = s.clone()
    assert c == s and c.values.data_ptr() != s.values.data_ptr()
    assert s.with_values(s.values.clone()) == s


def test_bad_layouts_are_refused() -> None:
    with pytest.raises(ValueError, match="product of its shape"):
        Shaped(torch.zeros(5), torch.tensor([0, 5]), torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match="shapes must be"):
        Shaped(torch.zeros(6), torch.tensor([0, 6]), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="1-D"):
        Shaped(torch.zeros(2, 3), torch.tensor([0, 2]), torch.tensor([[2, 3]]))
    with pytest.raises(ValueError, match="axes"):
        Shaped.from_tensors([torch.zeros(2, 2), torch.zeros(2)])
    with pytest.raises(SchemaError, match="ndim"):
        FieldSpec("shaped", "uint8")


def test_wire_sends_values_as_a_frame_offsets_and_shapes_inline() -> None:
    s = Shaped.from_tensors(_images([(40, 30), (20, 50)]))
    assert s.nbytes > INLINE_BYTES
    frames = encode({"img": s})
    assert len(frames) == 2  # the body (offsets and shapes inline) + one values frame
    got = decode([frames[0], bytearray(frames[1])])["img"]
    assert isinstance(got, Shaped) and got == s


def test_a_shaped_extension_whose_shapes_disagree_is_a_protocol_error() -> None:
    import msgspec

    from transferqueue.wire import codec

    payload = b"".join(
        codec._tensor_payload(t)
        for t in (torch.zeros(6), torch.tensor([0, 6]), torch.tensor([[2, 2]]))
    )
    body = msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(4, payload)})
    with pytest.raises(ProtocolError, match=r"malformed extension 4.*product of its shape"):
        decode([body])


def test_arrow_mapping_round_trips_without_copying_values() -> None:
    s = Shaped.from_tensors([_bits(12, torch.float32, 1).view(3, 4), torch.zeros(2, 1)])
    arr = column_to_arrow(s)
    assert arr.type == pa.struct(
        [("values", pa.large_list(pa.float32())), ("shape", pa.list_(pa.int64(), 2))]
    )
    assert arr.to_pylist()[1] == {"values": [0.0, 0.0], "shape": [2, 1]}
    back = column_from_arrow(arr)
    assert isinstance(back, Shaped) and back == s
    assert back.values.data_ptr() == s.values.data_ptr()


# -- through every deployment ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_inferred_round_trip_is_bit_exact(client: Client, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    shapes = [(3, int(h), int(w)) for h, w in torch.randint(1, 40, (9, 2), generator=g)]
    want = [_bits(a * b * c, dtype, i).view(a, b, c) for i, (a, b, c) in enumerate(shapes)]
    meta = client.put({"img": want, "ids": [torch.arange(i + 1) for i in range(9)]})
    assert client.specs()["img"] == FieldSpec.shaped(dtype, 3)
    assert client.specs()["ids"].kind == "ragged"  # differing only along axis 0: ragged
    _same_rows(client.get_data(meta)["img"], want)
    # through a task: rows come from both units and are merged in batch order
    got = client.get_meta("t", ["img"], 9, timeout_s=5)
    order = got.indexes.tolist()
    base = int(meta.indexes[0])
    _same_rows(client.get_data(got)["img"], [want[i - base] for i in order])


def test_declared_field_takes_equal_shapes_and_rows_by_key(client: Client) -> None:
    same = torch.zeros(2, 3, 4, 4, dtype=torch.uint8)
    declared = {"img": FieldSpec.shaped(torch.uint8, 3)}
    meta = client.put({"img": same}, partition="p", specs=declared)  # equal shapes: shaped
    got = client.get_data(meta)["img"]
    assert isinstance(got, Shaped) and torch.equal(got.to_padded()[0], same)
    imgs = _images()
    for i, img in enumerate(imgs):
        client.kv_put(f"k{i}", {"img": img}, partition="p")
    for i in (4, 0):
        row = client.kv_get(f"k{i}", partition="p")["img"]
        assert torch.equal(row, imgs[i])
    _same_rows(client.kv_batch_get(["k1", "k3"], partition="p")["img"], [imgs[1], imgs[3]])


def test_padded_read_has_a_mask(client: Client) -> None:
    imgs = _images()
    client.put({"img": imgs})
    got = client.get_data(client.get_meta("t", ["img"], 5, timeout_s=5))["img"]
    assert isinstance(got, Shaped)
    padded, mask = got.to_padded()
    assert padded.shape == (5, 3, 7, 9)
    assert int(mask.sum()) == sum(i.numel() for i in imgs)
    for k, row in enumerate(got.unbind()):
        assert torch.equal(padded[k][mask[k]], row.reshape(-1))


def test_arrow_export(client: Client) -> None:
    imgs = _images()
    meta = client.put({"img": imgs})
    table = client.get_data(meta, format="arrow")
    assert pa.types.is_struct(table.schema.field("img").type)
    rows = table.column("img").to_pylist()
    assert [r["shape"] for r in rows] == [[3, h, w] for h, w in SIZES]
    assert [r["values"] for r in rows] == [i.reshape(-1).tolist() for i in imgs]


def test_kind_mismatch_in_a_partition_is_refused_and_nothing_is_lost(client: Client) -> None:
    imgs = _images()
    ragged = [torch.zeros(n, 3, dtype=torch.uint8) for n in (1, 4)]
    meta = client.put({"x": ragged}, partition="p")
    with pytest.raises(SchemaError, match=r"'x'.*'p'.*ragged uint8 \[3\].*shaped uint8 ndim=3"):
        client.put({"x": imgs}, partition="p")
    shaped = client.put({"x": imgs}, partition="q")  # another partition: its own kind
    with pytest.raises(SchemaError, match=r"'x'.*'q'.*shaped uint8 ndim=3.*dense"):
        client.put({"x": torch.zeros(2, 3, dtype=torch.uint8)}, partition="q")
    with pytest.raises(SchemaError, match=r"'x'.*'q'.*shaped uint8 ndim=3.*object"):
        client.put({"x": ["a", "b"]}, partition="q")
    got = client.get_data(meta)["x"]
    assert isinstance(got, Ragged) and not isinstance(got, Shaped)
    assert [t.shape[0] for t in got.unbind()] == [1, 4]
    _same_rows(client.get_data(shaped)["x"], imgs)
    more = client.put({"x": _images(seed=1)}, partition="q")  # still serving
    _same_rows(client.get_data(more)["x"], _images(seed=1))


def test_save_and_load_through_the_arrow_mapping(tmp_path: Path) -> None:
    imgs = _images()
    bf = [_bits(6, torch.bfloat16, 2).view(2, 3), _bits(4, torch.bfloat16, 3).view(1, 4)]
    c128 = [_bits(6, torch.complex128, 5).view(3, 2), _bits(1, torch.complex128, 6).view(1, 1)]
    with transferqueue.start(num_units=2, spread_bytes=0) as a, transferqueue.start() as b:
        c, d = a.client(), b.client()
        c.put({"img": imgs}, partition="p")
        c.put({"bf": bf, "c128": c128}, partition="q")  # (no Arrow type: saved as bits)
        c.save(tmp_path / "ck")
        d.load(tmp_path / "ck")
        assert d.specs("p")["img"] == FieldSpec.shaped(torch.uint8, 3)
        assert d.specs("q")["bf"] == FieldSpec.shaped(torch.bfloat16, 2)
        p, q = d.status("p", meta=True).meta, d.status("q", meta=True).meta
        assert p is not None and q is not None
        _same_rows(d.get_data(p, ["img"])["img"], imgs)
        _same_rows(d.get_data(q, ["bf"])["bf"], bf)
        _same_rows(d.get_data(q, ["c128"])["c128"], c128)


def test_awkward_rows_round_trip(client: Client) -> None:
    """Empty rows, a non-contiguous row, 2-D float64 with NaN bits; 1-D rows declared shaped."""
    g = torch.Generator().manual_seed(9)
    want = [
        torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # non-contiguous [3, 4]
        torch.empty(0, 5, dtype=torch.float64),
        torch.full((2, 0), 1.0, dtype=torch.float64),
        _bits(6, torch.float64, 4).view(1, 6),
    ]
    meta = client.put({"m": want}, partition="a")
    _same_rows(client.get_data(meta)["m"], want)
    flat = [torch.arange(3), torch.arange(0), torch.arange(5)]  # would be ragged undeclared
    meta = client.put({"v": flat}, partition="a", specs={"v": FieldSpec.shaped(torch.int64, 1)})
    _same_rows(client.get_data(meta)["v"], flat)
