"""The wire protocol: every message kind, and how values become ZeroMQ frames.

A message is a multipart ZeroMQ message::

    frame 0     msgpack header   request: {"k": kind, "i": id, "a": {arg: value}}
                                 reply:   {"i": id, "r": value} or {"i": id, "e": [code, text]}
    frame 1..   raw buffers      one per tensor / array chunk, referenced from the header

Values in the header are msgpack, plus extension types for what msgpack lacks. Buffers of
tensors and arrays never pass through msgpack: they travel as their own frames (sent with
``copy=False``; rebuilt with ``torch.frombuffer``/``np.frombuffer`` on receipt, sharing the
frame's memory). Buffers above ``CHUNK_BYTES`` (64 MiB) are split into several frames: very
large frames move slower, but joining chunks on receipt costs a full copy into fresh memory,
which on the reference machine cost more than frames of up to 64 MiB lose (a 32 MB column
read in 0.20 s as one frame, 0.22-0.95 s as 8 MiB chunks joined). A storage unit receiving
chunks does not join them: it copies them straight into its buffers.
Buffers of at most ``INLINE_BYTES`` go inline in the header. Nothing is ever pickled.

Between a client and a storage unit on the same host, buffers of at least ``SHM_MIN_BYTES``
may instead be placed in a shared-memory arena the two have attached (see
:mod:`transferqueue.shm`): the buffer reference is then ``[arena name, offset]``, and the
receiver resolves it against the arenas it knows (an unknown arena or an offset out of range
is a :class:`ProtocolError`).

| ext | type        | payload (msgpack)                                           |
|-----|-------------|-------------------------------------------------------------|
| 1   | torch.Tensor| [dtype name, shape, buffer reference]                       |
| 2   | np.ndarray  | [dtype str, shape, buffer reference]                        |
| 3   | Ragged      | [values tensor, offsets tensor]                             |
| 4   | FieldSpec   | {kind, dtype, shape}                                        |
| 5   | BatchMeta   | BatchMeta.to_dict()                                         |

A buffer reference is ``[frame index, ...]``, inline bytes, or ``[arena name, offset]``.

Message kinds are listed per server below; ``a`` holds the keyword arguments of the server
method of the same name (see :class:`ControllerService` and :class:`UnitLink`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import ProtocolError, TQError, error_from_code
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.schema import DTYPES, FieldSpec, dtype_name

__all__ = [
    "CONTROLLER_KINDS",
    "UNIT_KINDS",
    "decode",
    "decode_reply",
    "encode",
    "encode_error",
    "encode_reply",
    "encode_request",
]

CONTROLLER_KINDS = frozenset(
    {
        "hello",  # -> {"units": [[unit id, address], ...]}
        "register_fields",
        "get_specs",
        "allocate",
        "discard",
        "commit",
        "get_meta",
        "ack",
        "release",
        "renew",
        "declare_tasks",
        "finish",
        "clear",
        "stats",
        "reset",
    }
)
UNIT_KINDS = frozenset(
    {"write", "read", "free", "clear", "stats", "reset", "shm_attach", "shm_detach"}
)

CHUNK_BYTES = 64 << 20  # see the module docstring
INLINE_BYTES = 1024
SHM_MIN_BYTES = 64 << 10  # smaller buffers go as frames even when an arena is offered

Placer = Callable[[memoryview], "list[str | int] | None"]
"""Copies a buffer into shared memory: ``[arena name, offset]``, or None when it does not fit."""
Resolver = Callable[[str, int, int], memoryview]
"""``(arena name, offset, nbytes)`` -> those bytes of an attached arena."""

_EXT_TENSOR, _EXT_ARRAY, _EXT_RAGGED, _EXT_SPEC, _EXT_META = 1, 2, 3, 4, 5


# -- encoding ----------------------------------------------------------------------------------
class _Encoder:
    def __init__(self, place: Placer | None = None) -> None:
        self.frames: list[Any] = []
        self.place = place

    def _buffer(self, raw: memoryview) -> list[Any] | bytes:
        if raw.nbytes <= INLINE_BYTES:
            return raw.tobytes()
        if self.place is not None and raw.nbytes >= SHM_MIN_BYTES:
            ref = self.place(raw)
            if ref is not None:
                return ref
        idx = []
        for start in range(0, raw.nbytes, CHUNK_BYTES):
            idx.append(len(self.frames) + 1)  # frame 0 of the message is the header
            self.frames.append(raw[start : start + CHUNK_BYTES])
        return idx

    def default(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            # The frame is a view of the tensor's memory; pyzmq keeps the memoryview (and so
            # the tensor) alive until the frame has been sent.
            raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
            body = [dtype_name(t.dtype), list(t.shape), self._buffer(raw)]
            return msgpack.ExtType(_EXT_TENSOR, self._pack(body))
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            if a.dtype.kind not in "biuf":
                raise ProtocolError(f"numpy dtype {a.dtype} cannot go on the wire")
            raw = a.reshape(-1).view(np.uint8).data if a.size else memoryview(b"")
            body = [a.dtype.str, list(a.shape), self._buffer(raw)]
            return msgpack.ExtType(_EXT_ARRAY, self._pack(body))
        if isinstance(obj, Ragged):
            return msgpack.ExtType(_EXT_RAGGED, self._pack([obj.values, obj.offsets]))
        if isinstance(obj, FieldSpec):
            return msgpack.ExtType(_EXT_SPEC, self._pack(obj.to_dict()))
        if isinstance(obj, BatchMeta):
            return msgpack.ExtType(_EXT_META, self._pack(obj.to_dict()))
        if isinstance(obj, np.integer | np.floating | np.bool_):
            return obj.item()
        if isinstance(obj, set | frozenset):
            return sorted(obj)
        raise ProtocolError(
            f"{type(obj).__name__} cannot go on the wire (msgpack values, tensors, arrays, "
            "Ragged, FieldSpec and BatchMeta can; nothing is pickled)"
        )

    def _pack(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self.default, use_bin_type=True)


def encode(obj: Any, place: Placer | None = None) -> list[Any]:
    """``obj`` as frames: [msgpack header, buffer, buffer, ...]; with ``place``, buffers it
    accepts go into shared memory instead of frames."""
    enc = _Encoder(place)
    header = enc._pack(obj)
    return [header, *enc.frames]


def encode_request(
    kind: str, req_id: int, args: dict[str, Any], place: Placer | None = None
) -> list[Any]:
    return encode({"k": kind, "i": req_id, "a": args}, place)


def encode_reply(req_id: int, result: Any, place: Placer | None = None) -> list[Any]:
    return encode({"i": req_id, "r": result}, place)


def encode_error(req_id: int | None, err: BaseException) -> list[Any]:
    """A typed error reply: TQErrors keep their code; invalid arguments (ValueError,
    TypeError) become ``bad_request``; anything else is an internal ``error``."""
    if isinstance(err, TQError):
        code, text = err.code, str(err)
    elif isinstance(err, ValueError | TypeError):
        code, text = "bad_request", str(err)
    else:
        code, text = "error", f"internal error: {type(err).__name__}: {err}"
    return [msgpack.packb({"i": req_id, "e": [code, text]}, use_bin_type=True)]


# -- decoding ----------------------------------------------------------------------------------
def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


def _count(shape: Any) -> int:
    """Elements of ``shape`` (a list of non-negative ints), checked without numpy's overhead."""
    if not isinstance(shape, list):
        raise ProtocolError(f"malformed shape {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"malformed shape {shape!r}")
        count *= d
    return count


def _is_shared(spec: Any) -> bool:
    return isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str)


class _Decoder:
    def __init__(
        self, frames: Sequence[Any], *, join: bool, resolve: Resolver | None = None
    ) -> None:
        self.frames = frames
        self.join = join
        self.resolve = resolve

    def _parts(self, spec: list[Any] | bytes, nbytes: int) -> list[memoryview]:
        if isinstance(spec, bytes):
            parts = [memoryview(bytearray(spec))]  # small; writable like a frame
        elif _is_shared(spec):
            name, offset = spec
            if self.resolve is None:
                raise ProtocolError(f"shared-memory buffer {name!r} where none can be attached")
            if type(offset) is not int:
                raise ProtocolError(f"malformed shared-memory offset {offset!r}")
            parts = [self.resolve(name, offset, nbytes)]
        elif isinstance(spec, list) and spec:
            parts = [_as_buffer(self._frame(i)) for i in spec]
        else:
            raise ProtocolError(f"malformed buffer reference {spec!r}")
        got = sum(p.nbytes for p in parts)
        if got != nbytes:
            raise ProtocolError(f"buffer holds {got} bytes, its header says {nbytes}")
        return parts

    @staticmethod
    def _joined(parts: list[memoryview], nbytes: int) -> memoryview:
        if len(parts) == 1:
            return parts[0]
        out = np.empty(nbytes, dtype=np.uint8)  # one pass: no zero-filling first
        pos = 0
        for part in parts:
            out[pos : pos + part.nbytes] = np.frombuffer(part, dtype=np.uint8)
            pos += part.nbytes
        return out.data

    def _frame(self, i: int) -> Any:
        if not isinstance(i, int) or not 0 < i < len(self.frames):
            raise ProtocolError(f"header names frame {i!r}; the message has {len(self.frames)}")
        return self.frames[i]

    def ext_hook(self, code: int, data: bytes) -> Any:
        body = msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False)
        try:
            if code == _EXT_TENSOR:
                name, shape, spec = body
                if name not in DTYPES:
                    raise ProtocolError(f"unknown dtype {name!r} on the wire")
                dtype = DTYPES[name]
                count = _count(shape)
                if count == 0:
                    return torch.empty(shape, dtype=dtype)
                nbytes = count * dtype.itemsize
                parts = self._parts(spec, nbytes)
                if len(parts) > 1 and not self.join:
                    return ChunkedTensor(dtype, shape, parts)
                # Shares the frame's memory; the tensor keeps the frame alive.
                raw = self._joined(parts, nbytes)
                return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
            if code == _EXT_ARRAY:
                dstr, shape, spec = body
                dt = np.dtype(dstr)
                if dt.kind not in "biuf":
                    raise ProtocolError(f"numpy dtype {dstr!r} is not allowed on the wire")
                count = _count(shape)
                if count == 0:
                    return np.empty(shape, dtype=dt)
                nbytes = count * dt.itemsize
                raw = self._joined(self._parts(spec, nbytes), nbytes)
                arr = np.frombuffer(raw, dtype=dt).reshape(shape)
                # numpy does not keep a shared-memory view's own object alive (it holds what
                # the view was taken of), and a lent arena is reused once that object is gone:
                # arrays from shared memory are copied (tensors keep the view alive).
                return arr.copy() if _is_shared(spec) else arr
            if code == _EXT_RAGGED:
                values, offsets = body
                if isinstance(values, ChunkedTensor):
                    values = values.materialize()
                return Ragged(values, offsets)
            if code == _EXT_SPEC:
                return FieldSpec.from_dict(body)
            if code == _EXT_META:
                return BatchMeta.from_dict(body)
        except TQError:
            raise
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            raise ProtocolError(f"malformed extension {code}: {e}") from None
        raise ProtocolError(f"unknown extension type {code}")


def decode(frames: Sequence[Any], *, join: bool = True, resolve: Resolver | None = None) -> Any:
    """Inverse of :func:`encode`; raises :class:`ProtocolError` on anything malformed.

    ``join=False`` leaves dense tensors that came in several frames as
    :class:`ChunkedTensor` (a storage unit copies them straight into its buffers).
    ``resolve`` finds shared-memory buffers (without it, they are a :class:`ProtocolError`).
    """
    if not frames:
        raise ProtocolError("empty message")
    dec = _Decoder(frames, join=join, resolve=resolve)
    try:
        return msgpack.unpackb(
            _as_buffer(frames[0]), ext_hook=dec.ext_hook, raw=False, strict_map_key=False
        )
    except TQError:
        raise
    except Exception as e:  # msgpack raises a zoo of exception types on garbage
        raise ProtocolError(f"undecodable message header: {type(e).__name__}: {e}") from None


def decode_request(
    frames: Sequence[Any],
    kinds: frozenset[str],
    *,
    join: bool = True,
    resolve: Resolver | None = None,
) -> tuple[str, int, dict[str, Any]]:
    msg = decode(frames, join=join, resolve=resolve)
    if not isinstance(msg, dict):
        raise ProtocolError("a request must be a map")
    kind, req_id, args = msg.get("k"), msg.get("i"), msg.get("a", {})
    if not isinstance(req_id, int):
        raise ProtocolError("a request needs an integer id 'i'")
    if kind not in kinds:
        raise ProtocolError(f"unknown message kind {kind!r}; this server takes {sorted(kinds)}")
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise ProtocolError("request arguments 'a' must be a map with string keys")
    return kind, req_id, args


def peek_request_id(frames: Sequence[Any]) -> int | None:
    """The request id of a message that failed to decode, if it can be found at all."""
    try:
        msg = msgpack.unpackb(
            _as_buffer(frames[0]), ext_hook=lambda c, d: None, raw=False, strict_map_key=False
        )
    except Exception:
        return None
    rid = msg.get("i") if isinstance(msg, dict) else None
    return rid if isinstance(rid, int) else None


def decode_reply(frames: Sequence[Any], resolve: Resolver | None = None) -> tuple[int, Any]:
    """(request id, result); a typed error reply is raised as its TQError subclass."""
    msg = decode(frames, resolve=resolve)
    if not isinstance(msg, dict) or not isinstance(msg.get("i"), int):
        raise ProtocolError("a reply must be a map with an integer id 'i'")
    if "e" in msg:
        code, text = msg["e"]
        raise _ReplyError(msg["i"], error_from_code(str(code), str(text)))
    return msg["i"], msg.get("r")


class _ReplyError(Exception):
    """Carries a decoded error reply together with the id of the request it answers."""

    def __init__(self, req_id: int, error: TQError) -> None:
        super().__init__(req_id, error)
        self.req_id = req_id
        self.error = error


ReplyError = _ReplyError
