"""Simulated engines: the timing model, continuous batching, weight-sync semantics, lengths."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from statistics import NormalDist
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from engines.protocols import (
    Generation,
    GenerationEngine,
    SamplingParams,
    TrainBatch,
    TrainingEngine,
)
from engines.simulated import (
    BUILTIN,
    DecodeLatency,
    EmpiricalLengths,
    LognormalLengths,
    SimulatedGenerationEngine,
    SimulatedReward,
    SimulatedTrainingEngine,
    TrainingCost,
    content_score,
    from_calibration,
)
from engines.simulated.calibration import DATA_DIR
from engines.simulated.training import sleep_until
from tests.virtual_time import FakeClock, run_virtual

PARAMS = SamplingParams(max_new_tokens=10_000)
T = TypeVar("T")


class FixedLengths:
    """Length = the prompt's first token id: tests choose every request's length."""

    max_len = 10_000

    def length(self, prompt: torch.Tensor, index: int) -> int:
        return int(prompt[0])


def prompt(length: int, size: int = 4, tag: int = 0) -> torch.Tensor:
    """A prompt of ``size`` tokens whose response will be ``length`` tokens (FixedLengths)."""
    return torch.tensor([length, tag, *range(2, size)][:size], dtype=torch.long)


def engine(
    base_s: float = 0.01,
    per_seq_s: float = 0.001,
    *,
    prefill: float = 0.0,
    max_batch: int = 64,
    time_scale: float = 0.1,
    **kwargs: Any,
) -> SimulatedGenerationEngine:
    latency = DecodeLatency(
        base_s=base_s, per_seq_s=per_seq_s, prefill_s_per_token=prefill, max_batch=max_batch
    )
    return SimulatedGenerationEngine(
        latency, FixedLengths(), time_scale=time_scale, version=0, **kwargs
    )


def now() -> float:
    """The running loop's clock (virtual time under ``run_virtual``)."""
    return asyncio.get_running_loop().time()


async def timed(coro: Awaitable[T]) -> tuple[T, float]:
    t0 = now()
    out = await coro
    return out, now() - t0


# -- generation timing -----------------------------------------------------------------------
# On virtual time (tests.virtual_time): a loop clock that jumps from timer to timer, so every
# duration below is the model's to the float, whatever else the machine is doing.


@pytest.mark.parametrize("batch", [1, 16])
def test_iteration_time_follows_the_model(batch: int) -> None:
    eng = engine(0.01, 0.002, time_scale=0.2)
    steps = 40
    expected = steps * eng.latency.iteration_s(batch)  # modelled seconds

    async def main() -> tuple[list[Generation], float]:
        return await timed(eng.generate([prompt(steps, tag=i) for i in range(batch)], PARAMS))

    gens, took = run_virtual(main())
    assert took == pytest.approx(expected * 0.2, rel=1e-9)
    assert eng.stats.iterations == steps
    assert eng.stats.tokens == steps * batch
    assert eng.stats.busy_s == pytest.approx(expected)
    assert eng.stats.lag_s == 0.0
    assert all(int(g.token_ids.numel()) == steps for g in gens)


def test_real_time_runs_no_faster_than_the_model() -> None:
    """On a real clock the engine sleeps at least the modelled time (a loaded machine only
    makes it later, and it never races to catch up beyond ``max_lag_s``)."""
    eng = engine(0.01, 0.0, time_scale=0.2)

    async def main() -> float:
        return (await timed(eng.generate([prompt(40)], PARAMS)))[1]

    assert asyncio.run(main()) >= 40 * 0.01 * 0.2 * (1 - 1e-6)


def test_prefill_is_charged_once_per_prompt_in_the_joining_iteration() -> None:
    eng = engine(0.01, 0.0, prefill=0.001, time_scale=0.2)
    # two distinct 100-token prompts, each twice (a group of 2): prefill 200 tokens, not 400
    prompts = [prompt(20, size=100, tag=t) for t in (1, 1, 2, 2)]
    expected = 20 * 0.01 + 200 * 0.001

    async def main() -> float:
        return (await timed(eng.generate(prompts, PARAMS)))[1]

    took = run_virtual(main())
    assert eng.stats.prefill_tokens == 200
    assert eng.stats.busy_s == pytest.approx(expected)
    assert took == pytest.approx(expected * 0.2, rel=1e-9)


def test_long_request_does_not_hold_back_short_ones() -> None:
    eng = engine(0.01, 0.0, time_scale=0.2)  # one iteration = 2 ms
    done: dict[str, float] = {}

    async def call(name: str, length: int, delay_iterations: float = 0) -> None:
        await asyncio.sleep(delay_iterations * 0.002)
        await eng.generate([prompt(length)], PARAMS)
        done[name] = now()

    async def main() -> None:
        await asyncio.gather(call("long", 150), call("short", 10), call("late_short", 10, 30.5))

    run_virtual(main())
    assert done["short"] == pytest.approx(10 * 0.002)
    # arrives mid-iteration 31, joins at its end: 31 + 10 iterations, not 150
    assert done["late_short"] == pytest.approx(41 * 0.002)
    assert done["long"] == pytest.approx(150 * 0.002)
    assert eng.stats.iterations == 150


def test_max_batch_queues_requests_in_fifo_order() -> None:
    eng = engine(0.01, 0.0, max_batch=2, time_scale=0.2)
    finished: list[tuple[int, float]] = []
    seen_queue: list[int] = []

    async def call(tag: int) -> None:
        await eng.generate([prompt(20, tag=tag)], PARAMS)
        finished.append((tag, now()))

    async def main() -> None:
        calls = [asyncio.create_task(call(tag)) for tag in range(4)]
        await asyncio.sleep(0.01)
        seen_queue.append(eng.queued)
        seen_queue.append(eng.running)
        await asyncio.gather(*calls)

    run_virtual(main())
    assert seen_queue == [2, 2]
    order = [tag for tag, _ in finished]
    assert set(order[:2]) == {0, 1} and set(order[2:]) == {2, 3}
    assert [t for _, t in finished] == pytest.approx([20 * 0.002] * 2 + [40 * 0.002] * 2)
    assert eng.stats.iterations == 40


def test_update_waits_for_running_requests_and_versions_never_mix() -> None:
    eng = engine(0.01, 0.0, max_batch=2, time_scale=0.2, sync_s=0.1)  # sync = 20 ms
    events: dict[str, float] = {}

    async def main() -> tuple[list[Generation], list[Generation]]:
        # 3 requests, max_batch 2: the third is queued when the update arrives
        first = asyncio.create_task(eng.generate([prompt(50, tag=t) for t in range(3)], PARAMS))
        await asyncio.sleep(0.02)  # 10 iterations in
        update = asyncio.create_task(eng.update_weights({}, 1))
        await asyncio.sleep(0.005)
        second = asyncio.create_task(eng.generate([prompt(5, tag=9)], PARAMS))
        await update
        events["update"] = now()
        assert eng.version == 1
        out1 = await first
        events["first"] = now()
        out2 = await second
        return out1, out2

    out1, out2 = run_virtual(main())
    # the running pair finished on v0; the queued one started on v1
    assert [g.version for g in out1] == [0, 0, 1]
    assert [g.version for g in out2] == [1]
    # the update ended after the running pair (50 iterations = 0.1 s) plus the load (0.02 s)
    assert events["update"] == pytest.approx(50 * 0.002 + 0.02)
    assert eng.stats.updates == 1 and eng.stats.drain_s > 0.3
    # the queued request ran after the update: 0.12 s + 50 iterations
    assert events["first"] == pytest.approx(0.12 + 0.1)


def test_partial_update_interrupts_at_a_token_boundary_and_records_each_tokens_version() -> None:
    """``partial``: the update stops the running pair at the end of the iteration in
    progress, loads, and they go on where they stopped; the queued request starts on the new
    weights. Each token's version is the one whose iteration produced it; nothing is lost."""
    eng = engine(0.01, 0.0, max_batch=2, time_scale=0.2, sync_s=0.1, partial=True)
    whole = engine(0.01, 0.0, max_batch=2, time_scale=0.2)  # the same samples, never updated
    events: dict[str, float] = {}

    async def main() -> tuple[list[Generation], list[Generation]]:
        first = asyncio.create_task(eng.generate([prompt(50, tag=t) for t in range(3)], PARAMS))
        await asyncio.sleep(0.0205)  # 10 iterations and a quarter of the 11th
        update = asyncio.create_task(eng.update_weights({}, 1))
        await update
        events["update"] = now()
        assert eng.version == 1
        out = await first
        events["first"] = now()
        return out, await whole.generate([prompt(50, tag=t) for t in range(3)], PARAMS)

    out, reference = run_virtual(main())
    # the 11th iteration (in progress) finished on v0, the rest of the pair on v1
    for g in out[:2]:
        assert g.token_versions.tolist() == [0] * 11 + [1] * 39
        assert g.version == 0 and g.version_span == 1
    assert out[2].token_versions.tolist() == [1] * 50 and out[2].version == 1
    for g, r in zip(out, reference, strict=True):  # same tokens as if never interrupted
        assert torch.equal(g.token_ids, r.token_ids) and torch.equal(g.logprobs, r.logprobs)
    # the update took the rest of the 11th iteration (1.5 ms) and the load (20 ms), no drain
    assert events["update"] == pytest.approx(11 * 0.002 + 0.02)
    # the pair's 39 remaining iterations, then the queued one's 50
    assert events["first"] == pytest.approx(events["update"] + 39 * 0.002 + 50 * 0.002)
    assert eng.stats.interrupted == 2 and eng.stats.kept_tokens == 22
    assert eng.stats.drain_s == pytest.approx(0.0015 / 0.2)
    assert eng.drain_tokens == 0  # an update never waits for running sequences here


def test_partial_update_with_nothing_running_loads_at_once() -> None:
    eng = engine(0.01, 0.0, time_scale=0.2, sync_s=0.1, partial=True)

    async def main() -> float:
        _, took = await timed(eng.update_weights({}, 3))
        (g,) = await eng.generate([prompt(4)], PARAMS)
        assert g.token_versions.tolist() == [3] * 4
        return took

    assert run_virtual(main()) == pytest.approx(0.02)
    assert eng.stats.interrupted == 0


def test_cancelled_call_leaves_the_batch() -> None:
    eng = engine(0.01, 0.0, time_scale=0.2)

    async def main() -> float:
        doomed = asyncio.create_task(eng.generate([prompt(1000, tag=1)], PARAMS))
        await asyncio.sleep(0.01)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        _, took = await timed(eng.generate([prompt(10, tag=2)], PARAMS))
        assert eng.running == 0
        return took

    # 10 iterations of its own, not the rest of the cancelled 1000
    assert run_virtual(main()) == pytest.approx(10 * 0.002)


def test_generations_are_well_formed_and_deterministic() -> None:
    lengths = LognormalLengths(median=20, sigma=0.8, max_len=64, prompt_scale=0)

    def run(seed: int, params: SamplingParams) -> list[Generation]:
        eng = SimulatedGenerationEngine(
            DecodeLatency(base_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.0),
            lengths,
            time_scale=1.0,
            vocab_size=50,
            eos_token_id=7,
            seed=seed,
            version=3,
        )
        assert isinstance(eng, GenerationEngine)
        prompts = [torch.tensor([5, 6, 7, 8])] * 8 + [torch.arange(3, 40)] * 8
        return asyncio.run(eng.generate(prompts, params))

    params = SamplingParams(max_new_tokens=24)
    gens = run(0, params)
    for g in gens:
        ids, logp = g.token_ids, g.logprobs
        assert 1 <= ids.numel() <= 24 and ids.max() < 50 and ids.min() >= 0
        assert logp.dtype == torch.float32 and bool((logp < 0).all())
        assert g.version == 3
        if g.finish_reason == "stop":
            assert int(ids[-1]) == 7 and int((ids == 7).sum()) == 1
        else:
            assert ids.numel() == 24 and int((ids == 7).sum()) == 0
    assert {g.finish_reason for g in gens} == {"stop", "length"}

    def sizes(out: list[Generation]) -> list[int]:
        return [int(g.token_ids.numel()) for g in out]

    assert len(set(sizes(gens[:8]))) > 3  # samples of one prompt differ
    again = run(0, params)
    assert all(torch.equal(a.token_ids, b.token_ids) for a, b in zip(gens, again, strict=True))
    assert sizes(run(1, params)) != sizes(gens)  # the engine seed changes seed-less samples
    seeded = SamplingParams(max_new_tokens=24, seed=5)
    assert sizes(run(0, seeded)) == sizes(run(1, seeded))  # a call seed fixes the lengths


def test_shared_counts_make_samples_independent_of_routing() -> None:
    """A group split over two instances gets the samples one instance would have drawn."""
    latency = DecodeLatency(base_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.0)
    lengths = LognormalLengths(median=50, sigma=1.0, prompt_scale=0, overlong_p=0)
    p = torch.arange(5, 30)

    async def draw(split: bool) -> list[list[int]]:
        counts: dict[bytes, int] = {}
        engines = [
            SimulatedGenerationEngine(latency, lengths, seed=s, shared_counts=counts)
            for s in (0, 1)
        ]
        calls = [engines[1 if split and k % 2 else 0].generate([p] * 2, PARAMS) for k in range(4)]
        return [g.token_ids.tolist() for out in await asyncio.gather(*calls) for g in out]

    one, two = asyncio.run(draw(False)), asyncio.run(draw(True))
    assert sorted(one) == sorted(two) and len({len(t) for t in one}) > 4


# -- length models ---------------------------------------------------------------------------


def test_lognormal_lengths_are_deterministic_and_vary_across_samples() -> None:
    model = LognormalLengths(median=100, sigma=0.7, max_len=1024, overlong_p=0, seed=1)
    p = torch.arange(10, 70)
    first = [model.length(p, i) for i in range(64)]
    assert first == [model.length(p.int(), i) for i in range(64)]  # dtype does not matter
    assert len(set(first)) > 40
    reseeded = LognormalLengths(median=100, sigma=0.7, max_len=1024, overlong_p=0, seed=2)
    assert first != [reseeded.length(p, i) for i in range(64)]
    logs = np.log(first)
    assert logs.std() == pytest.approx(0.7, rel=0.35)
    assert all(1 <= n <= 1024 for n in first)


def test_longer_prompts_have_longer_responses() -> None:
    model = LognormalLengths(median=100, sigma=0.5, prompt_scale=0.5, ref_len=50, prompt_sigma=0)
    short = np.median([model.length(torch.arange(20) + j, i) for j in range(8) for i in range(16)])
    long = np.median([model.length(torch.arange(200) + j, i) for j in range(8) for i in range(16)])
    assert long / short == pytest.approx(math.sqrt(10), rel=0.3)


def test_prompt_explained_variance_is_learnable() -> None:
    """A linear regression on (log length, token counts / sqrt(length)) recovers the share."""
    rng = np.random.default_rng(0)
    vocab = 40
    prompts = [torch.from_numpy(rng.integers(0, vocab, rng.integers(10, 120))) for _ in range(600)]
    model = LognormalLengths(
        median=100, sigma=0.6, prompt_scale=0.3, ref_len=50, max_len=10**6, overlong_p=0
    )
    model = model.adapted(prompts, prompt_share=0.5)
    assert model.explained_share(prompts) == pytest.approx(0.5, abs=1e-6)
    y = np.log([model.length(p, 0) for p in prompts])
    assert np.median(np.exp(y)) == pytest.approx(100, rel=0.15)
    x = np.stack(
        [
            np.concatenate(
                [[1.0, math.log(len(p))], np.bincount(p.numpy(), minlength=vocab) / len(p) ** 0.5]
            )
            for p in prompts
        ]
    )
    train, test = slice(0, 450), slice(450, None)
    w, *_ = np.linalg.lstsq(x[train], y[train], rcond=None)
    residual = y[test] - x[test] @ w
    r2 = 1 - residual.var() / y[test].var()
    assert 0.35 < r2 < 0.65


def test_empirical_lengths_replay_the_measured_distribution(tmp_path: Path) -> None:
    values = [int(v) for v in np.random.default_rng(1).lognormal(4.5, 0.8, 500).clip(1, 1024)]
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps({"lengths": values, "max_new_tokens": 1024, "fit": {}}))
    model = EmpiricalLengths.from_json(path, prompt_share=0.3)
    assert model.max_len == 1024
    prompts = [torch.arange(j, j + 30) * 7 for j in range(200)]
    drawn = [model.length(p, i) for p in prompts for i in range(4)]
    assert drawn == [model.length(p, i) for p in prompts for i in range(4)]
    assert set(drawn) <= set(values)
    assert np.median(drawn) == pytest.approx(np.median(values), rel=0.15)
    group = [model.length(prompts[0], i) for i in range(16)]
    assert len(set(group)) > 8


def test_empirical_lengths_adapted_to_templated_prompts_reach_the_share() -> None:
    """Prompts sharing most tokens: standardizing their content score restores the share."""
    values = [int(v) for v in np.random.default_rng(1).lognormal(4.5, 0.8, 500).clip(1, 1024)]
    rng = np.random.default_rng(4)
    common = torch.arange(100, 120)
    prompts = [torch.cat([common, torch.from_numpy(rng.integers(0, 300, 3))]) for _ in range(200)]
    ranks = np.sort(values)

    def between_groups(model: EmpiricalLengths) -> float:
        """Variance of group means of normal scores: share + (1 - share) / 8."""
        means = []
        for p in prompts:
            u = (np.searchsorted(ranks, [model.length(p, i) for i in range(8)]) + 0.5) / 500
            means.append(np.mean([NormalDist().inv_cdf(x) for x in u]))
        return float(np.var(means))

    raw = EmpiricalLengths(values, prompt_share=0.5)
    assert between_groups(raw) < 0.3
    assert 0.45 < between_groups(raw.adapted(prompts)) < 0.75


def test_content_score_is_standard_normal_over_random_prompts() -> None:
    rng = np.random.default_rng(2)
    z = [content_score(torch.from_numpy(rng.integers(0, 50_000, 64))) for _ in range(2000)]
    assert np.mean(z) == pytest.approx(0, abs=0.1)
    assert np.std(z) == pytest.approx(1, abs=0.1)


# -- training and reward ---------------------------------------------------------------------


def batch(samples: int, response_len: int, prompt_len: int = 10) -> TrainBatch:
    return TrainBatch(
        prompt_ids=[torch.zeros(prompt_len, dtype=torch.long)] * samples,
        response_ids=[torch.ones(response_len, dtype=torch.long)] * samples,
        behaviour_logprobs=[-torch.ones(response_len)] * samples,
        advantages=torch.linspace(-1, 1, samples),
        versions=torch.zeros(samples, dtype=torch.long),
    )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """The simulated training engine and reward block on this clock instead of real time."""
    import engines.simulated.training as training

    fake = FakeClock()
    monkeypatch.setattr(training, "time", fake)
    return fake


def test_training_time_scales_with_tokens_and_gpus(clock: FakeClock) -> None:
    cost = TrainingCost(per_token_s=0.001, per_sample_s=0.01, step_s=0.5)
    one = SimulatedTrainingEngine(cost, gpus=1, time_scale=0.1)
    two = SimulatedTrainingEngine(cost, gpus=2, time_scale=0.1)
    assert isinstance(one, TrainingEngine)

    def took(eng: SimulatedTrainingEngine, b: TrainBatch) -> float:
        t0 = clock.monotonic()
        metrics = eng.forward_backward(b, 1 / len(b))
        assert math.isfinite(metrics["loss"]) and metrics["num_tokens"] == b.num_tokens
        return clock.monotonic() - t0

    small, large = batch(4, 90), batch(4, 290)  # 400 and 1200 tokens
    expected_small = (0.001 * 400 + 0.01 * 4) * 0.1
    expected_large = (0.001 * 1200 + 0.01 * 4) * 0.1
    assert took(one, small) == pytest.approx(expected_small)
    assert took(one, large) == pytest.approx(expected_large)
    assert took(two, large) == pytest.approx(expected_large / 2)
    t0 = clock.monotonic()
    step = one.optimizer_step()
    assert clock.monotonic() - t0 == pytest.approx(0.05)
    assert one.version == 1 and step["version"] == 1 and step["samples"] == 8
    assert math.isfinite(step["grad_norm"])
    assert int(one.state_dict()["version"]) == 1
    assert one.busy_s == pytest.approx(0.44 + 1.24 + 0.5)


def test_reward_is_deterministic_and_timed(clock: FakeClock) -> None:
    reward = SimulatedReward(per_sample_s=0.01, time_scale=1.0, seed=3)
    prompts, completions = ["a", "b", "c", "a"], ["x", "y", "z", "x"]
    first = reward(prompts, completions, answer=["1"] * 4)
    assert clock.slept == [pytest.approx(0.04)]
    assert first == reward(prompts, completions)
    assert first[0] == first[3] and len(set(first)) == 3
    assert all(r is not None and 0 <= r <= 1 for r in first)
    binary = SimulatedReward(success_rate=0.5)([str(i) for i in range(200)], ["x"] * 200)
    assert set(binary) == {0.0, 1.0} and 70 < sum(r or 0 for r in binary) < 130


def test_sleep_until_never_returns_early() -> None:
    """The real clock: a loaded machine may only make the sleep longer."""
    deadline = time.monotonic() + 0.05
    sleep_until(deadline)
    assert time.monotonic() >= deadline


# -- calibration -----------------------------------------------------------------------------


def test_builtin_defaults_equal_the_recorded_calibration() -> None:
    path = DATA_DIR / "calibration.json"
    if not path.is_file():
        pytest.skip("no recorded calibration in this checkout")
    recorded = json.loads(path.read_text())
    assert recorded["default_profile"] == BUILTIN["default_profile"]
    for name, profile in BUILTIN["profiles"].items():
        for key in ("decode", "sync_s", "training", "lengths"):
            assert recorded["profiles"][name][key] == pytest.approx(profile[key]), (name, key)
    cal = from_calibration()
    assert cal == from_calibration(path=path)
    # the dataclass defaults are the recorded default profile
    assert cal.latency == DecodeLatency()
    assert cal.training == TrainingCost()
    assert cal.lengths == LognormalLengths()
    assert SimulatedGenerationEngine().sync_s == cal.sync_s


def test_from_calibration_builds_engines_and_rejects_unknown_profiles() -> None:
    cal = from_calibration()
    gen = cal.generation_engine(time_scale=0.01, version=0)
    assert gen.latency == cal.latency and gen.sync_s == cal.sync_s
    assert cal.training_engine(time_scale=0.01, gpus=2).gpus == 2
    if cal.lengths_file is not None:
        assert cal.empirical_lengths().max_len >= 1
    with pytest.raises(ValueError, match="known"):
        from_calibration(profile="nope")


def test_lengths_for_moves_the_fit_onto_other_prompts() -> None:
    """Short prompts of another tokenizer keep the calibrated median and prompt share."""
    cal = from_calibration()
    rng = np.random.default_rng(3)
    prompts = [torch.from_numpy(rng.integers(0, 300, rng.integers(12, 20))) for _ in range(300)]
    assert np.median([cal.lengths.length(p, 0) for p in prompts]) < cal.lengths.median / 4
    model = cal.lengths_for(prompts)
    assert model.explained_share(prompts) == pytest.approx(cal.prompt_share, abs=1e-6)
    drawn = [model.length(p, i) for p in prompts for i in range(2)]
    assert np.median(drawn) == pytest.approx(cal.lengths.median, rel=0.15)
    # lengths spread more than the share allows: the exponent is lowered instead
    spread = [torch.arange(int(n)) for n in np.geomspace(5, 2000, 50)]
    lowered = cal.lengths_for(spread, prompt_share=0.1)
    assert lowered.prompt_sigma == 0 and lowered.prompt_scale < cal.lengths.prompt_scale
    assert lowered.explained_share(spread) == pytest.approx(0.1, abs=1e-6)


def test_runaways_cluster_on_long_prompts_and_keep_their_mean_rate() -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 500, (int(n),), generator=g) for n in torch.randint(20, 120, (400,))
    ]
    flat = LognormalLengths(overlong_p=0.05, overlong_slope=0.0).adapted(prompts)
    clustered = LognormalLengths(overlong_p=0.05, overlong_slope=1.0).adapted(prompts)
    p_flat = np.array([flat.runaway_p(p) for p in prompts])
    p = np.array([clustered.runaway_p(p) for p in prompts])
    assert np.allclose(p_flat, 0.05)
    assert p.mean() == pytest.approx(0.05, rel=0.02)
    factor = np.array([clustered.prompt_log_factor(p) for p in prompts])
    long = factor > np.quantile(factor, 0.75)
    assert p[long].mean() > 2 * p[~long].mean()
    # the sampled runaways follow: more of them on the long-answer prompts
    runaways = np.array(
        [sum(clustered.length(q, i) == clustered.max_len for i in range(16)) for q in prompts]
    )
    assert runaways[long].mean() > 1.5 * runaways[~long].mean()


def test_overlong_slope_fit_recovers_clustering() -> None:
    from bench.calibration_fit import fit_overlong_slope

    rng = np.random.default_rng(0)
    groups, logs = [], []
    for k in range(300):
        z = rng.normal()
        p = min(0.04 * math.exp(0.8 * z) / math.exp(0.32), 1.0)
        for _ in range(8):
            groups.append(k)
            run = rng.random() < p
            logs.append(math.log(1024) if run else 5.0 + 0.4 * z + 0.3 * rng.normal())
    slope = fit_overlong_slope(np.array(logs), np.array(groups), 1024)
    assert 0.4 < slope < 1.2
    flat = [math.log(1024) if rng.random() < 0.04 else 5.0 + rng.normal() for _ in groups]
    assert abs(fit_overlong_slope(np.array(flat), np.array(groups), 1024)) < 0.4


def _sharing(
    lengths: LognormalLengths,
    counts: dict[bytes, int],
    cuts: dict[bytes, Any],
    *,
    base_s: float,
    time_scale: float,
    eos_token_id: int | None = None,
) -> SimulatedGenerationEngine:
    """An instance sharing sample counts and cut samples with the others of a test."""
    return SimulatedGenerationEngine(
        DecodeLatency(base_s=base_s, per_seq_s=0.0, prefill_s_per_token=0.0),
        lengths,
        time_scale=time_scale,
        vocab_size=50,
        eos_token_id=eos_token_id,
        shared_counts=counts,
        continuations=cuts,
    )


def test_continuation_resumes_a_cut_sample_exactly_on_another_instance() -> None:
    """Cut at a budget and continued elsewhere (prompt + tokens so far), a sample is the same
    sample: tokens, log-probs, eos and finish reason equal the uncut one's."""
    lengths = LognormalLengths(median=40, sigma=1.2, max_len=150, prompt_scale=0.0, seed=3)
    prompts = [torch.tensor([5, i, 9, 11]) for i in range(12)]

    def make(counts: dict[bytes, int], cuts: dict[bytes, Any]) -> SimulatedGenerationEngine:
        return _sharing(lengths, counts, cuts, base_s=0.001, time_scale=0.01, eos_token_id=0)

    async def go() -> None:
        whole = await make({}, {}).generate(prompts, SamplingParams(max_new_tokens=150))
        counts: dict[bytes, int] = {}
        cuts: dict[bytes, Any] = {}
        first, second = make(counts, cuts), make(counts, cuts)
        heads = await first.generate(prompts, SamplingParams(max_new_tokens=30))
        cut = [i for i, h in enumerate(heads) if h.finish_reason == "length"]
        assert cut and len(cut) < len(prompts)  # some samples outlive the budget, some not
        tails = await second.generate(
            [torch.cat([prompts[i], heads[i].token_ids]) for i in cut],
            SamplingParams(max_new_tokens=120),
        )
        for i, tail in zip(cut, tails, strict=True):
            assert torch.equal(torch.cat([heads[i].token_ids, tail.token_ids]), whole[i].token_ids)
            assert torch.equal(torch.cat([heads[i].logprobs, tail.logprobs]), whole[i].logprobs)
            assert tail.finish_reason == whole[i].finish_reason
        for i in set(range(len(prompts))) - set(cut):
            assert torch.equal(heads[i].token_ids, whole[i].token_ids)
        assert all(int(w.token_ids[-1]) == 0 for w in whole if w.finish_reason == "stop")
        assert not cuts  # every recorded cut was continued

    run_virtual(go())


def test_drain_estimate_counts_budget_and_tokens_carried_by_a_continuation() -> None:
    """``drain_tokens`` (what a weight update would wait for, as the engine can see it): per
    running request the smaller of its remaining budget and twice its tokens so far, where a
    continuation's tokens so far include those of its first part."""
    lengths = LognormalLengths(median=40, sigma=1.2, max_len=4000, prompt_scale=0.0, seed=3)
    counts: dict[bytes, int] = {}
    cuts: dict[bytes, Any] = {}

    def make() -> SimulatedGenerationEngine:
        return _sharing(lengths, counts, cuts, base_s=0.01, time_scale=0.1)

    prompts = [torch.tensor([5, i, 9, 11]) for i in range(40)]

    async def go() -> None:
        first, second = make(), make()
        assert first.drain_tokens == 0  # nothing running
        heads = await first.generate(prompts, SamplingParams(max_new_tokens=60))
        cut = [i for i, h in enumerate(heads) if h.finish_reason == "length"]
        assert cut
        resumed = [torch.cat([prompts[i], heads[i].token_ids]) for i in cut]
        call = asyncio.ensure_future(second.generate(resumed, SamplingParams(max_new_tokens=3000)))
        await asyncio.sleep(0.03)  # the continuations join and decode 30 tokens
        st = second._state
        assert st is not None and st.running
        assert all(r.offset == 60 and 0 < r.produced < 100 for r in st.running)
        # 60 tokens carried: twice what each has run counts, not a fresh request's few tokens
        produced = min(r.produced for r in st.running)
        assert second.drain_tokens == min(3000 - produced, 2 * (60 + produced)) >= 120
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    run_virtual(go())
