"""bench.peer's multimodal case, tiny: both runners build the same seeded batch (images whose
height and width vary per row, token ids, scalars), and ours round-trips it bit for bit."""

from __future__ import annotations

from dataclasses import replace

import torch

import transferqueue
from bench.peer_cases import CASES, case_tensors, digest, multimodal_case, unpack_rows
from bench.peer_ours import _column
from transferqueue import Ragged, Shaped


def test_multimodal_case_is_seeded_and_shaped_like_a_vision_language_batch() -> None:
    case = replace(CASES["quick"]["multimodal"], rows=4, img_lo=8, img_hi=40, lo=3, hi=9)
    cols = multimodal_case(case)
    assert digest(case_tensors(cols)) == digest(case_tensors(multimodal_case(case)))
    images = unpack_rows(cols["image"])
    assert len(images) == 4 and all(img.dtype == torch.uint8 for img in images)
    assert all(
        img.shape[0] == 3 and 8 <= min(img.shape[1:]) <= max(img.shape[1:]) <= 40 for img in images
    )
    assert len({tuple(img.shape) for img in images}) > 1  # H and W vary per row
    assert all(3 <= len(ids) <= 9 for ids in unpack_rows(cols["ids"]))
    assert cols["version"].dtype == torch.int64 and cols["reward"].shape == (4,)


def test_ours_round_trips_the_multimodal_batch_bit_exact() -> None:
    case = replace(CASES["quick"]["multimodal"], rows=3, img_lo=8, img_hi=40, lo=3, hi=9)
    batch = {k: _column(v) for k, v in multimodal_case(case).items()}
    assert isinstance(batch["image"], Shaped) and isinstance(batch["ids"], Ragged)
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        client.put(batch, partition="mm")
        meta = client.get_meta("t", list(batch), 3, partition="mm", timeout_s=5)
        got = client.get_data(meta)
    assert got["image"] == batch["image"] and got["ids"] == batch["ids"]
    for name in ("reward", "advantage", "version"):
        assert torch.equal(got[name], batch[name])  # type: ignore[arg-type]
