"""ResultBuffers: warm buffers that reads of different sizes take and give back."""

from __future__ import annotations

import gc

import torch

from transferqueue.client.buffers import ResultBuffers


def test_free_buffers_of_different_sizes_are_taken_by_identity() -> None:
    """Two free buffers of other sizes: taking the larger one must not compare arrays
    element-wise (``list.remove`` on numpy arrays raised a broadcasting ValueError)."""
    bufs = ResultBuffers()
    small = bufs.tensors({"x": ((1 << 18,), torch.float32)})  # 1 MiB
    large = bufs.tensors({"x": ((1 << 19,), torch.float32)})  # 2 MiB
    assert small is not None and large is not None
    del small, large
    gc.collect()
    again = bufs.tensors({"x": ((3 << 17,), torch.float32)})  # 1.5 MiB: the larger fits
    assert again is not None and again["x"].numel() == 3 << 17
    assert bufs.reused == 1


def test_ragged_reads_from_several_units_merge_into_warm_buffers() -> None:
    """A ragged field read from two units is merged into one values buffer: the handle's
    warm ones, taken again once the last result is gone, and bit-exact. A shaped field of
    rows this large is not merged (its read is a chunk per unit, see test_shaped_chunks)
    until its ``values`` are asked for: then into a warm buffer too."""
    import transferqueue
    from transferqueue import Ragged, Shaped

    rows = [torch.full((200 + i, 900), i, dtype=torch.uint8) for i in range(8)]  # ~1.5 MB
    with transferqueue.start(num_units=2, spread_bytes=0) as tq:
        client = tq.client()
        meta = client.put({"seq": Ragged.from_tensors(rows), "img": Shaped.from_tensors(rows)})
        assert len(set(meta.units.tolist())) == 2  # (the rows are on both units)
        buffers = tq._buffers
        first = client.get_data(meta, ["seq"])["seq"]
        assert isinstance(first, Ragged) and buffers.reused == 0
        del first
        gc.collect()
        again = client.get_data(meta, ["seq"])["seq"]
        assert buffers.reused == 1
        assert again == Ragged.from_tensors(rows)
        del again
        gc.collect()
        img = client.get_data(meta, ["img"])["img"]
        assert isinstance(img, Shaped) and len(img.chunks()) == 2 and buffers.reused == 1
        assert img.values.numel() == sum(r.numel() for r in rows) and buffers.reused == 2
        assert len(img.chunks()) == 1 and img == Shaped.from_tensors(rows)
