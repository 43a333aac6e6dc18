"""A Shaped over several buffers (``Shaped.concat``): how a read of large rows from several
storage units comes back without a gather. Rows, padding, slices, equality, the wire and
Arrow see the same rows as over one buffer, bit for bit; ``values`` gathers once."""

from __future__ import annotations

import pytest
import torch

import transferqueue
from transferqueue import Client, FieldSpec, Shaped
from transferqueue.arrow import column_from_arrow, column_to_arrow
from transferqueue.wire.codec import decode, encode


def _bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` with random bits (NaN payloads, -0.0 and all)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def _same_rows(got: object, want: list[torch.Tensor]) -> None:
    assert isinstance(got, Shaped)
    rows = got.unbind()
    assert [r.shape for r in rows] == [w.shape for w in want]
    for r, w in zip(rows, want, strict=True):  # by bits
        assert r.dtype == w.dtype
        assert torch.equal(r.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


def _rows() -> list[torch.Tensor]:
    """Float rows of varied shapes, zero-element ones included (offsets that repeat)."""
    shapes = [(2, 3, 4), (2, 0, 5), (2, 5, 1), (2, 2, 2), (2, 1, 0), (2, 4, 3)]
    return [_bits(s, torch.float32, i) for i, s in enumerate(shapes)]


def _chained(rows: list[torch.Tensor]) -> Shaped:
    """The rows as three chunks, each over a buffer of its own."""
    return Shaped.concat([Shaped.from_tensors(rows[a:b]) for a, b in ((0, 2), (2, 3), (3, 6))])


# -- the column --------------------------------------------------------------------------------
def test_concat_keeps_the_parts_buffers_and_reads_like_one_buffer() -> None:
    rows = _rows()
    parts = [Shaped.from_tensors(rows[:2]), Shaped.from_tensors(rows[2:])]
    c = Shaped.concat(parts)
    whole = Shaped.from_tensors(rows)
    assert len(c.chunks()) == 2 and len(c) == 6 and c.ndim == 3 and c.dtype == torch.float32
    assert c.unbind()[3].data_ptr() == parts[1].values[int(parts[1].offsets[1]) :].data_ptr()
    assert torch.equal(c.offsets, whole.offsets) and torch.equal(c.shapes, whole.shapes)
    assert c.nbytes == whole.nbytes and "chunks=2" in repr(c)
    _same_rows(c, rows)
    assert torch.equal(c[5], rows[5]) and torch.equal(c[-6], rows[0])
    with pytest.raises(IndexError, match="row 6 out of range"):
        c[6]
    assert c == whole and whole == c and _chained(rows) == c
    padded, mask = c.to_padded(pad_value=-1)
    want_padded, want_mask = whole.to_padded(pad_value=-1)
    assert torch.equal(padded.view(torch.int32), want_padded.view(torch.int32))
    assert torch.equal(mask, want_mask)


def test_one_changed_bit_in_any_chunk_makes_them_unequal() -> None:
    rows = _rows()
    whole = Shaped.from_tensors(rows)
    for k in (0, 3, 5):
        changed = [r.clone() for r in rows]
        changed[k].view(-1).view(torch.int32)[-1] ^= 1
        assert _chained(changed) != whole and whole != _chained(changed)
    other_shapes = Shaped.concat([Shaped.from_tensors([r.reshape(1, 2, -1)]) for r in rows[:1]])
    assert other_shapes != Shaped.from_tensors(rows[:1])


def test_slice_take_clone_and_values_of_chunks() -> None:
    rows = _rows()
    c = _chained(rows)
    across = c.slice(1, 5)  # the end of chunk 0, chunk 1, the start of chunk 2
    assert len(across.chunks()) == 3
    _same_rows(across, rows[1:5])
    inside = c.slice(3, 5)
    assert len(inside.chunks()) == 1 and inside.unbind()[0].data_ptr() == c[3].data_ptr()
    assert len(c.slice(2, 2)) == 0
    _same_rows(c.take([5, 0, 3]), [rows[5], rows[0], rows[3]])
    copy = c.clone()
    assert copy == c and len(copy.chunks()) == 1 and copy[0].data_ptr() != c[0].data_ptr()
    values = c.values  # gathered once: one buffer from then on
    assert len(c.chunks()) == 1 and c.values is values and c[3].data_ptr() != rows[3].data_ptr()
    assert c == Shaped.from_tensors(rows)


def test_chunks_over_strided_values_gather_bit_exact() -> None:
    rows = _rows()
    whole = Shaped.from_tensors(rows)
    wide = torch.stack([whole.values, torch.zeros_like(whole.values)], dim=1)  # [N, 2]
    strided = Shaped(wide[:, 0], whole.offsets, whole.shapes)  # (values not contiguous)
    c = Shaped.concat([strided.slice(0, 3), Shaped.from_tensors(rows[3:])])
    assert not c.chunks()[0].values.is_contiguous()
    assert torch.equal(c.values.view(torch.int32), whole.values.view(torch.int32))
    assert c == whole


def test_concat_refuses_parts_of_other_dtypes_or_axes() -> None:
    a = Shaped.from_tensors([torch.zeros(2, 2)])
    with pytest.raises(ValueError, match=r"part 1 holds torch\.uint8"):
        Shaped.concat([a, Shaped.from_tensors([torch.zeros(2, 2, dtype=torch.uint8)])])
    with pytest.raises(ValueError, match=r"part 1 holds torch\.float32 rows of 1 axes"):
        Shaped.concat([a, Shaped.from_tensors([torch.zeros(2)])])
    with pytest.raises(ValueError, match="at least one part"):
        Shaped.concat([])
    assert Shaped.concat([a]) is a


def test_chunks_go_on_the_wire_and_to_arrow_as_one_column() -> None:
    rows = _rows()
    assert decode(encode(_chained(rows))) == Shaped.from_tensors(rows)
    back = column_from_arrow(column_to_arrow(_chained(rows)))
    assert isinstance(back, Shaped) and back == Shaped.from_tensors(rows)


# -- through every deployment ------------------------------------------------------------------
def _images(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` rows of ~300 KB: large enough that a read leaves them in the units' buffers."""
    g = torch.Generator().manual_seed(seed)
    hw = torch.randint(300, 341, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in hw]


def _check_read(client: Client, imgs: list[torch.Tensor], feats: list[torch.Tensor]) -> None:
    """A task's read of every row: each unit's rows a chunk, bit-exact in the batch's order;
    padded and Arrow reads and a put of the column read back agree."""
    meta = client.get_meta("t", ["img", "feat"], len(imgs), timeout_s=10)
    assert len(meta) == len(imgs)
    order = (meta.indexes - meta.indexes.min()).tolist()
    got = client.get_data(meta)
    img, feat = got["img"], got["feat"]
    assert isinstance(img, Shaped) and len(img.chunks()) >= 2  # (no gather)
    _same_rows(img, [imgs[i] for i in order])
    _same_rows(feat, [feats[i] for i in order])
    padded, mask = img.to_padded()
    for k, i in enumerate(order):
        assert torch.equal(padded[k][mask[k]], imgs[i].reshape(-1))
    table = client.get_data(meta, format="arrow")
    assert column_from_arrow(table.column("img")) == img
    again = client.put({"img": img}, partition="again")
    _same_rows(client.get_data(again)["img"], [imgs[i] for i in order])


def test_reads_from_several_units_are_chunks_and_bit_exact(client: Client) -> None:
    imgs = _images(6, seed=1)
    feats = [_bits((2, 110 + i, 300), torch.float32, 10 + i) for i in range(6)]
    client.put({"img": imgs, "feat": feats})  # spread over both units
    assert client.specs()["img"] == FieldSpec.shaped(torch.uint8, 3)
    _check_read(client, imgs, feats)


@pytest.mark.service
def test_four_unit_service_reads_chunks_bit_exact() -> None:
    imgs = _images(10, seed=2)
    feats = [_bits((2, 100, 300 + i), torch.float32, 20 + i) for i in range(10)]
    with (
        transferqueue.serve(num_units=4, spread_bytes=0) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        client = tq.client()
        meta = client.put({"img": imgs, "feat": feats})
        assert len(set(meta.units.tolist())) == 4
        _check_read(client, imgs, feats)
