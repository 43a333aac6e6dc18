"""Length ranker and routers of the rollout adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from adapters import LeastLoadedRouter, LengthAwareRouter, LengthRanker, RolloutAdapter
from adapters.base import StageOutput
from engines import Generation, SamplingParams
from engines.simulated import DecodeLatency, LognormalLengths, SimulatedGenerationEngine
from tests.virtual_time import run_virtual
from transferqueue import BatchMeta, Ragged


def _prompts(rng: np.random.Generator, n: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """Prompts whose true response length grows with their length and a 'hard' token 7."""
    prompts, lengths = [], []
    for _ in range(n):
        size = int(rng.integers(3, 30))
        ids = rng.integers(10, 300, size)
        hard = rng.random() < 0.3
        if hard:
            ids[0] = 7
        prompts.append(torch.from_numpy(ids))
        mean = 20 * size * (4 if hard else 1)
        lengths.append(mean * float(np.exp(rng.normal(0, 0.3))))
    return prompts, np.array(lengths)


def test_ranker_learns_prompt_dependent_lengths() -> None:
    rng = np.random.default_rng(0)
    ranker = LengthRanker()
    train_p, train_y = _prompts(rng, 600)
    for i in range(0, 600, 8):
        ranker.observe(train_p[i : i + 8], train_y[i : i + 8].tolist())
    test_p, test_y = _prompts(rng, 300)
    pred = ranker.predict(test_p)
    err = np.abs(np.log(pred) - np.log(test_y)).mean()
    baseline = np.abs(np.log(test_y).mean() - np.log(test_y)).mean()
    assert err < 0.5 * baseline, (err, baseline)
    # ranking quality: the predicted-longest fifth holds mostly truly long prompts
    top = np.argsort(-pred)[:60]
    assert np.mean(test_y[top] > np.quantile(test_y, 0.6)) > 0.8


def test_length_aware_router_sends_long_batches_to_dedicated_instances() -> None:
    router = LengthAwareRouter([0], quantile=0.75, long_capacity=10**9)
    rng = np.random.default_rng(1)
    picks = {}
    for _ in range(400):
        pred = float(rng.lognormal(5, 1))
        picks.setdefault(router.choose([0, 0, 0], pred, [0, 1, 2]), []).append(pred)
    assert np.median(picks[0]) > 2 * np.median(picks[1] + picks.get(2, []))
    assert 0.15 < router.long_batches / router.batches < 0.35
    assert LeastLoadedRouter().choose([3, 1, 2], 0.0, [0, 1, 2]) == 1
    assert LeastLoadedRouter().choose([3, 1, 2], 0.0, [0, 2]) == 2  # only eligible ones


def test_long_batch_goes_to_a_dedicated_instance_only_with_room_for_all_of_it() -> None:
    """A long batch that would queue behind a dedicated instance's full batch goes to the
    least loaded other instance instead (work-conserving)."""
    router = LengthAwareRouter([0, 1], quantile=0.5, long_capacity=8)
    for _ in range(16):  # warm the moving threshold with short predictions
        router.choose([0, 0, 0, 0], 10.0, [0, 1, 2, 3], 8)
    assert router.choose([0, 4, 5, 9], 1000.0, [0, 1, 2, 3], 8) == 0  # room for 8 on 0
    assert router.choose([5, 4, 5, 9], 1000.0, [0, 1, 2, 3], 4) == 1  # only 1 has room for 4
    # 8 more fit on neither dedicated instance: the least loaded other one
    assert router.choose([2, 4, 5, 9], 1000.0, [0, 1, 2, 3], 8) == 2
    assert router.choose([2, 4, 5, 9], 1000.0, [0, 1, 3], 8) == 3  # only eligible ones


class _CountingEngine:
    """A user engine: answers with a fixed-length response, counts its calls."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.calls = 0

    @property
    def version(self) -> int:
        return 0

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        return [
            Generation(torch.ones(3, dtype=torch.long), -torch.ones(3), "stop") for _ in prompts
        ]

    async def update_weights(self, state: object, version: int) -> None:
        return None


def _meta(n: int) -> tuple[BatchMeta, dict]:
    idx = np.arange(n)
    meta = BatchMeta(idx, idx.astype(np.int32) * 0, idx // 2, idx * 0 - 1, idx * 0 + 4, "p")
    cols = {"prompt_ids": Ragged.from_tensors([torch.arange(4)] * n)}
    return meta, cols


def test_least_loaded_dispatch_spreads_concurrent_batches() -> None:
    engines = [_CountingEngine(0.05), _CountingEngine(0.05)]
    ranker = LengthRanker(warmup=1, refit_every=1)
    adapter = RolloutAdapter(engines, SamplingParams(), ranker=ranker)

    async def go() -> None:
        outs = await asyncio.gather(*(adapter.process(*_meta(4)) for _ in range(4)))
        assert all(len(o.columns["response_ids"]) == 4 for o in outs)

    run_virtual(go())  # (virtual time: no call can end before all four are dispatched)
    assert [e.calls for e in engines] == [2, 2]
    assert ranker.observed == 8  # two prompts (groups) per batch, four batches


def _sim_engines(versions: Sequence[int]) -> list[SimulatedGenerationEngine]:
    lengths = LognormalLengths(median=25, sigma=1.3, max_len=200, prompt_scale=0.0, seed=4)
    counts: dict[bytes, int] = {}
    cuts: dict[bytes, object] = {}
    return [
        SimulatedGenerationEngine(
            DecodeLatency(base_s=0.001, per_seq_s=0.0, prefill_s_per_token=0.0),
            lengths,
            time_scale=0.01,
            version=v,
            shared_counts=counts,
            continuations=cuts,
        )
        for v in versions
    ]


def test_migration_continues_long_samples_on_the_long_instance() -> None:
    """Samples past the budget finish on the dedicated instance; each sample is exactly what
    it would have been unmigrated, its version the older part's, both instances on the
    timeline."""
    params = SamplingParams(max_new_tokens=200)
    plain = RolloutAdapter(_sim_engines([1]), params)
    long_first = _sim_engines([3, 1])  # instance 0: dedicated long, newer weights
    router = LengthAwareRouter([0], long_capacity=64)
    migrating = RolloutAdapter(long_first, params, router=router, migrate_after=20)

    async def go() -> tuple[StageOutput, StageOutput]:
        return await plain.process(*_meta(16)), await migrating.process(*_meta(16))

    ref, out = run_virtual(go())
    cont = router.continuations
    assert migrating.migrated > 0 and cont == 1  # one continuation call for the batch
    long_lens = [len(r) for r in ref.columns["response_ids"] if len(r) > 20]
    assert migrating.migrated == len(long_lens)
    for a, b in zip(ref.columns["response_ids"], out.columns["response_ids"], strict=True):
        assert torch.equal(a, b)
    ref_lp, out_lp = ref.columns["behaviour_logprobs"], out.columns["behaviour_logprobs"]
    for a, b in zip(ref_lp, out_lp, strict=True):
        assert torch.equal(a, b)
    assert ref.columns["finish_reason"] == out.columns["finish_reason"]
    assert (out.version == 1).all()  # migrated samples: the older part's version
    for tokens, versions in zip(
        out.columns["response_ids"], out.columns["token_versions"], strict=True
    ):  # each token with the version of the instance that drew it
        n = len(tokens)
        assert versions.tolist() == [1] * min(n, 20) + [3] * max(n - 20, 0)
    assert [lane for lane, *_ in out.spans] == ["instance1", "instance0"]
    assert long_first[0].stats.requests == migrating.migrated


def test_migration_needs_budget_below_the_cap() -> None:
    with pytest.raises(ValueError, match="migrate_after"):
        RolloutAdapter(_sim_engines([0]), SamplingParams(), migrate_after=-1)


class _PartlyStale:
    """An instance whose samples start on weights ``first`` and end on ``last``. It claims
    ``last`` until its first call, then ``after`` (a restarted instance reports its initial
    weights)."""

    def __init__(self, first: int, last: int, after: int) -> None:
        self.first, self.last, self.after, self.calls = first, last, after, 0

    @property
    def version(self) -> int:
        return self.last if self.calls == 0 else self.after

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls += 1
        versions = torch.tensor([self.first, self.last, self.last])
        return [
            Generation(
                torch.ones(3, dtype=torch.long), -torch.ones(3), "stop", token_versions=versions
            )
            for _ in prompts
        ]


def test_the_bound_is_checked_on_the_oldest_token() -> None:
    """A batch that needs version 2 never keeps a sample whose first token came from version
    1, however new its later tokens: it is generated again elsewhere; the rows' version is the
    oldest token's and token_versions carries every token's."""
    stale, fresh = _PartlyStale(1, 2, after=1), _PartlyStale(2, 3, after=3)
    adapter = RolloutAdapter([stale, fresh], SamplingParams(), version_field="min_gen_version")
    meta, cols = _meta(4)
    cols["min_gen_version"] = torch.full((4,), 2, dtype=torch.long)

    async def go() -> StageOutput:
        return await adapter.process(meta, cols)

    out = run_virtual(go())
    assert stale.calls == 1 and fresh.calls == 1 and adapter.retries == 1
    assert out.version.tolist() == [2] * 4  # the oldest token's, within the bound
    assert [v.tolist() for v in out.columns["token_versions"]] == [[2, 3, 3]] * 4
    assert out.columns["generated_at"].dtype == torch.float64


def test_a_retired_instance_takes_no_new_batch_and_an_added_one_does() -> None:
    """``retire`` (an instance leaving a running job): its calls in flight finish, no new
    batch goes to it; ``add``: a new instance takes batches; the last live one cannot go."""
    engines = [_CountingEngine(0.05), _CountingEngine(0.05)]
    adapter = RolloutAdapter(engines, SamplingParams())
    adapter.retire(1)
    with pytest.raises(ValueError, match="at least one instance"):
        adapter.retire(0)

    async def batches(n: int) -> None:
        outs = await asyncio.gather(*(adapter.process(*_meta(4)) for _ in range(n)))
        assert all(len(o.columns["response_ids"]) == 4 for o in outs)

    run_virtual(batches(4))
    assert [e.calls for e in engines] == [4, 0]
    late = _CountingEngine(0.05)
    assert adapter.add(late) == 2
    run_virtual(batches(4))
    assert [engines[0].calls - 4, engines[1].calls, late.calls] == [2, 0, 2]
