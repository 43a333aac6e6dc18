"""The rollout's episode columns."""

from __future__ import annotations

import torch

from adapters.episodes import episode_columns, single_turn_columns
from engines.episodes import Episode
from engines.protocols import Generation


def test_single_turn_columns_equal_the_episode_path() -> None:
    """The rollout's one-turn fast path writes exactly what ``Episode.single`` rows would:
    values, dtypes and shapes, for stops, length cuts, an empty response and a response
    spanning two versions (a partial rollout)."""
    gens = [
        Generation(torch.tensor([5, 6, 2]), torch.tensor([-0.5, -0.25, -1.0]), "stop", 3),
        Generation(torch.tensor([7, 8]), torch.tensor([-0.125, -2.0]), "length", 4),
        Generation(torch.tensor([], dtype=torch.long), torch.tensor([]), "stop", 2),
        Generation(
            torch.tensor([9, 10, 11]),
            torch.tensor([-0.1, -0.2, -0.3]),
            "length",
            token_versions=torch.tensor([5, 5, 6]),
        ),
    ]
    fast = single_turn_columns(gens)
    slow = episode_columns([Episode.single(g) for g in gens])
    assert fast.keys() == slow.keys()
    for key, want in slow.items():
        got = fast[key]
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()), key
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), key
        elif want and isinstance(want[0], torch.Tensor):
            assert len(got) == len(want), key
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape, key
                assert torch.equal(g.nan_to_num(), w.nan_to_num()), key
                assert torch.equal(g.isnan(), w.isnan()) if g.is_floating_point() else True
        else:
            assert got == want, key
