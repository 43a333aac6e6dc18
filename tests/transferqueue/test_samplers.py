"""Samplers: whole groups, balanced ranks, oldest version first, min_version drops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transferqueue import Client, TQError
from transferqueue.controller.samplers import get_sampler, sampler_names
from transferqueue.meta import balance_lengths


def test_group_sampler_never_splits_a_group(client: Client) -> None:
    rng = np.random.default_rng(1)
    gs, groups = 4, 30
    gids = np.repeat(np.arange(groups), gs)
    client.put({"prompt": torch.zeros(len(gids))}, group=gids)
    gen = client.get_meta("gen", ["prompt"], len(gids), timeout_s=1)
    trained = []
    # responses land in a random order, a few rows at a time (sub-batches of the lease)
    for chunk in np.array_split(rng.permutation(len(gids)), 17):
        client.put({"resp": torch.ones(len(chunk))}, meta=gen.select(np.sort(chunk)))
        while True:
            batch = client.get_meta(
                "train", ["resp"], 8, sampler="group", group_size=gs, timeout_s=0
            )
            if not len(batch):
                break
            counts = np.unique(batch.groups, return_counts=True)[1]
            assert (counts == gs).all(), f"split group in {batch.groups}"
            trained += batch.groups.tolist()
            client.ack(batch)
    assert sorted(trained) == sorted(gids.tolist())


def test_group_sampler_rejects_batch_smaller_than_group(client: Client) -> None:
    client.put({"x": torch.zeros(4)}, group=0)
    with pytest.raises(ValueError, match="group_size"):
        client.get_meta("t", ["x"], 2, sampler="group", group_size=4, timeout_s=0)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100_000), min_size=1, max_size=300),
    parts=st.integers(1, 8),
)
def test_balance_lengths_is_a_partition_with_equal_counts(lengths: list[int], parts: int) -> None:
    split = balance_lengths(np.array(lengths), parts)
    allpos = np.sort(np.concatenate(split))
    assert allpos.tolist() == list(range(len(lengths)))
    sizes = [p.size for p in split]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("seed", range(5))
def test_length_balanced_split_within_10_percent_on_skewed_lengths(
    client: Client, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    n, dp = 256, 4
    lengths = np.clip(rng.lognormal(6.0, 1.0, n), 16, 8192).astype(np.int64)  # long tail
    client.put({"x": torch.zeros(n)}, group=np.arange(n), length=lengths)
    meta = client.get_meta("train", ["x"], n, sampler="balanced", dp_size=dp, timeout_s=1)
    parts = meta.split()
    assert len(parts) == dp and sum(len(p) for p in parts) == n
    totals = np.array([int(p.lengths.sum()) for p in parts])
    assert totals.max() / totals.min() <= 1.10, totals
    # a naive contiguous split of the same batch is far worse (what the sampler is for)
    naive = np.array([c.sum() for c in np.array_split(meta.lengths, dp)])
    assert naive.max() / naive.min() > totals.max() / totals.min()


def test_balanced_whole_groups_in_a_window_split_across_ranks(client: Client) -> None:
    """What data-parallel training leases: whole groups of the step's window only (group
    order, ``max_group``), every rank a share of equal rows."""
    gs, dp = 4, 2
    gids = np.repeat(np.arange(6), gs)
    lengths = np.arange(len(gids)) * 7 + 1
    client.put({"x": torch.zeros(len(gids))}, group=gids, length=lengths)
    taken: list[int] = []
    for window_end in (1, 3, 5):  # three steps of two groups each
        meta = client.get_meta(
            "train",
            ["x"],
            2 * gs,
            sampler="balanced",
            dp_size=dp,
            group_size=gs,
            order="group",
            max_group=window_end,
            timeout_s=1,
        )
        assert sorted(set(meta.groups.tolist())) == [window_end - 1, window_end]
        parts = meta.split()
        assert [len(p) for p in parts] == [gs, gs]
        assert sorted(np.concatenate([p.indexes for p in parts]).tolist()) == sorted(
            meta.indexes.tolist()
        )
        taken += meta.groups.tolist()
        client.ack(meta)
    assert sorted(taken) == sorted(gids.tolist())
    with pytest.raises((TypeError, TQError), match=r"takes no options \['colour'\]"):
        client.get_meta("other", ["x"], 8, sampler="balanced", dp_size=2, colour="red")


def test_fifo_serves_oldest_version_first(client: Client) -> None:
    for v in (3, 1, 2, 0):
        client.put({"x": torch.full((4,), v)}, group=0, version=v)
    got = []
    for _ in range(4):
        meta = client.get_meta("t", ["x"], 4, timeout_s=1)
        got.append(sorted(set(meta.versions.tolist())))
        client.ack(meta)
    assert got == [[0], [1], [2], [3]]


def test_min_version_drops_stale_rows_and_counts_them(client: Client) -> None:
    client.put({"x": torch.zeros(6)}, group=0, version=[0, 0, 1, 1, 2, 2])
    meta = client.get_meta("t", ["x"], 6, min_version=1, timeout_s=0.1)
    assert sorted(meta.versions.tolist()) == [1, 1, 2, 2]
    stats = client.stats()["controller"]["partitions"]["default"]["tasks"]["t"]
    assert stats["dropped"] == 2 and stats["leased"] == 4


def test_registry_lists_known_samplers_on_unknown_name(client: Client) -> None:
    assert {"fifo", "group", "balanced"} <= set(sampler_names())
    with pytest.raises(ValueError, match="known samplers: balanced, fifo, group"):
        get_sampler("nope")
    client.put({"x": torch.zeros(1)}, group=0)
    with pytest.raises(ValueError, match="unknown sampler"):
        client.get_meta("t", ["x"], 1, sampler="nope", timeout_s=0)


def test_group_order_with_max_group_serves_windows_in_any_completion_order(
    client: Client,
) -> None:
    gs, per_step = 2, 3
    gids = np.repeat(np.arange(9), gs)  # three windows of three groups
    client.put({"p": torch.zeros(len(gids))}, group=gids)
    gen = client.get_meta("gen", ["p"], len(gids), timeout_s=1)
    # groups of the second window complete first, then the first window in reverse
    order = [3, 4, 5, 2, 1, 0, 8, 7, 6]
    for g in order:
        client.put({"r": torch.ones(gs)}, meta=gen.select(np.flatnonzero(gen.groups == g)))
    for step in range(3):
        window = (step + 1) * per_step - 1
        meta = client.get_meta(
            "train",
            ["r"],
            gs * per_step,
            sampler="group",
            group_size=gs,
            order="group",
            max_group=window,
            timeout_s=1,
        )
        assert meta.reason in ("full", "end")
        assert sorted(set(meta.groups.tolist())) == list(range(step * per_step, window + 1))
        client.ack(meta)
    with pytest.raises(ValueError, match="max_group needs"):
        client.get_meta("other", ["r"], 2, max_group=3, timeout_s=0)


def test_group_order_length_serves_longest_groups_first(client: Client) -> None:
    gs = 2
    lengths = [5, 50, 20, 50, 1]
    for g, ln in enumerate(lengths):
        client.put({"p": torch.zeros(gs)}, group=g, length=ln)
    got = []
    for _ in lengths:
        meta = client.get_meta(
            "gen", ["p"], gs, sampler="group", group_size=gs, order="length", timeout_s=1
        )
        assert len(set(meta.groups.tolist())) == 1
        got.append(int(meta.groups[0]))
    assert got == [1, 3, 2, 0, 4]  # longest first, ties by group id


def test_group_order_length_with_window_keeps_older_windows_first(client: Client) -> None:
    gs = 2
    lengths = [5, 50, 20, 90, 1, 70]  # windows of 3 groups: {0, 1, 2}, {3, 4, 5}
    for g, ln in enumerate(lengths):
        client.put({"p": torch.zeros(gs)}, group=g, length=ln)
    got = []
    for _ in lengths:
        meta = client.get_meta(
            "gen",
            ["p"],
            gs,
            sampler="group",
            group_size=gs,
            order="length",
            window=3,
            timeout_s=1,
        )
        got.append(int(meta.groups[0]))
    assert got == [1, 2, 0, 3, 5, 4]  # the 90 of window 2 waits for window 1's short ones
    with pytest.raises(ValueError, match="window"):
        client.get_meta("bad", ["p"], gs, sampler="group", group_size=gs, window=3, timeout_s=1)
