"""``engines.packed``: prompts and generations through a few flat arrays, bit-exact."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from engines.packed import pack_generations, pack_prompts, unpack_generations, unpack_prompts
from engines.protocols import Generation


def _gens() -> list[Generation]:
    g = torch.Generator().manual_seed(0)
    return [
        Generation(torch.tensor([5, 6, 7]), torch.randn(3, generator=g), "stop", version=2),
        Generation(torch.zeros(0, dtype=torch.int64), torch.zeros(0), "length", version=3),
        Generation(  # a partial rollout: versions change mid-response
            torch.tensor([9, 1]),
            torch.tensor([-0.5, float("-inf")]),
            "abort",
            token_versions=torch.tensor([3, 4]),
        ),
    ]


def test_generations_round_trip_bit_exact_through_a_pickle_of_read_only_arrays() -> None:
    gens = _gens()
    packed = pickle.loads(pickle.dumps(pack_generations(gens)))
    for a in packed:
        if isinstance(a, np.ndarray):
            a.flags.writeable = False  # as a buffer shared by another process arrives
    back = unpack_generations(packed)
    assert len(back) == len(gens)
    for a, b in zip(gens, back, strict=True):
        assert torch.equal(a.token_ids, b.token_ids) and b.token_ids.dtype == torch.int64
        assert a.logprobs.numpy().tobytes() == b.logprobs.numpy().tobytes()  # NaN/inf bits too
        assert torch.equal(a.token_versions, b.token_versions)
        assert (a.finish_reason, a.version) == (b.finish_reason, b.version)
        b.token_ids.add_(1)  # writable: the read-only arrays were copied
    assert back[2].version == 3 and back[1].version == 3  # oldest token; the engine's if empty
    assert unpack_generations(pack_generations([])) == []


def test_prompts_round_trip_and_a_bad_prompt_names_its_index() -> None:
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4], dtype=torch.int32)]
    flat, lengths = pack_prompts(prompts)
    back = unpack_prompts(flat, lengths)
    assert [p.tolist() for p in back] == [[1, 2, 3], [4]]
    assert all(p.dtype == torch.int64 for p in back)
    assert unpack_prompts(*pack_prompts([])) == []
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty 1-D"):
        pack_prompts([torch.tensor([1]), torch.zeros((2, 2), dtype=torch.int64)])
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty 1-D"):
        pack_prompts([torch.zeros(0, dtype=torch.int64)])
