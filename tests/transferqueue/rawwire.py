"""Hand-built wire messages for tests that talk to servers as a hostile peer would: frames
made byte by byte (see :mod:`transferqueue.wire.codec` for the layout), bypassing every check a
real client makes."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import zmq

from transferqueue.schema import DTYPES

_TORCH_CODE = {name: i for i, name in enumerate(DTYPES)}
NUMPY_INT64 = 7  # code of int64 in the wire's numpy dtype table


def header(kind: str, rid: int = 1) -> bytes:
    raw = kind.encode()
    return struct.pack("<QB", rid, len(raw) % 256) + raw


def request(kind: str, body: Any, *buffers: bytes, rid: int = 1) -> list[bytes]:
    """A request whose body is ``body`` packed as it is (a list: the struct's fields)."""
    return [header(kind, rid) + msgpack.packb(body, use_bin_type=True), *buffers]


def inline(data: bytes) -> bytes:
    return b"\x00" + data


def frames(first: int, count: int) -> bytes:
    return b"\x01" + struct.pack("<II", first, count)


def shm(name: str, offset: int) -> bytes:
    raw = name.encode()
    return b"\x02" + struct.pack("<QB", offset, len(raw)) + raw


def payload(code: int, shape: list[int], ref: bytes) -> bytes:
    return struct.pack(f"<BB{len(shape)}q", code, len(shape), *shape) + ref


def tensor(dtype: str, shape: list[int], ref: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(1, payload(_TORCH_CODE[dtype], shape, ref))


def int64s(values: list[int]) -> msgpack.ExtType:
    """An int64 numpy array, inline."""
    data = struct.pack(f"<{len(values)}q", *values)
    return msgpack.ExtType(2, payload(NUMPY_INT64, [len(values)], inline(data)))


def ask(sock: zmq.Socket, msg: list[bytes], wait_s: float = 5.0) -> tuple[int, Any] | None:
    """Send ``msg``; (status, body) of the reply (status 1: ``[code, text]``), or None."""
    sock.send_multipart(msg)
    if not sock.poll(int(wait_s * 1000)):
        return None
    reply = sock.recv_multipart()
    _, status = struct.unpack_from("<QB", reply[0])
    body = reply[0][9:]
    return status, msgpack.unpackb(body, strict_map_key=False, ext_hook=lambda c, d: (c, d))


def error_code(reply: tuple[int, Any] | None) -> str | None:
    """The error code of a reply (None: a result, or no reply)."""
    if reply is None or reply[0] != 1:
        return None
    return str(reply[1][0])
