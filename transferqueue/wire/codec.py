"""The wire: how a message becomes ZeroMQ frames, and back.

Every message kind is declared once, in :mod:`transferqueue.wire.messages`; this module only moves
them. A message is a multipart ZeroMQ message::

    request  frame 0   rid uint64 LE | kind length uint8 | kind (ASCII) | body: msgpack of
                       the message struct (its fields, in order); a rid with bit 63 set
                       is a request of the service's own servers (wire.peers)
             frame 1.. buffers: one per tensor / array chunk, referenced from the body
    reply    frame 0   rid uint64 LE | status uint8 (0: result, 1: error) | body: msgpack of
                       the kind's declared reply type, or [code, text]
             frame 1.. buffers

The header and the body share one frame (a second frame per message cost a send per request
on a loaded two-core host). A server reads the header first (so even a request whose body is
rejected gets an error reply naming its id), then decodes the body straight into the kind's
struct with ``msgspec``:
types, bounds (:mod:`transferqueue.limits`), counts and nesting are checked in that one pass,
before any handler runs, and anything else is a :class:`ProtocolError` reply.

Values msgpack lacks are extension types whose payloads are flat binary (never msgpack, so no
extension nests in another and decoding never recurses)::

| ext | type         | payload (little-endian)                                             |
|-----|--------------|---------------------------------------------------------------------|
| 1   | torch.Tensor | dtype uint8 | ndim uint8 | dims int64 x ndim | buffer reference     |
| 2   | np.ndarray   | the same, with numpy's dtype codes                                  |
| 3   | Ragged       | its values tensor's payload, then its offsets tensor's payload      |
| 4   | Shaped       | values, offsets, then its shapes [B, ndim] int64 tensor's payload   |

A buffer reference is ``0`` + the bytes (buffers of at most ``INLINE_BYTES``), ``1`` + first
buffer uint32 + count uint32 (the frames after the first; buffers above ``CHUNK_BYTES`` are
split over several), or ``2`` + offset uint64 + name length uint8 + name (a shared-memory
arena the two sides attached, see :mod:`transferqueue.storage.shm`; an unknown arena or an offset
out of range is a :class:`ProtocolError`). Buffers of tensors and arrays never pass through
msgpack: they are sent with ``copy=False`` and rebuilt with ``torch.frombuffer`` /
``np.frombuffer`` on receipt, sharing the frame's memory (the tensor keeps the frame alive).
``FieldSpec`` and ``BatchMeta`` are plain structs on the wire. Nothing is ever pickled.

Frames above 64 MiB move slower, but joining chunks on receipt costs a full copy into fresh
memory, which on the reference machine cost more than frames of up to 64 MiB lose (a 32 MB
column read in 0.20 s as one frame, 0.22-0.95 s as 8 MiB chunks joined). A storage unit
receiving chunks does not join them: it copies them straight into its buffers.

**Adding a message kind** is one declaration: a class in :mod:`transferqueue.wire.messages`
(subclass ``ControllerRequest[Reply]`` or ``UnitRequest[Reply]``, set ``kind``, declare typed
and bounded fields), and a handler method of that name on the server (``ControllerService``
or ``ControllerServer``; ``UnitServer``) taking ``(message, caller)``. Servers refuse to start
when a declared kind has no handler; clients send it with ``await link.call(Kind(...))``.
Bump ``PROTOCOL_VERSION`` when an existing kind changes. (Kinds of another server role, declared
by a package on top, travel the same way: see :mod:`transferqueue.wire.protocol`.)
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from transferqueue.chunked import ChunkedTensor
from transferqueue.errors import ProtocolError, TQError, error_from_code
from transferqueue.limits import MAX_DIM, MAX_DIMS
from transferqueue.ragged import Ragged
from transferqueue.schema import DTYPES
from transferqueue.shaped import Shaped
from transferqueue.wire import messages  # noqa: F401  (declaring the kinds fills KINDS)
from transferqueue.wire.protocol import KINDS, Request

__all__ = [
    "CHUNK_BYTES",
    "INLINE_BYTES",
    "PROTOCOL_VERSION",
    "SHM_MIN_BYTES",
    "RequestError",
    "decode",
    "decode_reply",
    "decode_request",
    "encode",
    "encode_error",
    "encode_reply",
    "encode_request",
    "kind_of",
]

PROTOCOL_VERSION = 7  # 3: Commit.dropped, BatchMeta.replica_units; 4: unit inventory;
# 5: Commit.copies, copy_rows (re-replication); 6: field specs per partition; 7: shaped fields
CHUNK_BYTES = 64 << 20  # see the module docstring
INLINE_BYTES = 1024
SHM_MIN_BYTES = 64 << 10  # smaller buffers go as frames even when an arena is offered

Placer = Callable[[memoryview], "list[str | int] | None"]
"""Copies a buffer into shared memory: ``[arena name, offset]``, or None when it does not fit."""
Resolver = Callable[[str, int, int], memoryview]
"""``(arena name, offset, nbytes)`` -> those bytes of an attached arena."""

_EXT_TENSOR, _EXT_ARRAY, _EXT_RAGGED, _EXT_SHAPED = 1, 2, 3, 4
_REF_INLINE, _REF_FRAMES, _REF_SHM = 0, 1, 2
_TORCH = list(DTYPES.values())
_TORCH_CODE = {dt: i for i, dt in enumerate(_TORCH)}
_NUMPY = [np.dtype(n) for n in ("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32")]
_NUMPY += [np.dtype(n) for n in ("int64", "uint64", "float16", "float32", "float64")]
_NUMPY_CODE = {dt: i for i, dt in enumerate(_NUMPY)}
_HEAD = struct.Struct("<BB")
_HEAD1 = {dt: _HEAD.pack(i, 1) for dt, i in _NUMPY_CODE.items()}  # a 1-D array's header
_I64 = struct.Struct("<q")
_INLINE = bytes([0])  # (_REF_INLINE)
_ARRAY1 = struct.Struct("<BBqB")  # a 1-D array with its buffer inline: code, 1, size, 0
_U32X2 = struct.Struct("<II")
_SHM = struct.Struct("<QB")
_RID = struct.Struct("<Q")
_RID_KIND = struct.Struct("<QB")  # request: rid, length of the kind
_RID_STATUS = struct.Struct("<QB")  # reply: rid, status
_OK, _ERROR = 0, 1


# -- encoding ----------------------------------------------------------------------------------
class _Out(threading.local):
    """The message being encoded on this thread: its buffers and where they may go."""

    buffers: list[Any]
    place: Placer | None


_out = _Out()


def _buffer_ref(raw: memoryview) -> bytes:
    if raw.nbytes <= INLINE_BYTES:
        return bytes([_REF_INLINE]) + raw.tobytes()
    place = _out.place
    if place is not None and raw.nbytes >= SHM_MIN_BYTES:
        ref = place(raw)
        if ref is not None:
            name = str(ref[0]).encode()
            return bytes([_REF_SHM]) + _SHM.pack(int(ref[1]), len(name)) + name
    buffers = _out.buffers
    first = len(buffers)
    for start in range(0, raw.nbytes, CHUNK_BYTES):
        buffers.append(raw[start : start + CHUNK_BYTES])
    return bytes([_REF_FRAMES]) + _U32X2.pack(first, len(buffers) - first)


def _tensor_payload(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    code = _TORCH_CODE.get(t.dtype)
    if code is None:
        raise ProtocolError(f"tensor dtype {t.dtype} cannot go on the wire")
    # The frame is a view of the tensor's memory; pyzmq keeps the memoryview (and so the
    # tensor) alive until the frame has been sent.
    raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
    shape = tuple(t.shape)
    return _HEAD.pack(code, len(shape)) + struct.pack(f"<{len(shape)}q", *shape) + _buffer_ref(raw)


def _enc_hook(obj: Any) -> Any:
    if type(obj) is np.ndarray and obj.ndim == 1 and obj.nbytes <= INLINE_BYTES:
        # (the columns of a BatchMeta: the same bytes as below, without the general path)
        head = _HEAD1.get(obj.dtype)
        if head is not None:
            return msgspec.msgpack.Ext(
                _EXT_ARRAY, head + _I64.pack(obj.size) + _INLINE + obj.tobytes()
            )
    if isinstance(obj, torch.Tensor):
        return msgspec.msgpack.Ext(_EXT_TENSOR, _tensor_payload(obj))
    if isinstance(obj, np.ndarray):
        a = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)  # (keeps 0-d)
        code = _NUMPY_CODE.get(a.dtype)
        if code is None and a.dtype.kind in "biuf":  # (non-native byte order)
            a = a.astype(a.dtype.newbyteorder("="))
            code = _NUMPY_CODE.get(a.dtype)
        if code is None:
            raise ProtocolError(f"numpy dtype {a.dtype} cannot go on the wire")
        raw = a.reshape(-1).view(np.uint8).data if a.size else memoryview(b"")
        head = _HEAD.pack(code, a.ndim) + struct.pack(f"<{a.ndim}q", *a.shape)
        return msgspec.msgpack.Ext(_EXT_ARRAY, head + _buffer_ref(raw))
    if isinstance(obj, Shaped):
        body = b"".join(_tensor_payload(t) for t in (obj.values, obj.offsets, obj.shapes))
        return msgspec.msgpack.Ext(_EXT_SHAPED, body)
    if isinstance(obj, Ragged):
        body = _tensor_payload(obj.values) + _tensor_payload(obj.offsets)
        return msgspec.msgpack.Ext(_EXT_RAGGED, body)
    if isinstance(obj, np.integer | np.floating | np.bool_):
        return obj.item()
    raise ProtocolError(
        f"{type(obj).__name__} cannot go on the wire (msgpack values, tensors, arrays, "
        "Ragged, FieldSpec and BatchMeta can; nothing is pickled)"
    )


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(obj: Any, place: Placer | None = None, head: bytes = b"") -> list[Any]:
    """``obj`` as frames: [``head`` + msgpack body, buffer, buffer, ...]; with ``place``,
    buffers it accepts go into shared memory instead of frames."""
    _out.buffers, _out.place = [], place
    try:
        body = bytearray(head)
        _encoder.encode_into(obj, body, len(head))
        return [body, *_out.buffers]
    except TQError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"cannot encode a {type(obj).__name__}: {e}") from None
    finally:
        _out.buffers, _out.place = [], None


def encode_request(rid: int, msg: Request[Any], place: Placer | None = None) -> list[Any]:
    kind = msg.kind.encode()
    return encode(msg, place, _RID_KIND.pack(rid, len(kind)) + kind)


def encode_reply(rid: int, result: Any, place: Placer | None = None) -> list[Any]:
    return encode(result, place, _RID_STATUS.pack(rid, _OK))


def encode_error(rid: int, err: BaseException) -> list[Any]:
    """A typed error reply: TQErrors keep their code; invalid arguments (ValueError,
    TypeError) become ``bad_request``; anything else is an internal ``error``."""
    if isinstance(err, TQError):
        code, text = err.code, str(err)
    elif isinstance(err, ValueError | TypeError):
        code, text = "bad_request", str(err)
    else:
        code, text = "error", f"internal error: {type(err).__name__}: {err}"
    return [_RID_STATUS.pack(rid, _ERROR) + _encoder.encode([code, text[:4096]])]


# -- decoding ----------------------------------------------------------------------------------
class _In(threading.local):
    """The message being decoded on this thread: its buffers and how to read them."""

    buffers: Sequence[Any] = ()
    join: bool = True
    resolve: Resolver | None = None


_in = _In()


def _as_buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


def _parts(data: memoryview, pos: int, nbytes: int) -> tuple[list[memoryview], bool, int]:
    """The buffers a reference at ``data[pos:]`` names: (parts, shared memory?, end)."""
    kind = data[pos]
    pos += 1
    if kind == _REF_INLINE:
        end = pos + nbytes
        if end > len(data):
            raise ProtocolError(
                f"inline buffer of {len(data) - pos} bytes; its header says {nbytes}"
            )
        return [memoryview(bytearray(data[pos:end]))], False, end  # (writable, like a frame)
    if kind == _REF_FRAMES:
        first, count = _U32X2.unpack_from(data, pos)
        buffers = _in.buffers
        if count < 1 or first + count > len(buffers):
            raise ProtocolError(
                f"body names buffers {first}..{first + count - 1}; the message has {len(buffers)}"
            )
        parts = [_as_buffer(b) for b in buffers[first : first + count]]
        got = sum(p.nbytes for p in parts)
        if got != nbytes:
            raise ProtocolError(f"buffers hold {got} bytes, their header says {nbytes}")
        return parts, False, pos + _U32X2.size
    if kind == _REF_SHM:
        offset, n = _SHM.unpack_from(data, pos)
        pos += _SHM.size
        name = bytes(data[pos : pos + n]).decode("ascii", "replace")
        if _in.resolve is None:
            raise ProtocolError(f"shared-memory buffer {name!r} where none can be attached")
        view = _in.resolve(name, offset, nbytes)
        if view.nbytes != nbytes:
            raise ProtocolError(f"shared-memory buffer of {view.nbytes} bytes, expected {nbytes}")
        return [view], True, pos + n
    raise ProtocolError(f"unknown buffer reference kind {kind}")


def _joined(parts: list[memoryview], nbytes: int) -> memoryview:
    if len(parts) == 1:
        return parts[0]
    out = np.empty(nbytes, dtype=np.uint8)  # one pass: no zero-filling first
    pos = 0
    for part in parts:
        out[pos : pos + part.nbytes] = np.frombuffer(part, dtype=np.uint8)
        pos += part.nbytes
    return out.data


def _shape(data: memoryview, pos: int) -> tuple[int, tuple[int, ...], int, int]:
    """(dtype code, shape, elements, end) of a tensor or array header at ``data[pos:]``."""
    code, ndim = _HEAD.unpack_from(data, pos)
    if ndim > MAX_DIMS:
        raise ProtocolError(f"{ndim} dimensions; at most {MAX_DIMS}")
    shape = struct.unpack_from(f"<{ndim}q", data, pos + _HEAD.size)
    count = 1
    for d in shape:
        if not 0 <= d <= MAX_DIM:
            raise ProtocolError(f"dimension {d} of {shape} is outside 0..{MAX_DIM}")
        count *= d
    return code, shape, count, pos + _HEAD.size + 8 * ndim


def _tensor(data: memoryview, pos: int) -> tuple[torch.Tensor | ChunkedTensor, int]:
    code, shape, count, pos = _shape(data, pos)
    if code >= len(_TORCH):
        raise ProtocolError(f"unknown tensor dtype code {code}")
    dtype = _TORCH[code]
    nbytes = count * dtype.itemsize
    parts, _, end = _parts(data, pos, nbytes)
    if count == 0:
        return torch.empty(shape, dtype=dtype), end
    if len(parts) > 1 and not _in.join:
        return ChunkedTensor(dtype, shape, parts), end
    # Shares the frame's memory; the tensor keeps the frame alive.
    raw = _joined(parts, nbytes)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape), end


def _inline_array1(data: memoryview) -> np.ndarray | None:
    """A 1-D array whose buffer is inline and ends the extension (the columns of a
    BatchMeta), read without the general path; None: anything else, left to it (which also
    refuses what is malformed)."""
    if len(data) < _ARRAY1.size:
        return None
    dt_code, ndim, n, ref = _ARRAY1.unpack_from(data)
    if ndim != 1 or ref != _REF_INLINE or dt_code >= len(_NUMPY) or not 0 <= n <= MAX_DIM:
        return None
    dt = _NUMPY[dt_code]
    if _ARRAY1.size + n * dt.itemsize != len(data):
        return None
    return np.frombuffer(bytearray(data[_ARRAY1.size :]), dtype=dt)  # (writable, like a frame)


def _ext_hook(code: int, data: memoryview) -> Any:
    t: Any
    try:
        if code == _EXT_TENSOR:
            t, end = _tensor(data, 0)
        elif code == _EXT_ARRAY and (t := _inline_array1(data)) is not None:
            end = len(data)
        elif code == _EXT_ARRAY:
            dt_code, shape, count, pos = _shape(data, 0)
            if dt_code >= len(_NUMPY):
                raise ProtocolError(f"unknown array dtype code {dt_code}")
            dt = _NUMPY[dt_code]
            parts, shared, end = _parts(data, pos, count * dt.itemsize)
            if count == 0:
                t = np.empty(shape, dtype=dt)
            else:
                t = np.frombuffer(_joined(parts, count * dt.itemsize), dtype=dt).reshape(shape)
                # numpy does not keep a shared-memory view's own object alive (it holds what
                # the view was taken of), and a lent arena is reused once that object is gone:
                # arrays from shared memory are copied (tensors keep the view alive).
                if shared:
                    t = t.copy()
        elif code in (_EXT_RAGGED, _EXT_SHAPED):
            values, pos = _tensor(data, 0)
            offsets, end = _tensor(data, pos)
            if isinstance(values, ChunkedTensor):
                values = values.materialize()
            if isinstance(offsets, ChunkedTensor) or offsets.dtype != torch.int64:
                raise ProtocolError("ragged offsets must be one int64 buffer")
            if code == _EXT_RAGGED:
                t = Ragged(values, offsets)
            else:
                shapes, end = _tensor(data, end)
                if isinstance(shapes, ChunkedTensor) or shapes.dtype != torch.int64:
                    raise ProtocolError("shaped shapes must be one int64 buffer")
                t = Shaped(values, offsets, shapes)
        else:
            raise ProtocolError(f"unknown extension type {code}")
    except TQError:
        raise
    except (ValueError, TypeError, RuntimeError, struct.error, IndexError) as e:
        raise ProtocolError(f"malformed extension {code}: {e}") from None
    if end != len(data):
        raise ProtocolError(f"extension {code} has {len(data) - end} bytes past its end")
    return t


def _dec_hook(tp: type, obj: Any) -> Any:
    if isinstance(obj, tp):
        return obj
    raise TypeError(f"expected a {tp.__name__}, got {type(obj).__name__}")


_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}


def _decoder(tp: Any) -> msgspec.msgpack.Decoder[Any]:
    dec = _decoders.get(tp)
    if dec is None:
        dec = _decoders[tp] = msgspec.msgpack.Decoder(tp, ext_hook=_ext_hook, dec_hook=_dec_hook)
    return dec


def _decode_body(
    tp: Any,
    body: memoryview,
    buffers: Sequence[Any],
    *,
    join: bool = True,
    resolve: Resolver | None = None,
) -> Any:
    if not body.nbytes:
        raise ProtocolError("the message has no body")
    _in.buffers, _in.join, _in.resolve = buffers, join, resolve
    try:
        return _decoder(tp).decode(body)
    except TQError:
        raise
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid message: {e}") from None
    except RecursionError:
        raise ProtocolError("message nested too deep") from None
    except Exception as e:  # msgpack garbage raises several types
        raise ProtocolError(f"undecodable message: {type(e).__name__}: {e}") from None
    finally:
        _in.buffers, _in.resolve = (), None


def decode(
    frames: Sequence[Any], *, join: bool = True, resolve: Resolver | None = None, type: Any = Any
) -> Any:
    """Inverse of :func:`encode` (into ``type``); raises :class:`ProtocolError` on anything
    malformed. ``join=False`` leaves dense tensors that came in several frames as
    :class:`ChunkedTensor` (a storage unit copies them straight into its buffers).
    ``resolve`` finds shared-memory buffers (without it, they are a :class:`ProtocolError`).
    """
    if not frames:
        raise ProtocolError("empty message")
    return _decode_body(type, _as_buffer(frames[0]), frames[1:], join=join, resolve=resolve)


class RequestError(Exception):
    """A request whose header was read (``rid``) but whose body was refused (``error``)."""

    def __init__(self, rid: int, error: TQError) -> None:
        super().__init__(rid, error)
        self.rid = rid
        self.error = error


def decode_request(
    frames: Sequence[Any],
    server: str,
    *,
    join: bool = True,
    resolve: Resolver | None = None,
) -> tuple[int, Request[Any]]:
    """(request id, message) of a request to ``server``. A header without an id is a
    :class:`ProtocolError` (nobody to answer); anything else refused is a
    :class:`RequestError` carrying the id."""
    head = _as_buffer(frames[0]) if frames else memoryview(b"")
    if head.nbytes < _RID_KIND.size:
        raise ProtocolError("malformed request header")
    rid, n = _RID_KIND.unpack_from(head)
    start = _RID_KIND.size + n
    kind = bytes(head[_RID_KIND.size : start]).decode("ascii", "replace")
    table = KINDS.get(server, {})
    cls = table.get(kind)
    if cls is None or start > head.nbytes:
        known = sorted(table)
        err = ProtocolError(f"unknown message kind {kind!r}; this server takes {known}")
        raise RequestError(rid, err)
    try:
        msg = _decode_body(cls, head[start:], frames[1:], join=join, resolve=resolve)
    except ProtocolError as e:
        raise RequestError(rid, type(e)(f"{kind}: {e}")) from None
    return rid, msg


def kind_of(head: Any) -> bytes:
    """The kind a request's header frame names, as bytes (b"": not a request header); reads
    only the header's first bytes (a server sorting what it read, see wire.loopsocket)."""
    raw = _as_buffer(head)
    if raw.nbytes < _RID_KIND.size:
        return b""
    n = raw[_RID_KIND.size - 1]
    return bytes(raw[_RID_KIND.size : _RID_KIND.size + n])


def reply_id(frames: Sequence[Any]) -> int | None:
    """The request id a reply answers (None: not a reply)."""
    head = _as_buffer(frames[0]) if frames else memoryview(b"")
    return _RID.unpack_from(head)[0] if head.nbytes > _RID_STATUS.size else None


def decode_reply(frames: Sequence[Any], reply_type: Any, resolve: Resolver | None = None) -> Any:
    """The result of a reply (into ``reply_type``); a typed error reply is raised as its
    TQError subclass."""
    head = _as_buffer(frames[0])
    if head.nbytes <= _RID_STATUS.size:
        raise ProtocolError("malformed reply header")
    status = head[_RID.size]
    body = head[_RID_STATUS.size :]
    if status == _ERROR:
        code, text = _decode_body(tuple[str, str], body, ())
        raise error_from_code(code, text)
    if status != _OK:
        raise ProtocolError(f"unknown reply status {status}")
    return _decode_body(reply_type, body, frames[1:], resolve=resolve)
