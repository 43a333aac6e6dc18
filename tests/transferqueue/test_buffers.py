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
