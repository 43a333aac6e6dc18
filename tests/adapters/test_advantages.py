"""GRPO advantages at the edges: no verdicts (None / NaN), short groups, equal rewards, mixes.

``group_advantages`` normalizes within each group: ``(r - mean) / (std + eps)`` over the
group's valid (non-NaN) rewards, population std; a NaN reward, and every reward of a group
with fewer than two valid ones, gets 0. The expected values below are worked out by hand.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from adapters import RewardAdapter
from adapters.train import _newest_versions, group_advantages, tied_groups
from transferqueue import BatchMeta, Ragged

EPS = 1e-6
NAN = math.nan


def _adv(rewards: Sequence[float], groups: Sequence[int]) -> list[float]:
    out = group_advantages(torch.tensor(rewards, dtype=torch.float32), np.asarray(groups))
    assert out.dtype == torch.float32 and out.shape == (len(rewards),)
    assert bool(torch.isfinite(out).all()), out  # never NaN or inf, whatever the rewards
    return out.tolist()


def test_two_valued_group_is_plus_minus_one() -> None:
    # mean 0.5, population std 0.5: every sample is one std from the mean
    one = 0.5 / (0.5 + EPS)
    assert _adv([1, 0, 0, 1], [0] * 4) == pytest.approx([one, -one, -one, one], abs=1e-7)


def test_nan_reward_gets_zero_and_is_left_out_of_the_statistics() -> None:
    # valid 1, 0, 0: mean 1/3, std sqrt(2)/3 (the NaN counts neither in mean nor in std)
    std = math.sqrt(2) / 3
    want = [(2 / 3) / (std + EPS), 0.0, (-1 / 3) / (std + EPS), (-1 / 3) / (std + EPS)]
    assert _adv([1, NAN, 0, 0], [5] * 4) == pytest.approx(want, abs=1e-6)
    assert want[0] == pytest.approx(math.sqrt(2), rel=1e-5)  # (sanity of the hand algebra)


@pytest.mark.parametrize(
    "rewards",
    [[NAN, 0.7, NAN], [NAN, NAN, NAN, NAN], [0.3]],
    ids=["one-valid", "no-valid", "single-sample"],
)
def test_group_with_fewer_than_two_valid_rewards_gets_zeros(rewards: list[float]) -> None:
    # one verdict carries no relative information: even the valid sample gets 0
    assert _adv(rewards, [2] * len(rewards)) == [0.0] * len(rewards)


def test_equal_rewards_give_exact_zeros_not_nan() -> None:
    # std 0: (r - mean) is exactly 0, so eps only keeps 0 / 0 away
    assert _adv([0.5] * 4, [1] * 4) == [0.0] * 4
    assert _adv([1.0, 1.0, NAN, 1.0], [1] * 4) == [0.0] * 4


def test_interleaved_groups_are_normalized_separately() -> None:
    groups = [3, 7, 3, 7, 9, 9, 4, 4, 4]
    rewards = [1, 2, 0, 2, NAN, 5, 3, 0, NAN]
    one = 0.5 / (0.5 + EPS)  # group 3: {1, 0}
    three = 1.5 / (1.5 + EPS)  # group 4: {3, 0} (the NaN left out)
    want = [one, 0.0, -one, 0.0, 0.0, 0.0, three, -three, 0.0]
    # group 7: equal rewards; group 9: a single verdict
    got = _adv(rewards, groups)
    assert got == pytest.approx(want, abs=1e-6)
    # the result does not depend on where the rows of a group sit in the batch
    perm = [8, 2, 5, 0, 7, 3, 1, 6, 4]
    shuffled = _adv([rewards[i] for i in perm], [groups[i] for i in perm])
    assert shuffled == pytest.approx([want[i] for i in perm], abs=1e-6)


def test_none_from_the_reward_function_becomes_nan_then_zero_advantage() -> None:
    """The reward stage writes None ("no verdict") as NaN; training gives it advantage 0."""

    class _Chars:  # decodes token ids as characters: enough for the reward adapter
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    def reward(prompts: list[str], completions: list[str], **cols: list[str]) -> list[float | None]:
        return [
            None if c == "a" else float(c == ans)
            for c, ans in zip(completions, cols["answer"], strict=True)
        ]

    adapter = RewardAdapter(reward, _Chars(), columns=("answer",))  # type: ignore[arg-type]
    idx = np.arange(4)
    meta = BatchMeta(idx, idx * 0, np.zeros(4, dtype=np.int64), idx * 0, idx * 0 + 2, "p")
    cols = {
        "prompt": ["q"] * 4,
        "response_ids": Ragged.from_tensors([torch.tensor([i]) for i in (1, 0, 2, 1)]),
        "answer": ["b"] * 4,
    }
    out = asyncio.run(adapter.process(meta, cols))
    values = out.columns["reward"]
    assert values.dtype == torch.float32
    assert values[0] == 1.0 and math.isnan(values[1]) and values[2] == 0.0 and values[3] == 1.0
    assert out.metrics == {"reward_mean": pytest.approx(2 / 3)}  # the None left out
    # valid {1, 0, 1}: mean 2/3, std sqrt(2)/3
    std = math.sqrt(2) / 3
    up, down = (1 / 3) / (std + EPS), (-2 / 3) / (std + EPS)
    assert _adv(values.tolist(), [0] * 4) == pytest.approx([up, 0.0, down, up], abs=1e-6)


def _per_group_reference(rewards: torch.Tensor, groups: np.ndarray) -> torch.Tensor:
    """The definition, one group at a time (what the whole-column version must equal)."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in np.unique(groups).tolist():
        idx = torch.from_numpy(np.flatnonzero(groups == g))
        r = rewards[idx].float()
        ok = ~r.isnan()
        if int(ok.sum()) < 2:
            continue
        mean, std = r[ok].mean(), r[ok].std(unbiased=False)
        adv[idx] = torch.where(ok, (r - mean) / (std + 1e-6), torch.zeros_like(r))
    return adv


@pytest.mark.parametrize("seed", range(6))
def test_whole_column_advantages_equal_the_per_group_definition(seed: int) -> None:
    """Random group ids (shuffled, sizes 1-9), rewards with ties, NaNs and infinities-free
    values: every advantage equals the per-group definition (float rounding only), and a
    group's tie verdict equals its definition."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 10, size=12)
    groups = np.repeat(rng.permutation(100)[:12] + 1000, sizes)
    order = rng.permutation(groups.size)
    groups = groups[order]
    rewards = torch.from_numpy(rng.choice([0.0, 0.5, 1.0, 0.25], size=groups.size)).float()
    rewards[torch.from_numpy(rng.random(groups.size) < 0.15)] = float("nan")
    got = group_advantages(rewards, groups)
    want = _per_group_reference(rewards, groups)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert not got.isnan().any()
    tied = set(tied_groups(rewards, groups))
    for g in np.unique(groups).tolist():
        r = rewards[torch.from_numpy(np.flatnonzero(groups == g))]
        r = r[torch.isfinite(r)]
        assert (g in tied) == (r.numel() < 2 or bool((r == r[0]).all())), g


def test_newest_version_per_row_with_observations_and_empty_rows() -> None:
    """The newest generated token's version per row: -1 (observation) tokens never count, a
    row without a generated token (empty, or only observations) keeps its oldest version,
    empty rows first, in the middle and last."""
    rows = [[], [3, 4, -1, 2], [-1, -1], [], [7], [5, -1, 6, 6], []]
    col = Ragged.from_lists(rows, torch.int32)
    oldest = np.array([9, 1, 4, 8, 7, 2, 6], dtype=np.int64)
    pairs = zip(rows, oldest, strict=True)
    want = [max((v for v in r if v >= 0), default=int(o)) for r, o in pairs]
    assert _newest_versions(col, oldest) == want == [9, 4, 4, 8, 7, 6, 6]
    assert _newest_versions(Ragged.from_lists([], torch.int64), oldest[:0]) == []
