"""The wire format: awkward values round-trip bit-exactly; frames are counted; no pickle;
every hostile message is refused by its kind's schema, in-process (see also the service fuzz
test in test_service.py)."""

from __future__ import annotations

import math
import struct

import fuzzwire
import msgspec
import numpy as np
import pytest
import torch

from transferqueue import FieldSpec, ProtocolError, Ragged
from transferqueue.meta import BatchMeta
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.codec import CHUNK_BYTES, INLINE_BYTES, decode, encode


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
    obj = {"r": r, "u": ["数学", "🚀", {"k": None}]}
    got = decode(encode(obj))
    assert got["r"] == r and got["u"] == obj["u"]
    spec = FieldSpec.ragged("int64", [3])
    assert decode(encode(spec), type=FieldSpec) == spec
    meta = BatchMeta.empty("p", task="t", lease_id=7, reason="full")
    got_meta = decode(encode(meta), type=BatchMeta)
    assert got_meta.lease_id == 7 and len(got_meta) == 0 and got_meta.reason == "full"


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


def _general_array_ext(a: np.ndarray) -> bytes:
    """The ext 2 payload of ``a`` as the module docstring lays it out (built by hand)."""
    code = [np.dtype(n) for n in wire._NUMPY].index(a.dtype)
    shape = struct.pack(f"<BB{a.ndim}q", code, a.ndim, *a.shape)
    return shape + b"\x00" + a.tobytes()  # (inline: 0 + the bytes)


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "bool", "float16", "float64"])
@pytest.mark.parametrize("n", [0, 1, 64, 127, 128, 1024])
def test_small_1d_arrays_take_the_short_path_and_keep_the_wire_bytes(dtype: str, n: int) -> None:
    """BatchMeta's columns (small 1-D arrays) are encoded and decoded by a shorter path:
    the bytes are those of the general one, and an inline array decodes to a writable copy."""
    a = (np.arange(n) % 7).astype(dtype)[::-1]  # (non-contiguous too)
    frames = [bytes(f) for f in encode(a)]
    if a.nbytes <= INLINE_BYTES:
        want = msgspec.msgpack.encode(msgspec.msgpack.Ext(2, _general_array_ext(a)))
        assert frames == [want]
    else:
        assert len(frames) == 2  # (the general path: the buffer in a frame of its own)
    back = decode(frames)
    assert back.dtype == a.dtype and np.array_equal(back, a)
    assert back.flags.writeable or a.nbytes > INLINE_BYTES  # (a frame's memory: as it came)


@pytest.mark.parametrize(
    "payload",
    [
        struct.pack("<BBqB", 7, 1, 3, 0) + bytes(16),  # says 3 int64, holds 2
        struct.pack("<BBqB", 7, 1, 1, 0) + bytes(16),  # says 1 int64, holds 2: bytes past the end
        struct.pack("<BBqB", 7, 1, -1, 0),  # a negative dimension
        struct.pack("<BBqB", 99, 1, 0, 0),  # an unknown dtype code
        struct.pack("<BBqB", 7, 1, 2, 9) + bytes(16),  # an unknown buffer reference kind
    ],
    ids=["short", "long", "negative", "dtype", "ref"],
)
def test_malformed_small_arrays_are_still_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode([msgspec.msgpack.encode(msgspec.msgpack.Ext(2, payload))])


# -- hostile messages ----------------------------------------------------------------------------
def test_every_kind_has_a_fuzz_example() -> None:
    """Every kind of TransferQueue's own roles; a package on top (asyncflow's ``weights``
    role, imported by another test of the same worker) declares and tests its own."""
    declared = {
        (server, kind)
        for server, kinds in protocol.KINDS.items()
        if server in ("controller", "unit")
        for kind in kinds
    }
    assert declared == set(fuzzwire.EXAMPLES)


@pytest.mark.parametrize("key", sorted(fuzzwire.EXAMPLES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_every_example_round_trips_into_its_struct(key: tuple[str, str]) -> None:
    server, _ = key
    msg = fuzzwire.EXAMPLES[key]
    rid, got = wire.decode_request(wire.encode_request(77, msg), server)
    assert rid == 77 and type(got) is type(msg)
    for name in msg.__struct_fields__:
        a, b = getattr(msg, name), getattr(got, name)
        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b) and b.dtype == np.int64
        elif not isinstance(a, dict):
            assert a == b, name


@pytest.mark.parametrize("server", ["controller", "unit"])
def test_hostile_messages_are_refused_before_any_handler_runs(server: str) -> None:
    """Every structure-aware case (deep nesting of every container and extension type, 4 GiB
    declared lengths, out-of-range and non-finite numbers, wrong types in every field of every
    kind) either decodes into a message that passed its schema, or is refused with a
    ProtocolError naming the request (no crash, no other exception type)."""
    refused = accepted = 0
    for label, frames in fuzzwire.cases(server):
        try:
            _, msg = wire.decode_request(frames, server, join=False)
        except wire.RequestError as e:
            assert isinstance(e.error, ProtocolError), label
            assert e.rid == fuzzwire.numbered(frames), label
            refused += 1
        except ProtocolError:  # (no readable header: nobody to answer)
            assert label == "short-header", label
        else:
            assert isinstance(msg, protocol.KINDS[server][label.split("[")[0].split()[0]]), label
            accepted += 1
    assert refused > 20 * accepted  # nearly every case is hostile, and refused


def test_an_ext3_nested_400_deep_is_a_typed_error_not_a_crash() -> None:
    """The 2.4 kB message that killed servers with SIGSEGV (nested extension decoding)."""
    deep = fuzzwire._nested_ext(3, 400).data
    body = b"\x94" + msgpack_str("t") + msgpack_str("p") + b"\x91" + deep
    with pytest.raises(wire.RequestError, match="get_meta"):
        wire.decode_request([fuzzwire.raw.header("get_meta"), body + b"\x02"], "controller")


def msgpack_str(s: str) -> bytes:
    return bytes([0xA0 | len(s)]) + s.encode()


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("lease_s", float("inf"), "<= 10000000.0"),
        ("lease_s", -5.0, "> 0.0"),
        ("lease_s", float("nan"), "> 0.0"),
        ("timeout_s", -1.0, ">= 0.0"),
        ("batch_size", 3 * 10**8, "<= 4194304"),
        ("task", "", "length >= 1"),
    ],
)
def test_schema_errors_name_the_field_and_the_bound(field: str, value: object, error: str) -> None:
    msg = m.GetMeta(task="t", partition="p", fields=None, batch_size=1)
    setattr(msg, field, value)
    frames = wire.encode_request(1, msg)
    with pytest.raises(wire.RequestError) as info:
        wire.decode_request(frames, "controller")
    text = str(info.value.error)
    assert error in text and "get_meta" in text
    index = m.GetMeta.__struct_fields__.index(field)
    assert f"$[{index}]" in text  # the field's position in the struct


def test_decoding_a_struct_is_not_slower_than_msgpack_plain() -> None:
    """(Sanity, not a benchmark: the schema decode handles a get_meta request and a 64-row
    BatchMeta reply without per-field Python work beyond the integer-array checks.)"""
    meta = BatchMeta(*(np.arange(64) for _ in range(5)), partition="p", reason="full")
    got = decode(encode(meta), type=BatchMeta)
    assert np.array_equal(got.indexes, meta.indexes) and got.units.dtype == np.int32
    assert msgspec.msgpack.decode(encode(m.Stats())[0]) == []
