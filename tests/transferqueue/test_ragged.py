"""The Ragged type: views, padding, gathering."""

from __future__ import annotations

import pytest
import torch

from transferqueue import Ragged


def test_views_share_memory_and_padding_round_trips() -> None:
    rows = [torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.int64), torch.tensor([4])]
    r = Ragged.from_tensors(rows)
    views = r.unbind()
    views[0][0] = 100
    assert int(r.values[0]) == 100  # zero copy
    padded, lens = r.to_padded(pad_value=-1)
    assert padded.tolist() == [[100, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert Ragged.from_padded(padded, lens) == r


def test_take_and_slice() -> None:
    r = Ragged.from_lists([[1], [2, 3], [], [4, 5, 6]], torch.int32)
    assert [x.tolist() for x in r.take([3, 0, 2])] == [[4, 5, 6], [1], []]
    s = r.slice(1, 3)
    assert [x.tolist() for x in s] == [[2, 3], []]
    assert s.values.data_ptr() == r.values[1:].data_ptr()


def test_bad_offsets_are_rejected() -> None:
    with pytest.raises(ValueError, match="end at len"):
        Ragged(torch.zeros(3), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        Ragged(torch.zeros(3), torch.tensor([0, 2, 1, 3]))


def test_equality_is_bitwise() -> None:
    a = Ragged.from_tensors([torch.tensor([float("nan"), 0.0])])
    b = Ragged.from_tensors([torch.tensor([float("nan"), 0.0])])
    c = Ragged.from_tensors([torch.tensor([float("nan"), -0.0])])
    assert a == b and a != c
