"""The wire format: awkward values round-trip bit-exactly; frames are counted; no pickle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from transferqueue import FieldSpec, ProtocolError, Ragged
from transferqueue.meta import BatchMeta
from transferqueue.wire import CHUNK_BYTES, INLINE_BYTES, decode, encode


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8),
                b.contiguous().reshape(-1).view(torch.uint8),
            )
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(3.5, dtype=torch.bfloat16),  # 0-d
        torch.empty(0, 4),  # empty
        torch.arange(24, dtype=torch.float16).reshape(4, 6)[:, ::2],  # non-contiguous
        torch.tensor([math.nan, -0.0, math.inf], dtype=torch.float32),
        torch.randint(0, 2, (300,), dtype=torch.bool),
        np.arange(10, dtype=np.int16),
    ],
    ids=["0d-bf16", "empty", "strided-fp16", "special-floats", "bool", "numpy"],
)
def test_tensors_round_trip(value: object) -> None:
    got = decode(encode({"v": value}))["v"]
    assert _same(value, got)


def test_ragged_spec_meta_and_unicode_round_trip() -> None:
    r = Ragged.from_tensors([torch.arange(3), torch.arange(0), torch.arange(700)])
    meta = BatchMeta.empty("p", task="t", lease_id=7, reason="full")
    obj = {"r": r, "s": FieldSpec.ragged("int64"), "m": meta, "u": ["数学", "🚀", {"k": None}]}
    got = decode(encode(obj))
    assert got["r"] == r and got["s"] == obj["s"] and got["u"] == obj["u"]
    assert isinstance(got["m"], BatchMeta) and got["m"].lease_id == 7 and len(got["m"]) == 0


def test_frame_count_small_inline_large_out_of_band_huge_chunked() -> None:
    small = torch.zeros(INLINE_BYTES // 4, dtype=torch.float32)  # exactly inline
    large = torch.zeros(INLINE_BYTES, dtype=torch.float32)  # one frame
    huge = torch.zeros(CHUNK_BYTES // 4 * 2 + 1, dtype=torch.float32)  # three chunks
    assert len(encode({"a": small})) == 1
    assert len(encode({"a": large})) == 2
    frames = encode({"a": huge, "b": large})
    assert len(frames) == 1 + 3 + 1
    got = decode(frames)
    assert torch.equal(got["a"], huge) and torch.equal(got["b"], large)


def test_received_tensor_shares_the_frame_memory() -> None:
    x = torch.randn(1000)
    frames = encode({"x": x})
    payload = bytearray(frames[1])  # what a receiver owns
    got = decode([frames[0], payload])["x"]
    payload[:4] = b"\x00\x00\x00\x00"
    assert float(got[0]) == 0.0  # zero copy: the tensor is a view of the frame


def test_unpicklable_things_are_refused() -> None:
    class Thing:
        pass

    with pytest.raises(ProtocolError, match="nothing is pickled"):
        encode({"x": Thing()})
    with pytest.raises(ProtocolError):
        encode({"x": np.array(["a", "b"], dtype=object)})


@pytest.mark.parametrize(
    "frames",
    [
        [b"\xc1"],  # never-used msgpack byte
        [b"\x81\xa1k"],  # truncated map
        [encode({"x": torch.zeros(1000)})[0]],  # header names a frame that is missing
        [encode({"x": torch.zeros(1000)})[0], b"short"],  # frame shorter than its header says
        [b"\xc7\x03\x09abc"],  # unknown extension type
    ],
    ids=["garbage", "truncated", "missing-frame", "short-frame", "unknown-ext"],
)
def test_malformed_messages_raise_protocol_error(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(frames)
