"""Structure-aware hostile messages for every message kind (shared by the wire's in-process
fuzz test and the service fuzz test).

Each kind starts from a valid example (``EXAMPLES``; a kind without one fails
``test_every_kind_has_a_fuzz_example``, so a new kind is fuzzed from the day it is declared);
then every field in turn is replaced by every value of ``BAD``: wrong types, out-of-range and
non-finite numbers, oversized strings, every container and extension type nested thousands
deep, msgpack headers declaring 4 GiB that never come, tensors declaring 2**80 bytes or
frames that do not exist. Whole messages are also broken: bodies nested or cut short, too
many fields, bad headers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import rawwire as raw
import torch

from transferqueue import FieldSpec
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.checks import encode_meta
from transferqueue.wire.replies import TaskImport


class Raw:
    """msgpack bytes spliced into a body as they are (what msgpack-python cannot pack)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _ext32(code: int, data: bytes) -> bytes:
    return b"\xc9" + struct.pack(">Ib", len(data), code) + data


def _nested_ext(code: int, depth: int) -> Raw:
    inner = b"\xc0"
    for _ in range(depth):
        inner = _ext32(code, inner)
    return Raw(inner)


EXAMPLES: dict[tuple[str, str], protocol.Request[Any]] = {
    ("controller", "hello"): m.Hello(),
    ("controller", "ping"): m.Ping(),
    ("controller", "register_unit"): m.RegisterUnit(
        unit_id=4000, address="tcp://127.0.0.1:1", incarnation="fuzz"
    ),
    ("controller", "lost"): m.Lost(indexes=np.array([10**9])),
    ("controller", "register_fields"): m.RegisterFields(specs={"fz": FieldSpec.dense("float32")}),
    ("controller", "get_specs"): m.GetSpecs(),
    ("controller", "allocate"): m.Allocate(
        n=2, partition="fuzz", groups=np.arange(2), nbytes=16, producer="p", timeout_s=0.0
    ),
    ("controller", "discard"): m.Discard(indexes=np.array([10**9])),
    ("controller", "commit"): m.Commit(indexes=np.array([10**9]), fields=["fz"], lease_id=5),
    ("controller", "get_meta"): m.GetMeta(
        task="ft", partition="fuzz", fields=["fz"], batch_size=2, lease_s=5.0, timeout_s=0.0
    ),
    ("controller", "ack"): m.Ack(lease_id=12345, indexes=np.array([0])),
    ("controller", "release"): m.Release(lease_id=12345),
    ("controller", "renew"): m.Renew(lease_id=12345, lease_s=5.0),
    ("controller", "alive"): m.Alive(holder="host:1/ab12"),
    ("controller", "holder_gone"): m.HolderGone(name="rollout", keep="rollout/ab12"),
    ("controller", "declare_tasks"): m.DeclareTasks(partition="fuzz2", tasks=["a"]),
    ("controller", "finish"): m.Finish(partition="fuzz3"),
    ("controller", "clear"): m.Clear(partition="fuzz"),
    ("controller", "stats"): m.Stats(),
    ("controller", "reset"): m.Reset(),
    ("controller", "status"): m.Status(partition="fuzz", fields=["fz"], task="ft"),
    ("controller", "reset_consumption"): m.ResetConsumption(partition="fuzz", task="ft"),
    ("controller", "set_custom_meta"): m.SetCustomMeta(
        indexes=np.array([10**9]), metas=[encode_meta({"k": [1, "v"]}, "fuzz")]
    ),
    ("controller", "get_custom_meta"): m.GetCustomMeta(indexes=np.array([10**9])),
    ("controller", "lost_rows"): m.GetLostRows(partition="fuzz", task="ft", after=0),
    ("controller", "retire_groups"): m.RetireGroups(
        partition="fuzz", groups=np.array([10**9]), unless_leased_by="ft"
    ),
    ("controller", "kv_rows"): m.KvRows(
        partition="fuzz",
        keys=["k1", "ü-2"],
        create=True,
        groups=np.arange(2),
        nbytes=16,
        producer="p",
        timeout_s=0.0,
    ),
    ("controller", "kv_delete"): m.KvDelete(partition="fuzz", keys=["k1"]),
    ("controller", "kv_list"): m.KvList(partition="fuzz", fields=["fz"], all_fields=True),
    ("controller", "claim"): m.Claim(partition="fuzz", name="g/0", indexes=np.arange(2)),
    ("controller", "export_state"): m.ExportState(partitions=["fuzz"], hold_s=1.0),
    ("controller", "hold_export"): m.HoldExport(snapshot_id=7, hold_s=0.0),
    ("controller", "import_rows"): m.ImportRows(
        partition="fuzz",
        groups=np.arange(2),
        versions=np.zeros(2, np.int64),
        lengths=np.full(2, -1),
        first=False,
    ),
    ("controller", "import_tasks"): m.ImportTasks(
        partition="fuzz",
        tasks=[
            TaskImport(
                name="t",
                fields=["fz"],
                sampler="fifo",
                options={},
                consumed=np.array([10**9]),
                queue=np.array([], dtype=np.int64),
            )
        ],
        declared=["t"],
    ),
    ("unit", "write"): m.Write(
        indexes=np.array([2**27]),
        columns={"fz": torch.zeros(1, 300), "o": ["a"]},
        specs={"fz": FieldSpec.dense("float32", [300]), "o": FieldSpec.object()},
        create=True,
        grant=b"\x00" * 44,
    ),
    ("unit", "read"): m.Read(indexes=np.array([0, 1]), fields=["fz"]),
    ("unit", "free"): m.Free(indexes=np.array([2**27])),
    ("unit", "clear"): m.ClearUnit(),
    ("unit", "stats"): m.UnitStats(),
    ("unit", "inventory"): m.UnitInventory(),
    ("unit", "copy_rows"): m.CopyRows(
        indexes=np.array([2**27]),
        fields=["fz"],
        specs={"fz": FieldSpec.dense("float32", [300])},
        target=1,
        address="tcp://127.0.0.1:1",
        grant=b"\x00" * 44,
    ),
    ("unit", "ping"): m.UnitPing(),
    ("unit", "reset"): m.ResetUnit(),
    ("unit", "shm_attach"): m.ShmAttach(name="tq-0123456789abcdef-1"),
    ("unit", "shm_detach"): m.ShmDetach(name="tq-0123456789abcdef-1"),
}

_HUGE = [2**40, 2**40]
BAD: list[tuple[str, Any]] = [
    ("none", None),
    ("true", True),
    ("zero", 0),
    ("minus-one", -1),
    ("uint64-max", 2**64 - 1),
    ("int64-min", -(2**63)),
    ("3e8", 3 * 10**8),
    ("row-2**27", 2**27),
    ("float", 1.5),
    ("negative-time", -5.0),
    ("nan", float("nan")),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("1e308", 1e308),
    ("empty-str", ""),
    ("long-str", "x" * 100_000),
    ("unicode", "ü" * 100),
    ("bytes", b"\xff" * 64),
    ("empty-list", []),
    ("mixed-list", [1, "a", None, 2.5]),
    ("many-names", ["f"] * 5000),
    ("empty-map", {}),
    ("int-key-map", {1: 2}),
    ("map", {"a": [1, {"b": None}]}),
    ("tensor-empty", msgpack.ExtType(1, b"")),
    ("tensor-huge", raw.tensor("float32", _HUGE, raw.inline(b""))),
    ("tensor-2**80", raw.tensor("float32", [2**40, 2**40, 2**0], raw.frames(0, 1))),
    ("tensor-ndim-255", msgpack.ExtType(1, bytes([8, 255]) + b"\x00" * 16)),
    ("tensor-dtype-200", msgpack.ExtType(1, raw.payload(200, [1], raw.inline(b"\x00")))),
    ("tensor-frames-4G", raw.tensor("int64", [1], raw.frames(0, 2**32 - 1))),
    ("tensor-frame-9", raw.tensor("int64", [4], raw.frames(9, 1))),
    ("tensor-inline-short", raw.tensor("int64", [1000], raw.inline(b"\x00" * 8))),
    ("tensor-shm", raw.tensor("int64", [1000], raw.shm("../../etc/passwd", 2**64 - 8))),
    ("tensor-ref-7", raw.tensor("int64", [1], b"\x07")),
    ("tensor-trailing", msgpack.ExtType(1, raw.payload(5, [1], raw.inline(b"\x00" * 8)) + b"xx")),
    ("array-bool", msgpack.ExtType(2, raw.payload(0, [3], raw.inline(b"\x01\x00\x01")))),
    ("array-2d", msgpack.ExtType(2, raw.payload(7, [1, 1], raw.inline(b"\x00" * 8)))),
    ("array-float", msgpack.ExtType(2, raw.payload(11, [1], raw.inline(b"\x00" * 8)))),
    ("array-huge-rows", raw.int64s([2**62, -(2**62), 2**27])),
    ("array-dtype-99", msgpack.ExtType(2, raw.payload(99, [1], raw.inline(b"\x00")))),
    (
        "ragged-bad-offsets",
        msgpack.ExtType(
            3,
            raw.payload(5, [2], raw.inline(b"\x00" * 16))
            + raw.payload(5, [2], raw.inline(struct.pack("<2q", 0, 7))),
        ),
    ),
    (
        "ragged-float-offsets",
        msgpack.ExtType(
            3,
            raw.payload(5, [0], raw.inline(b""))
            + raw.payload(8, [1], raw.inline(struct.pack("<f", 0.0))),
        ),
    ),
    ("ragged-cut", msgpack.ExtType(3, raw.payload(5, [2], raw.inline(b"\x00" * 16)))),
    ("ext-unknown", msgpack.ExtType(9, b"abc")),
    ("ext-negative", Raw(b"\xd4\xff\x00")),  # fixext1 of type -1
    ("deep-list", Raw(b"\x91" * 100_000 + b"\xc0")),
    ("deep-map", Raw(b"\x81\xa1a" * 100_000 + b"\xc0")),
    ("deep-ext1", _nested_ext(1, 400)),
    ("deep-ext2", _nested_ext(2, 400)),
    ("deep-ext3-400", _nested_ext(3, 400)),
    ("deep-ext3-3000", _nested_ext(3, 3000)),
    ("deep-ext9", _nested_ext(9, 400)),
    ("deep-list-of-ext3", Raw(b"\x91" * 400 + _nested_ext(3, 400).data)),
    ("array32-4G", Raw(b"\xdd\xff\xff\xff\xff\x01")),
    ("map32-4G", Raw(b"\xdf\xff\xff\xff\xff\xa1a\x01")),
    ("str32-4G", Raw(b"\xdb\xff\xff\xff\xffabc")),
    ("bin32-4G", Raw(b"\xc6\xff\xff\xff\xffabc")),
    ("ext32-4G", Raw(b"\xc9\xff\xff\xff\xff\x01abc")),
    ("never-used-byte", Raw(b"\xc1")),
]


def _pack(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.data
    return msgpack.packb(value, use_bin_type=True)


def _array(items: list[bytes]) -> bytes:
    n = len(items)
    head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n)
    return head + b"".join(items)


def _parts(msg: protocol.Request[Any]) -> tuple[list[Any], list[bytes]]:
    """A valid message's body as a list of field values (extensions as ExtType), and its
    buffers."""
    frames = wire.encode(msg)
    body = msgpack.unpackb(
        frames[0], raw=False, strict_map_key=False, ext_hook=lambda c, d: msgpack.ExtType(c, d)
    )
    return body, [bytes(f) for f in frames[1:]]


def cases(server: str) -> Iterator[tuple[str, list[bytes]]]:
    """(label, request frames) of every hostile variant of every kind of ``server``."""
    rid = 1000
    for (srv, kind), example in EXAMPLES.items():
        if srv != server:
            continue
        fields, buffers = _parts(example)
        packed = [_pack(v) for v in fields]
        for i in range(len(fields)):
            for label, bad in BAD:
                rid += 1
                body = _array([*packed[:i], _pack(bad), *packed[i + 1 :]])
                yield f"{kind}[{i}]={label}", [raw.header(kind, rid) + body, *buffers]
        for label, body in [
            ("valid", _array(packed)),
            ("too-many-fields", _array([*packed, b"\xc0", b"\xc0"])),
            ("cut", _array(packed)[: max(1, len(_array(packed)) // 2)]),
            ("map-body", _pack({"k": kind})),
            ("deep-body", b"\x91" * 100_000 + b"\xc0"),
            ("deep-ext3-body", _nested_ext(3, 400).data),
            ("empty-body", b""),
        ]:
            rid += 1
            yield f"{kind} {label}", [raw.header(kind, rid) + body, *buffers]
        rid += 1
        yield f"{kind} no-body", [raw.header(kind, rid)]
        yield f"{kind} extra-frames", [raw.header(kind, rid) + _array(packed), *buffers, b"x" * 64]
        rid += 1
        yield f"{kind} kind-length-past-the-end", [raw.header(kind, rid)[:8] + b"\xff" + b"abc"]
    for label, head in [
        ("unknown-kind", raw.header("nope")),
        ("long-kind", raw.header("k" * 255)),
        ("short-header", b"\x01\x02"),
        ("binary-kind", struct.pack("<QB", 5, 2) + b"\xff\xfe"),
    ]:
        yield label, [head + b"\x90"]


def numbered(frames: list[bytes]) -> int | None:
    """The request id of a case's frames, if its header has one."""
    head = frames[0]
    return struct.unpack_from("<Q", head)[0] if len(head) > 8 else None


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
