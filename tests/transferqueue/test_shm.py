"""Same-host shared memory between clients and storage units: bit-exact data through the
arena, fallback to frames, arena growth, nothing left in /dev/shm, bad references refused."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rawwire as raw
import torch
import zmq

import transferqueue
from transferqueue import FieldSpec, ProtocolError, Ragged, TransferQueue, wire
from transferqueue import messages as m
from transferqueue.aio import within
from transferqueue.errors import PeerGoneError, UnknownRowError
from transferqueue.remote import RemoteUnitLink
from transferqueue.shm import (
    SHM_DIR,
    Arena,
    Placer,
    ReadArenas,
    Segments,
    new_token,
    shm_available,
)

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

    async def call(self, msg: m.Request, **_: object) -> object:
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


# -- write arenas: the unit keeps ragged values as views of them until the rows are gone -----
def _kept(link: RemoteUnitLink) -> list[str]:
    """Write arenas the unit still holds views of (flag set)."""
    return [a.name for a in link._writes._arenas if a.buf[0] != 0]


def _wait_released(link: RemoteUnitLink, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s  # (rows are freed on the unit after the ack)
    while _kept(link) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _kept(link) == []


def test_ragged_writes_stay_in_write_arenas_until_their_rows_are_freed(
    one_unit: transferqueue.LocalService,
) -> None:
    with _session(one_unit, "w") as (_, client, link):
        held = [_payload(96, seed) for seed in range(3)]
        for want in held:
            client.put(want, group=0, partition="w")
        # each put is kept in an arena of its own: no copy on the unit, no arena reused
        assert len(_kept(link)) == 3 and link._arena is None
        metas = [client.get_meta("t", list(held[0]), 96, partition="w", timeout_s=10)]
        metas += [client.get_meta("t", list(held[0]), 96, partition="w", timeout_s=10)]
        client.put(_payload(96, 9), group=0, partition="w")  # while those rows still live
        assert len(_kept(link)) == 4
        for meta, want in zip(metas, held, strict=False):
            _check(client.get_data(meta), want)
            client.ack(meta)
        rest = client.get_meta("t", list(held[0]), 192, partition="w", timeout_s=10)
        client.ack(rest)
        _wait_released(link)  # every row freed: the unit let go of every arena
        names = {a.name for a in link._writes._arenas}
        for seed in range(5):  # steady state: the arenas are lent again, none is added
            want = _payload(96, 20 + seed)
            got = _cycle(client, want, "w")
            _check(got, want)
        assert {a.name for a in link._writes._arenas} == names


def test_rows_read_back_by_their_writer_are_private_views_of_its_write_arena(
    one_unit: transferqueue.LocalService,
) -> None:
    """A read of ragged rows this client wrote returns views of its own write arena (no copy
    on either side); changing them in place changes nothing stored and no other result."""
    with _session(one_unit, "own", tasks=("t", "u")) as (_, client, link):
        want = _payload(64, 3)
        client.put(want, group=0, partition="own")
        meta = client.get_meta("t", list(want), 64, partition="own", timeout_s=10)
        got = client.get_data(meta)
        _check(got, want)
        assert _lent_arena_of(got["ids"].values, link) is None  # not copied into a read arena
        (held,) = link._writes._holds  # the write arena, held while viewed
        got["ids"].values.fill_(-1)  # the caller changes its result in place
        again = client.get_data(meta)  # the same rows, read again by the same client
        _check(again, want)
        with transferqueue.connect(one_unit.address) as other:  # another client: a copy
            o = other.client()
            theirs = o.get_meta("u", list(want), 64, partition="own", timeout_s=10)
            _check(o.get_data(theirs), want)
            o.ack(theirs)
        client.ack(meta)  # every task is done: the rows are freed on the unit
        _check(_cycle(client, _payload(64, 4), "own"), _payload(64, 4))
        more = _payload(64, 5)
        client.put(more, group=0, partition="own")  # while old views are held: another arena
        assert bool((got["ids"].values == -1).all())
        _check(again, want)
        assert held in link._writes._holds
        del got, again
        gc.collect()
        assert held not in link._writes._holds
        meta = client.get_meta("t", list(more), 64, partition="own", timeout_s=10)
        _check(client.get_data(meta), more)


def test_writes_past_the_write_arena_bound_are_copied_and_intact(
    one_unit: transferqueue.LocalService,
) -> None:
    with _session(one_unit, "v", shm_max_bytes=8 << 20) as (_, client, link):
        held = [_payload(96, seed) for seed in range(4)]  # ~2.2 MB each: 4 MiB arenas
        for want in held:
            client.put(want, group=0, partition="v")
        assert len(_kept(link)) == 2 and link._writes.bytes == 8 << 20
        assert link._arena is not None  # the others went through the request arena
        for want in held:
            meta = client.get_meta("t", list(want), 96, partition="v", timeout_s=10)
            _check(client.get_data(meta), want)
            client.ack(meta)
        _wait_released(link)


def test_a_write_the_unit_refuses_retires_its_arena_and_the_unit_lets_go(
    one_unit: transferqueue.LocalService,
) -> None:
    with transferqueue.connect(one_unit.address) as tq:
        tq.reset()
        client = tq.client()
        (link,) = _links(tq)
        ids = Ragged.from_tensors([torch.arange(300_000, dtype=torch.int32)])
        spec = FieldSpec.ragged(torch.int32)
        with pytest.raises(UnknownRowError):  # rows that were never allocated
            tq._io.run(link.write(np.array([10**9]), {"ids": ids}, {"ids": spec}, create=False))
        assert link._writes._arenas == []  # retired: never lent again
        (arena,) = link._writes._retired
        assert arena.buf[0] == 0  # the unit sealed the request and holds no view of it
        want = _payload(32, 7)
        client.declare_tasks(["t"], partition="u")
        _check(_cycle(client, want, "u"), want)  # and it keeps serving


# -- staged puts: copied into a write arena while the controller allocates their rows ---------
def test_puts_are_staged_where_the_last_put_went_while_their_rows_are_allocated() -> None:
    with (
        transferqueue.serve(num_units=1, capacity_rows=200) as svc,
        _session(svc, "st") as (_, client, link),
    ):
        first = _payload(160, 1)  # larger than the puts below: they are placed whole too
        _check(_cycle(client, first, "st"), first)
        assert link.staged_writes == 0  # nothing known yet of where this client's puts go
        held = [_payload(96, seed) for seed in (2, 3)]
        for want in held:
            client.put(want, group=0, partition="st")
        assert link.staged_writes == 2
        with pytest.raises(transferqueue.CapacityError):  # 192 rows live: no room for 96
            client.put(held[0], group=0, partition="st", timeout_s=0.2)
        assert link.staged_writes == 2  # staged, never written: the arena was given back
        for want in held:
            meta = client.get_meta("t", list(want), 96, partition="st", timeout_s=10)
            _check(client.get_data(meta), want)
            client.ack(meta)
        _wait_released(link)  # no arena is left lent to a put that never went out
        huge = {"ids": [torch.arange(n, dtype=torch.int32) for n in range(2000, 2096)]}
        huge["wide"] = torch.randn(96, 3 * 4096)  # more than any put placed whole so far
        client.declare_tasks(["t"], partition="big")
        client.put(huge, group=0, partition="big")
        assert link.staged_writes == 2
        meta = client.get_meta("t", ["ids", "wide"], 96, partition="big", timeout_s=10)
        got = client.get_data(meta)
        assert torch.equal(got["wide"], huge["wide"])
        assert all(torch.equal(a, b) for a, b in zip(got["ids"].unbind(), huge["ids"], strict=True))


def test_a_put_staged_for_one_unit_but_placed_on_another_is_written_there_intact() -> None:
    """The controller moves a producer to the least loaded unit once its own holds
    ``spread_bytes`` more: the put staged for the old unit is given back and sent anew."""
    with (
        transferqueue.serve(num_units=2, spread_bytes=3 << 20) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        client = tq.client()
        client.declare_tasks(["t"], partition="mv")
        base = _payload(96, 0)  # ~2.2 MB; then the same sizes, other values
        wants = [
            {"x": base["x"] + k, "ids": [t + k for t in base["ids"]], "tag": base["tag"]}
            for k in range(3)
        ]
        metas = [client.put(want, group=0, partition="mv") for want in wants]
        units = [int(m.units[0]) for m in metas]
        assert units[0] == units[1] != units[2]  # moved on once 4.4 MB were held
        links = _links(tq)
        assert links[units[0]].staged_writes == 1 and links[units[2]].staged_writes == 0
        for want in wants:
            meta = client.get_meta("t", list(want), 96, partition="mv", timeout_s=10)
            _check(client.get_data(meta), want)
            client.ack(meta)
        for link in links:
            _wait_released(link)


def test_a_put_whose_staging_fails_undoes_its_rows_and_gives_the_arena_back(
    one_unit: transferqueue.LocalService,
) -> None:
    with _session(one_unit, "sf") as (_, client, link):
        want = _payload(96, 7)
        _check(_cycle(client, want, "sf"), want)
        real_stage = link.stage
        allocated = _watch_allocations(client)

        async def failing_stage(columns: dict) -> object:
            staged = await real_stage(columns)
            await within(allocated.wait(), 60)  # the rows are allocated meanwhile
            link.unstage(staged)  # type: ignore[arg-type]
            raise RuntimeError("staging failed")

        link.stage = failing_stage  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="staging failed"):
            client.put(want, group=0, partition="sf")
        link.stage = real_stage  # type: ignore[method-assign]
        live = client.stats()["controller"]["partitions"]["sf"]["rows_live"]
        assert live == 0  # allocated, then undone
        _check(_cycle(client, want, "sf"), want)
        assert link.staged_writes == 1
        _wait_released(link)


def _on_allocate(client: transferqueue.Client, hook: Any) -> Any:
    """Wrap the controller link's calls so that ``await hook(reply)`` runs on every
    allocation's reply before the put sees it; returns the real ``call`` to restore."""
    ctl = client.async_client._ctl
    real_call = ctl.call

    async def call(msg: Any) -> Any:
        reply = await real_call(msg)
        if isinstance(msg, m.Allocate):
            await hook(reply)
        return reply

    ctl.call = call  # type: ignore[method-assign]
    return real_call


def _watch_allocations(client: transferqueue.Client) -> asyncio.Event:
    """An event set once the client holds the rows of its next allocation."""
    allocated = asyncio.Event()

    async def hook(_: Any) -> None:
        allocated.set()

    _on_allocate(client, hook)
    return allocated


def test_a_put_whose_staging_fails_before_its_rows_are_allocated_leaves_none(
    one_unit: transferqueue.LocalService,
) -> None:
    """The allocation's reply comes only after staging failed: the put waits for it and
    gives the rows back (it used to cancel its wait, and the rows stayed allocated)."""
    with _session(one_unit, "sf2") as (_, client, link):
        want = _payload(96, 7)
        _check(_cycle(client, want, "sf2"), want)
        real_stage = link.stage
        reply = asyncio.Event()  # the allocation's reply reaches the put only once this is set

        async def late(_: Any) -> None:
            await reply.wait()

        async def failing_stage(columns: dict) -> object:
            link.unstage(await real_stage(columns))  # type: ignore[arg-type]
            asyncio.get_running_loop().call_soon(reply.set)  # just after the failure
            raise RuntimeError("staging failed")

        ctl = client.async_client._ctl
        real_call = _on_allocate(client, late)
        link.stage = failing_stage  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="staging failed"):
            client.put(want, group=0, partition="sf2")
        ctl.call, link.stage = real_call, real_stage  # type: ignore[method-assign]
        assert client.stats()["controller"]["partitions"]["sf2"]["rows_live"] == 0


def test_arena_files_of_dead_clients_that_no_unit_mapped_are_swept(tmp_path: Path) -> None:
    """A client killed between making an arena and a unit mapping it leaves the file: units
    remove such files once their creator (named in the token) is gone and they are old."""
    import subprocess
    import sys

    from transferqueue.shm import sweep_orphans

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
