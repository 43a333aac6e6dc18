"""The reference stage with a token budget: scoring calls packed by tokens, rows kept in order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import transferqueue
from adapters import ReferenceAdapter
from asyncflow.metrics import Timeline
from asyncflow.stage_runner import StageRunner
from transferqueue import Ragged
from transferqueue.aio import within


class _Scorer:
    """Log-prob of token t of a response: its own value (so rows are recognisable)."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # prompt + response tokens per call

    def logprobs(
        self, prompts: Sequence[torch.Tensor], responses: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        pairs = zip(prompts, responses, strict=True)
        self.calls.append(sum(int(p.numel() + r.numel()) for p, r in pairs))
        return [r.float() for r in responses]


@pytest.mark.parametrize("budget", [None, 12, 30])
def test_reference_calls_stay_within_the_budget_and_rows_keep_their_order(
    budget: int | None,
) -> None:
    rng = np.random.default_rng(2)
    responses = [torch.arange(int(rng.integers(1, 10))) + 100 * i for i in range(20)]
    scorer = _Scorer()
    adapter = ReferenceAdapter(scorer, batch_size=8, max_tokens_per_micro_batch=budget)  # type: ignore[arg-type]
    with transferqueue.start(num_units=2) as tq:
        client = tq.client()
        client.declare_tasks(["reference", "check"], partition="p")
        client.put(
            {"prompt_ids": [torch.ones(2, dtype=torch.int32)] * 20, "response_ids": responses},
            group=np.arange(20),
            partition="p",
        )
        client.finish("p")
        runner = StageRunner("reference", adapter, tq.async_client(), Timeline(), partition="p")
        asyncio.run(within(runner.run(), 60.0))
        meta = client.get_meta(
            "check", ["ref_logprobs", "response_ids"], batch_size=20, partition="p", timeout_s=10
        )
        cols = client.get_data(meta)
    ref, resp = cols["ref_logprobs"], cols["response_ids"]
    assert isinstance(ref, Ragged) and isinstance(resp, Ragged) and len(meta) == 20
    for lp, r in zip(ref.unbind(), resp.unbind(), strict=True):
        assert torch.equal(lp, r.float())  # every row got its own log-probs back
    if budget is None:
        assert len(scorer.calls) == 3  # one call per leased batch of 8, 8, 4
    else:
        assert all(t <= budget for t in scorer.calls) and len(scorer.calls) > 3
