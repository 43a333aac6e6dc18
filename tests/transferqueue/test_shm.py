"""Same-host shared memory between clients and storage units: bit-exact data through the
arena, fallback to frames, arena growth, nothing left in /dev/shm, bad references refused."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import rawwire as raw
import torch
import zmq

import transferqueue
from transferqueue import FieldSpec, ProtocolError, Ragged, TransferQueue
from transferqueue.client.unit_link import RemoteUnitLink
from transferqueue.errors import PeerGoneError
from transferqueue.storage.shm import (
    SHM_DIR,
    Arena,
    Placer,
    ReadArenas,
    Segments,
    new_token,
    shm_available,
)
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire import protocol

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host"),
]


@pytest.fixture(scope="module")
def service() -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=2, spread_bytes=0) as svc:
        yield svc


@pytest.fixture
def tq(service: transferqueue.LocalService) -> Iterator[TransferQueue]:
    with transferqueue.connect(service.address) as handle:
        handle.reset()
        yield handle


def _links(tq: TransferQueue) -> list[RemoteUnitLink]:
    links = tq._units
    assert all(isinstance(u, RemoteUnitLink) for u in links)
    return links  # type: ignore[return-value]


def _unit_stats(tq: TransferQueue) -> list[dict]:
    return tq.client().stats()["units"]


def _payload(rows: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 3000, (rows,), generator=g).tolist()
    return {
        "x": torch.randn(rows, 4096, generator=g),
        "ids": [torch.randint(0, 50_000, (n,), dtype=torch.int32, generator=g) for n in lengths],
        "tag": [f"row{i}" for i in range(rows)],
    }


def _check(got: dict, want: dict) -> None:
    assert torch.equal(got["x"], want["x"])
    assert isinstance(got["ids"], Ragged)
    assert [torch.equal(a, b) for a, b in zip(got["ids"].unbind(), want["ids"], strict=True)] == [
        True
    ] * len(want["ids"])
    assert got["tag"] == want["tag"]


def test_round_trip_through_shared_memory_is_bit_exact(tq: TransferQueue) -> None:
    client = tq.client()
    want = _payload(128, 0)
    meta = client.put(want, group=0)
    got = client.get_data(client.get_meta("t", list(want), 128, timeout_s=10))
    _check(got, want)
    _check(client.get_data(meta), want)  # a second read of the same rows
    units = _unit_stats(tq)
    assert sum(u["shm_writes"] for u in units) >= 2  # spread over both units, no frames
    assert sum(u["shm_reads"] for u in units) >= 2
    # the data no longer lives in any arena the client may write into: overwriting those
    # changes nothing already read (write arenas the unit still keeps rows in stay flagged)
    for link in _links(tq):
        free = [a for a in link._writes._arenas if a.buf[0] == 0]
        for arena in free + ([] if link._arena is None else [link._arena]):
            arena.buf[:] = 0xFF
    _check(got, want)
    _check(client.get_data(meta), want)


def test_frames_only_when_disabled(service: transferqueue.LocalService) -> None:
    with transferqueue.connect(service.address, shm_max_bytes=0) as tq:
        tq.reset()
        client = tq.client()
        want = _payload(64, 1)
        client.put(want, group=0)
        _check(client.get_data(client.get_meta("t", list(want), 64, timeout_s=10)), want)
        units = _unit_stats(tq)
        assert sum(u["shm_writes"] + u["shm_reads"] for u in units) == 0
        assert all(link.arena_bytes == 0 for link in _links(tq))


def test_unit_that_cannot_see_the_arena_gets_frames(
    service: transferqueue.LocalService, tmp_path: Path
) -> None:
    """A client whose arena the unit cannot open (another host, another /dev/shm) falls back
    to frames for that unit and loses nothing."""
    with transferqueue.connect(service.address) as tq:
        tq.reset()
        for link in _links(tq):
            link.shm_dir = str(tmp_path)  # the units look in /dev/shm and find nothing
        client = tq.client()
        want = _payload(64, 2)
        client.put(want, group=0)
        _check(client.get_data(client.get_meta("t", list(want), 64, timeout_s=10)), want)
        assert all(link.shm_max_bytes == 0 for link in _links(tq))
        assert list(tmp_path.iterdir()) == []  # the arenas that failed to attach are gone
        assert sum(u["shm_writes"] for u in _unit_stats(tq)) == 0


def test_arena_grows_and_the_unit_keeps_one_per_client(tq: TransferQueue) -> None:
    client = tq.client()
    small = {"x": torch.randn(8, 4096)}  # 128 KiB
    client.put(small, group=0)
    sizes = [link.arena_bytes for link in _links(tq)]
    big = {"x": torch.randn(2048, 4096)}  # 32 MiB, 16 MiB per unit
    client.put(big, group=1)
    grown = [link.arena_bytes for link in _links(tq)]
    assert all(g > s for g, s in zip(grown, sizes, strict=True))
    got = client.get_data(client.get_meta("t", ["x"], 2056, timeout_s=10))
    assert torch.equal(got["x"], torch.cat([small["x"], big["x"]]))  # type: ignore[arg-type]
    del got
    gc.collect()
    # one request arena per client (the grown one replaced the first), plus the read arenas
    reads = [len(link._reads._free) for link in _links(tq)]
    assert [u["shm_arenas"] for u in _unit_stats(tq)] == [1 + r for r in reads]


def test_nothing_is_left_in_dev_shm(service: transferqueue.LocalService) -> None:
    with transferqueue.connect(service.address) as tq:
        tq.reset()
        client = tq.client()
        client.put({"x": torch.randn(256, 4096)}, group=0)
        tokens = [link._token for link in _links(tq)]
        assert all(link.arena_bytes > 0 for link in _links(tq))
        leftover = [n for n in os.listdir(SHM_DIR) if any(t in n for t in tokens)]
        assert leftover == []  # unlinked once the unit mapped them
    assert [u["shm_arenas"] for u in _unit_stats_of(service)] == [0, 0]  # detached on close


def _unit_stats_of(service: transferqueue.LocalService) -> list[dict]:
    with transferqueue.connect(service.address, shm_max_bytes=0) as tq:
        return _unit_stats(tq)


def test_concurrent_requests_to_one_unit_share_or_fall_back(tq: TransferQueue) -> None:
    client = tq.async_client()
    wants = [{"x": torch.randn(64, 2048), "k": torch.full((64,), i)} for i in range(6)]

    async def go() -> list[dict]:
        await asyncio.gather(*(client.put(w, partition=f"p{i}") for i, w in enumerate(wants)))
        metas = await asyncio.gather(
            *(
                client.get_meta("t", ["x", "k"], 64, partition=f"p{i}", timeout_s=10)
                for i in range(6)
            )
        )
        return list(await asyncio.gather(*(client.get_data(m) for m in metas)))

    got = asyncio.run(go())
    for g, w in zip(got, wants, strict=True):
        assert torch.equal(g["x"], w["x"]) and torch.equal(g["k"], w["k"])
    assert sum(u["shm_writes"] for u in _unit_stats(tq)) >= 1


def test_bad_shared_memory_references_get_errors_and_the_unit_keeps_serving(
    service: transferqueue.LocalService, tq: TransferQueue
) -> None:
    client = tq.client()
    want = _payload(32, 3)
    meta = client.put(want, group=0)
    arena = _links(tq)[0]._arena
    assert arena is not None
    arena_name = arena.name
    address = service.unit_addresses[0]

    def request(ref: bytes) -> tuple[int, object] | None:
        column = raw.tensor("float32", [16, 4096], ref)
        # Write: indexes, columns, specs, create, grant, shm
        body = [raw.int64s(list(range(16))), {"x": column}, {}, True, None, True]
        return raw.ask(sock, raw.request("write", body, rid=7))

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        # never attached: its own code, on which a client makes new arenas (unit restarted)
        assert raw.error_code(request(raw.shm("tq-0123456789abcdef-1", 0))) == "unknown_arena"
        for ref in (
            raw.shm(arena_name, 1 << 40),  # past the end of an attached arena
            raw.shm(arena_name, (1 << 64) - 64),
            raw.shm("../../etc/passwd", 0),
            raw.shm(arena_name, 0)[:-3],  # a name cut short
        ):
            assert raw.error_code(request(ref)) == "protocol"
        # the same request with a good reference decodes; it fails later (no grant)
        assert raw.error_code(request(raw.shm(arena_name, 0))) not in (None, "protocol")
        reply = raw.ask(sock, raw.request("shm_attach", ["/etc/passwd"], rid=8))
        assert raw.error_code(reply) == "protocol"

        def read(mine: object) -> tuple[int, object] | None:
            body = [raw.int64s([0]), ["ids"], None, mine]  # Read: indexes, fields, shm, mine
            return raw.ask(sock, raw.request("read", body, rid=9))

        assert raw.error_code(read(5)) == "protocol"  # 'mine' must name arenas
        assert raw.error_code(read([7, "x"])) == "protocol"
        ok = read(["tq-0123456789abcdef-1", arena_name])  # not write arenas: ignored
        assert ok is not None and ok[0] == 0
    finally:
        sock.close()
        ctx.term()
    _check(client.get_data(meta), want)  # everything stored is intact and served


def test_segments_and_placer_contract(tmp_path: Path) -> None:
    seg = Segments(str(tmp_path))
    token = new_token()
    arena = Arena(token, 1, 1 << 20, str(tmp_path))
    assert seg.attach(arena.name) == 1 << 20
    assert not (tmp_path / arena.name).exists()  # unlinked by the attaching side
    place = Placer(arena.name, arena.buf[: 256 << 10])
    a = np.arange(40_000, dtype=np.int32)
    ref = place(a.data.cast("B"))
    assert ref == [arena.name, 0]
    assert place(np.zeros(300_000, np.uint8).data) is None  # does not fit: a frame instead
    assert place.overflow == 300_000
    got = np.frombuffer(seg.resolve(arena.name, 0, a.nbytes), dtype=np.int32)
    assert np.array_equal(got, a)
    newer = Arena(token, 2, 1 << 20, str(tmp_path))
    seg.attach(newer.name)  # a new generation replaces the old mapping
    assert len(seg) == 1
    with pytest.raises(ProtocolError, match="not attached"):
        seg.resolve(arena.name, 0, 16)
    seg.detach(newer.name)
    assert len(seg) == 0
    for bad in ("tq-xyz-1", "../tq-0123456789abcdef-1", 5):
        with pytest.raises(ProtocolError):
            seg.attach(bad)  # type: ignore[arg-type]
    arena.close()
    newer.close()


def test_wire_refuses_shared_memory_without_a_resolver() -> None:
    arena = Arena(new_token(), 1, 1 << 20)
    try:
        frames = wire.encode({"x": torch.randn(64, 1024)}, Placer(arena.name, arena.buf))
        assert len(frames) == 1  # the tensor went to the arena, not a frame
        with pytest.raises(ProtocolError, match="shared-memory"):
            wire.decode(frames)
        got = wire.decode(frames, resolve=arena.resolve)
        assert got["x"].data_ptr() == arena.buf.ctypes.data  # a view of the arena
    finally:
        arena.close()


# -- reads lent arenas: results are views, each arena back once its result is gone ------------
def _lent_arena_of(t: torch.Tensor, link: RemoteUnitLink) -> str | None:
    """The name of the lent arena ``t`` views, if any."""
    for loan in list(link._reads._loans.values()):
        start = loan.arena.buf.ctypes.data
        if start <= t.data_ptr() < start + loan.arena.size:
            return loan.arena.name
    return None


@pytest.fixture(scope="module")
def one_unit() -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=1) as svc:
        yield svc


@contextlib.contextmanager
def _session(
    svc: transferqueue.LocalService, partition: str, tasks: tuple[str, ...] = ("t",), **connect: int
) -> Iterator[tuple[TransferQueue, transferqueue.Client, RemoteUnitLink]]:
    """A fresh connection to the one-unit service: the handle, a client with ``tasks``
    declared on ``partition``, and the link to the unit."""
    with transferqueue.connect(svc.address, **connect) as tq:
        tq.reset()
        client = tq.client()
        client.declare_tasks(list(tasks), partition=partition)
        (link,) = _links(tq)
        yield tq, client, link


def _cycle(client: transferqueue.Client, want: dict, partition: str) -> dict:
    client.put(want, group=0, partition=partition)
    rows = len(next(iter(want.values())))
    meta = client.get_meta("t", list(want), rows, partition=partition, timeout_s=10)
    got = client.get_data(meta)
    client.ack(meta)  # the rows are freed on the unit
    return got


def test_reads_return_views_of_lent_arenas_that_later_reads_never_touch(
    one_unit: transferqueue.LocalService,
) -> None:
    with _session(one_unit, "a") as (tq, client, link):
        want = _payload(64, 4)
        kept = [_cycle(client, want, "a") for _ in range(4)]
        for got in kept[1:]:  # (the first read of a unit sizes its arenas)
            assert _lent_arena_of(got["x"], link) is not None  # a view: no copy on this side
        # ragged values come back as views of the write arena they were written from, which
        # is not lent again while they are held
        assert all(_lent_arena_of(g["ids"].values, link) is None for g in kept)
        assert len(link._writes._holds) == len(kept) == len(link._writes._arenas)
        lent = [_lent_arena_of(g["x"], link) for g in kept[1:]]
        assert len(set(lent)) == len(lent)  # a held result's arena is never lent again
        for got in kept:  # results held while later reads ran are intact
            _check(got, want)
        del got, kept
        gc.collect()
        assert link._reads._loans == {}  # every arena is back once its results are gone
        assert link._writes._holds == {}
        pooled = len(link._reads._free)
        writes = len(link._writes._arenas)
        for _ in range(10):  # steady state: results dropped between reads reuse the arenas
            _check(_cycle(client, want, "a"), want)
        assert len(link._reads._free) + len(link._reads._loans) == pooled
        # writes (ragged) went through write arenas, each lent again once its rows were freed
        # and no result viewed it
        assert len(link._writes._arenas) == writes == 4 and link._arena is None
        assert _unit_stats(tq)[0]["shm_arenas"] == writes + pooled


def test_reads_past_the_lending_bound_are_copied_and_intact(
    one_unit: transferqueue.LocalService,
) -> None:
    """With every arena still viewed by held results, a read copies instead; nothing held is
    ever overwritten."""
    with _session(one_unit, "b", shm_max_bytes=32 << 20) as (_, client, link):
        want = {"x": torch.randn(768, 4096)}  # 12 MiB: 16 MiB arenas, two fit the bound
        held = [_cycle(client, want, "b") for _ in range(5)]
        assert link._reads.bytes == 32 << 20
        assert sum(_lent_arena_of(g["x"], link) is not None for g in held) == 2
        for got in held:
            assert torch.equal(got["x"], want["x"])


def test_a_loan_ends_when_its_last_view_is_gone_on_any_thread() -> None:
    arena = Arena(new_token(), 1, 1 << 20)
    pool = ReadArenas(2 << 20)
    try:
        first = pool.add(arena)
        assert pool.lend(1) is None  # lent: not free
        t = torch.frombuffer(first.view(0, 4096), dtype=torch.float32)
        part = t[10:20]
        first.seal(reusable=True)
        del t
        assert pool.loan(arena.name) is first  # a view of it is still alive
        done = threading.Event()

        def drop() -> None:
            nonlocal part
            del part
            done.set()

        threading.Thread(target=drop).start()
        assert done.wait(5)
        assert pool.loan(arena.name) is None
        again = pool.lend(1 << 20)
        assert again is not None and again.arena is arena  # back in the pool, reused
        again.seal(reusable=False)  # e.g. the read timed out: the unit may still write
        assert pool.lend(1) is None
        assert pool.retired() == [arena]  # never lent again: for the caller to detach
        assert not pool.room_for(4 << 20) and pool.room_for(2 << 20)
    finally:
        arena.close()


def test_arrays_decoded_from_shared_memory_are_copies() -> None:
    """numpy does not keep a lent view's object alive, so arrays are copied (tensors are not)."""
    arena = Arena(new_token(), 1, 1 << 20)
    try:
        a = np.arange(32_768, dtype=np.int64)
        frames = wire.encode({"a": a, "t": torch.arange(32_768)}, Placer(arena.name, arena.buf))
        assert len(frames) == 1
        got = wire.decode(frames, resolve=arena.resolve)
        assert np.array_equal(got["a"], a) and got["a"].flags.owndata
        assert arena.buf.ctypes.data <= got["t"].data_ptr() < arena.buf.ctypes.data + arena.size
    finally:
        arena.close()


class _SilentUnit:
    """An RpcClient stand-in: attaches arenas, then never answers reads or writes in time."""

    def __init__(self) -> None:
        self.resolve = None
        self.detached: list[str] = []

    async def call(self, msg: protocol.Request, **_: object) -> object:
        if isinstance(msg, m.ShmAttach):
            return 1
        if isinstance(msg, m.ShmDetach):
            self.detached.append(msg.name)
            return None
        raise PeerGoneError(f"no answer to {msg.kind!r}")


def test_a_request_that_got_no_answer_never_reuses_its_arena() -> None:
    """A unit that timed out may still write into the arena the request named later: that
    arena is never used again (a request arena is dropped, a read arena retired)."""

    async def go() -> None:
        rpc = _SilentUnit()
        link = RemoteUnitLink(0, rpc)  # type: ignore[arg-type]
        link._read_hint = 4 << 20
        with pytest.raises(PeerGoneError):
            await link.read(np.arange(4), ["x"])
        assert link._reads._loans == {} and link._reads._free == []
        await link._detach_retired()
        assert len(rpc.detached) == 1  # the read arena is gone from the unit and from here
        cols = {"x": torch.randn(64, 4096)}
        with pytest.raises(PeerGoneError):
            spec = FieldSpec.dense(torch.float32, (4096,))
            await link.write(np.arange(64), cols, {"x": spec}, create=True)
        assert link._arena is None  # the request arena is dropped, never reused
        await link.close()

    asyncio.run(go())


def test_arena_files_of_dead_clients_that_no_unit_mapped_are_swept(tmp_path: Path) -> None:
    """A client killed between making an arena and a unit mapping it leaves the file: units
    remove such files once their creator (named in the token) is gone and they are old."""
    import subprocess
    import sys

    from transferqueue.storage.shm import sweep_orphans

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = Arena(new_token(), 1, 4096, str(tmp_path))  # this process: alive
    orphan = tmp_path / f"tq-{dead.pid & 0xFFFFFFFF:08x}{'ab' * 4}-1"
    orphan.write_bytes(b"\0" * 4096)
    other = tmp_path / "not-an-arena"
    other.write_bytes(b"x")
    assert sweep_orphans(str(tmp_path), min_age_s=3600) == 0  # too young yet
    assert sweep_orphans(str(tmp_path), min_age_s=0) == 1
    assert not orphan.exists() and other.exists()
    assert (tmp_path / mine.name).exists()  # its creator lives
    mine.close()


def test_shaped_columns_go_through_shared_memory_bit_exact(tq: TransferQueue) -> None:
    """Images of varying height and width: values through the arena, shapes beside."""
    from transferqueue import Shaped

    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(300, 600, (8, 2), generator=g).tolist()  # > 1 MiB per unit
    imgs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]
    client = tq.client()
    client.put({"img": imgs})
    got = client.get_data(client.get_meta("t", ["img"], 8, timeout_s=10))["img"]
    assert isinstance(got, Shaped)
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), imgs, strict=True))
    units = _unit_stats(tq)
    assert sum(u["shm_writes"] for u in units) >= 2  # spread over both units, no frames
    assert sum(u["shm_reads"] for u in units) >= 2
