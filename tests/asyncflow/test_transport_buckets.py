"""Weights published a bucket at a time (``publish_stream``: how a sharded trainer publishes),
on every transport, and the sync times every sender records.

``shm`` and ``ipc`` take the buckets as they come (``BucketSender``); the others get them
collected. Receivers get the same bytes as from a whole ``publish``; the bucket iterator is
always run to its end (each bucket is a collective gather on every trainer rank), even when
the publish fails. ``ipc`` runs over shared files here (``sharer="file"``; the CUDA IPC
handles are exercised by tests/asyncflow/test_transport_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch

from asyncflow.transport import (
    BucketSender,
    SyncTimes,
    WeightTransport,
    make_transport,
    publish_stream,
)
from engines.weights_io import StateSpec
from tests.asyncflow.test_transport import (
    FAST,
    NAMES,
    Host,
    awkward_state,
    check_same,
    hosts,  # noqa: F401 (a fixture)
    shm_files,
    tied,
    wait_until,
)


def as_buckets(
    state: Mapping[str, torch.Tensor], bucket_bytes: int
) -> tuple[list[StateSpec], list[dict[str, torch.Tensor]]]:
    """``state`` as a sharded trainer would hand it out: specs (tied names grouped) and
    buckets of at most ``bucket_bytes`` (or one tensor)."""
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in state.items():
        key = t.data_ptr() if t.numel() else id(t)
        groups.setdefault(key, []).append(name)
        tensors[key] = t
    specs = [
        StateSpec(tuple(names), tuple(tensors[k].shape), tensors[k].dtype)
        for k, names in groups.items()
    ]
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, names in groups.items():
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1].update(dict.fromkeys(names, tensors[k]))
        size += nbytes
    return specs, buckets


class Counted:
    """An iterator over buckets that counts what was taken."""

    def __init__(self, buckets: list[dict[str, torch.Tensor]]) -> None:
        self.buckets = buckets
        self.taken = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for bucket in self.buckets:
            self.taken += 1
            yield bucket


@pytest.fixture(params=NAMES)
def transport(request: pytest.FixtureRequest) -> WeightTransport:
    return make_transport(request.param, **FAST[request.param])


def test_buckets_arrive_as_a_whole_publish_would(transport: WeightTransport) -> None:
    sender = transport.sender()
    receiver = transport.receiver("r")
    try:
        wait_until(lambda: sender.members() == ["r"], why="the receiver to join")
        assert isinstance(sender, BucketSender) == (transport.name in ("shm", "ipc"))
        for version in range(2):
            state = awkward_state(version)
            specs, buckets = as_buckets(state, bucket_bytes=4096)
            assert len(buckets) > 3
            counted = Counted(buckets)
            publish_stream(sender, specs, counted, version)
            assert counted.taken == len(buckets)
            assert receiver.newest() == version  # publish returned: it holds it
            got = receiver.get(version)
            check_same(got, state)
            if transport.name != "inprocess":
                assert tied(got)
            receiver.release(version)
            sync = sender.last_sync  # type: ignore[attr-defined]
            assert isinstance(sync, SyncTimes) and sync.version == version
            assert 0 <= sync.transfer_s <= sync.publish_s
            assert sync.nbytes >= sum(t.numel() * t.element_size() for t in state.values()) - (
                state["embed.weight"].numel() * 4  # tied: counted once
            )
    finally:
        receiver.close()
        sender.close()
    assert not shm_files()


@pytest.mark.parametrize("name", ["shm", "ipc"])
def test_a_failed_bucket_publish_still_runs_every_bucket(name: str) -> None:
    """A bucket the sender refuses (a tensor the specs lack) fails the publish, after the
    iterator ran to its end (each bucket is a collective on every trainer rank); the receiver
    keeps its version and nothing is left behind."""
    transport = make_transport(name, **FAST[name])
    sender = transport.sender()
    receiver = transport.receiver("r")
    try:
        wait_until(lambda: sender.members() == ["r"], why="the receiver to join")
        state = awkward_state(0)
        specs, buckets = as_buckets(state, bucket_bytes=4096)
        publish_stream(sender, specs, buckets, 0)
        buckets[1] = {**buckets[1], "stray": torch.ones(3)}
        counted = Counted(buckets)
        with pytest.raises(ValueError, match="stray"):
            publish_stream(sender, specs, counted, 1)
        assert counted.taken == len(buckets)
        assert receiver.newest() == 0
        check_same(receiver.get(0), state)
        receiver.release(0)
    finally:
        receiver.close()
        sender.close()
    assert not shm_files()


@pytest.mark.service
def test_ipc_buckets_in_processes_newcomer_served_by_a_holder(
    hosts: list[Host],  # noqa: F811 (the fixture)
) -> None:
    """Receivers in processes of their own copy each bucket into their own image; a newcomer
    copies the newest version from a holder's image (the sender keeps no copy); after the
    holder dies, the next streamed version reaches the others."""
    transport = make_transport("ipc", **FAST["ipc"])
    sender = transport.sender()
    try:
        a, b = Host(transport, "a"), Host(transport, "b")
        hosts += [a, b]
        wait_until(lambda: set(sender.members()) == {"a", "b"}, why="a and b to join")
        states = [awkward_state(seed) for seed in range(2)]
        publish_stream(sender, *as_buckets(states[0], 4096), 0)
        for host in (a, b):
            assert host.newest_after(-1) == 0
            got, is_tied = host.ask("get", 0)
            check_same(got, states[0])
            assert is_tied
        c = Host(transport, "c")
        hosts.append(c)
        assert c.newest_after(-1) == 0
        check_same(c.ask("get", 0)[0], states[0])
        a.kill()
        wait_until(lambda: set(sender.members()) == {"b", "c"}, why="a to be dropped")
        publish_stream(sender, *as_buckets(states[1], 4096), 1)
        for host in (b, c):
            assert host.newest_after(0) == 1
            check_same(host.ask("get", 1)[0], states[1])
            host.close()
    finally:
        sender.close()
    assert not shm_files()
