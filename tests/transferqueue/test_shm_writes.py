"""Same-host shared memory for writes: ragged values the unit keeps as views of the client's
write arenas until their rows are gone, and puts staged into a write arena while the
controller allocates their rows (see :mod:`transferqueue.storage.shm` and
:mod:`transferqueue.client.unit_link`). Reads, request arenas and hostile references:
``test_shm.py``."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_shm import _check, _cycle, _lent_arena_of, _links, _payload, _session

import transferqueue
from transferqueue import FieldSpec, Ragged
from transferqueue.aio import within
from transferqueue.client.unit_link import RemoteUnitLink
from transferqueue.errors import UnknownRowError
from transferqueue.storage.shm import shm_available
from transferqueue.wire import messages as m

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not shm_available(), reason="no writable /dev/shm on this host"),
]


@pytest.fixture(scope="module")
def one_unit() -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=1) as svc:
        yield svc


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
        real_stage = link._stage
        allocated = _watch_allocations(client)

        async def failing_stage(columns: dict) -> object:
            staged = await real_stage(columns)
            await within(allocated.wait(), 60)  # the rows are allocated meanwhile
            assert staged is not None
            link._writes.unlend(staged.arena)
            raise RuntimeError("staging failed")

        link._stage = failing_stage  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError, match="staging failed"):
            client.put(want, group=0, partition="sf")
        link._stage = real_stage  # type: ignore[method-assign]
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
        real_stage = link._stage
        reply = asyncio.Event()  # the allocation's reply reaches the put only once this is set

        async def late(_: Any) -> None:
            await reply.wait()

        async def failing_stage(columns: dict) -> object:
            staged = await real_stage(columns)
            assert staged is not None
            link._writes.unlend(staged.arena)
            asyncio.get_running_loop().call_soon(reply.set)  # just after the failure
            raise RuntimeError("staging failed")

        ctl = client.async_client._ctl
        real_call = _on_allocate(client, late)
        link._stage = failing_stage  # type: ignore[method-assign,assignment]
        with pytest.raises(RuntimeError, match="staging failed"):
            client.put(want, group=0, partition="sf2")
        ctl.call, link._stage = real_call, real_stage  # type: ignore[method-assign]
        assert client.stats()["controller"]["partitions"]["sf2"]["rows_live"] == 0


def test_a_reply_counts_only_the_bytes_it_must_copy() -> None:
    """A unit encodes a large read reply off its loop only when it copies: values lying in
    the reader's own write arenas are named where they lie (no copy, no thread hop)."""
    from transferqueue.client.links import nbytes_to_copy

    arena = torch.zeros(1 << 20, dtype=torch.uint8)
    ranges = [("arena", arena.data_ptr(), arena.numel())]
    inside = Ragged(arena[4096 : 4096 + 1000], torch.tensor([0, 400, 1000]))
    outside = Ragged(torch.zeros(1000, dtype=torch.uint8), torch.tensor([0, 400, 1000]))
    across = arena[-10:].clone()  # (a copy: elsewhere)
    assert nbytes_to_copy(inside, ranges) == 0  # (its offsets are small: inline)
    assert nbytes_to_copy(outside, ranges) == 1000
    assert nbytes_to_copy(arena[:512], ranges) == 0
    assert nbytes_to_copy(across, ranges) == 10
    assert nbytes_to_copy(inside, []) == 1000
    assert nbytes_to_copy(["objects"], ranges) == 0
