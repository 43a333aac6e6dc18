"""HF engines on the real tiny model: log-prob agreement, weight updates, training direction."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engines.hf import (
    HFGenerationEngine,
    HFScoringEngine,
    HFTrainingConfig,
    HFTrainingEngine,
    encode_prompts,
    sample_tokens,
)
from engines.protocols import (
    Generation,
    GenerationEngine,
    SamplingParams,
    ScoringEngine,
    TrainBatch,
    TrainingEngine,
)

TEXTS = ["3 + 4 =", "What is 12 * 7?", "Use 3 5 7 to make 22.", "1 ="]


@pytest.fixture
def prompts(tiny_tokenizer: PreTrainedTokenizerBase) -> list[torch.Tensor]:
    return encode_prompts(tiny_tokenizer, TEXTS)  # different lengths: left padding matters


def _max_diff(gens: list[Generation], scored: list[torch.Tensor]) -> float:
    return max(float((g.logprobs - s).abs().max()) for g, s in zip(gens, scored, strict=True))


def test_engines_implement_the_protocols(tiny_model: PreTrainedModel) -> None:
    assert isinstance(HFGenerationEngine(copy.deepcopy(tiny_model)), GenerationEngine)
    assert isinstance(HFScoringEngine(tiny_model), ScoringEngine)
    assert isinstance(HFTrainingEngine(copy.deepcopy(tiny_model)), TrainingEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generation_logprobs_equal_scoring_logprobs(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor], temperature: float
) -> None:
    gen = HFGenerationEngine(tiny_model, seed=0)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=5)
    gens = asyncio.run(gen.generate(prompts * 2, params))
    assert [int(g.token_ids.numel()) for g in gens] == [12] * 8  # random weights: no EOS
    scored = HFScoringEngine(tiny_model, temperature=temperature).logprobs(
        prompts * 2, [g.token_ids for g in gens]
    )
    diff = _max_diff(gens, scored)
    assert diff < 1e-4, f"max |generation - scoring| log-prob = {diff:.3g}"
    assert all(g.logprobs.dtype == torch.float32 and g.token_ids.dtype == torch.int64 for g in gens)


def test_greedy_logprobs_are_untempered_and_top_k1_is_greedy(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    gen = HFGenerationEngine(tiny_model)
    greedy = gen.generate_sync(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    top1 = gen.generate_sync(prompts, SamplingParams(max_new_tokens=6, top_k=1, seed=3))
    tiny_p = gen.generate_sync(prompts, SamplingParams(max_new_tokens=6, top_p=1e-6, seed=4))
    for g, k, p in zip(greedy, top1, tiny_p, strict=True):
        assert torch.equal(g.token_ids, k.token_ids) and torch.equal(g.token_ids, p.token_ids)
    scored = HFScoringEngine(tiny_model, temperature=1.0).logprobs(
        prompts, [g.token_ids for g in greedy]
    )
    assert _max_diff(greedy, scored) < 1e-4


def test_top_k_and_top_p_truncate_sampling_but_not_logprobs() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().expand(2000, 4)
    generator = torch.Generator().manual_seed(0)
    full = probs.log()
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.5), {0, 1}),  # mass before token 2 is 0.7 >= 0.5
        (SamplingParams(top_p=0.75), {0, 1, 2}),
        (SamplingParams(), {0, 1, 2, 3}),
    ]:
        tokens, logps = sample_tokens(logits, params, generator)
        assert set(tokens.tolist()) == allowed, params
        torch.testing.assert_close(logps, full[tokens])  # the full softmax, not the truncated one


def test_seeds_make_sampling_reproducible(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    gen = HFGenerationEngine(tiny_model)
    params = SamplingParams(max_new_tokens=8, seed=11)
    a = gen.generate_sync(prompts, params)
    b = gen.generate_sync(prompts, params)
    c = gen.generate_sync(prompts, SamplingParams(max_new_tokens=8, seed=12))
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.token_ids, y.token_ids) for x, y in zip(a, c, strict=True))
    # Unseeded calls draw from the engine's generator: reproducible per engine seed.
    unseeded = SamplingParams(max_new_tokens=8)
    d = HFGenerationEngine(tiny_model, seed=1).generate_sync(prompts, unseeded)
    e = HFGenerationEngine(tiny_model, seed=1).generate_sync(prompts, unseeded)
    assert all(torch.equal(x.token_ids, y.token_ids) for x, y in zip(d, e, strict=True))


def test_stop_tokens_and_length_limit(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    gen = HFGenerationEngine(tiny_model, max_batch_size=3)  # also exercises chunking
    vocab = tiny_model.config.vocab_size
    stop_all = SamplingParams(max_new_tokens=5, seed=0, stop_token_ids=range(vocab))
    for g in gen.generate_sync(prompts, stop_all):
        assert g.token_ids.numel() == 1 and g.finish_reason == "stop"
    for g in gen.generate_sync(prompts, SamplingParams(max_new_tokens=3, seed=0)):
        assert g.token_ids.numel() == 3 and g.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 0"):
        gen.generate_sync([torch.zeros(0, dtype=torch.long)], SamplingParams())


def test_update_weights_changes_outputs_and_version(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), version=0)
    params = SamplingParams(max_new_tokens=6, temperature=0)
    before = gen.generate_sync(prompts, params)
    assert gen.version == 0 and {g.version for g in before} == {0}

    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in tiny_model.state_dict().items()}
    del state["lm_head.weight"]  # tied to the embedding: may be left out

    async def update_during_generation() -> list[Generation]:
        # The update is queued behind the generate call: that call finishes on old weights.
        pending = asyncio.ensure_future(gen.generate(prompts, params))
        await asyncio.sleep(0)
        await gen.update_weights(state, 7)
        return await pending

    during = asyncio.run(update_during_generation())
    assert {g.version for g in during} == {0}
    assert _max_diff(during, [b.logprobs for b in before]) < 1e-5
    assert gen.version == 7
    after = gen.generate_sync(prompts, params)
    assert {g.version for g in after} == {7}
    assert _max_diff(after, [b.logprobs for b in before]) > 1e-3
    scored = HFScoringEngine(gen.model).logprobs(prompts, [g.token_ids for g in after])
    assert _max_diff(after, scored) < 1e-4
    with pytest.raises(KeyError, match="does not"):
        gen.load_weights({"nonexistent.weight": torch.zeros(1)}, 8)
    with pytest.raises(KeyError, match="lack"):
        gen.load_weights({"lm_head.weight": state["model.embed_tokens.weight"]}, 8)
    gen.close()
    gen.close()


def test_partial_update_lands_at_a_token_boundary_with_exact_per_token_versions(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    """``partial=True``: an update during a call lands at its next token boundary; every token
    records the version that drew it, and its log-prob is that version's (scored afresh over
    the prompt and the tokens before it), so nothing sampled before the update is lost."""
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), version=0, partial=True)
    new_model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = SamplingParams(max_new_tokens=200, temperature=0.8, seed=3)

    async def update_during_generation() -> list[Generation]:
        running = asyncio.ensure_future(gen.generate(prompts, params))
        while gen.tokens_decoded < 8 * len(prompts):  # a few tokens in
            await asyncio.sleep(0.001)
        await gen.update_weights(new_model.state_dict(), 1)
        assert gen.version == 1 and not running.done()  # landed mid-call, not after it
        return await running

    gens = asyncio.run(update_during_generation())
    old = HFScoringEngine(tiny_model, temperature=0.8).logprobs(
        prompts, [g.token_ids for g in gens]
    )
    new = HFScoringEngine(new_model, temperature=0.8).logprobs(prompts, [g.token_ids for g in gens])
    switch = max(int((g.token_versions == 0).sum()) for g in gens)  # the boundary
    assert 8 <= switch < 200
    for g, o, n in zip(gens, old, new, strict=True):
        v = g.token_versions
        assert v.tolist() == [0] * min(switch, len(v)) + [1] * max(len(v) - switch, 0)
        assert g.version == 0 and g.version_span == (1 if len(v) > switch else 0)
        assert float((g.logprobs[v == 0] - o[v == 0]).abs().max()) < 1e-4
        assert float((g.logprobs[v == 1] - n[v == 1]).abs().max()) < 1e-4
        assert float((g.logprobs[v == 1] - o[v == 1]).abs().max()) > 1e-3  # new weights
    assert gen.kept_tokens == switch * sum(len(g.token_ids) > switch for g in gens)
    # nothing running: the next update loads at once
    asyncio.run(gen.update_weights(tiny_model.state_dict(), 2))
    (after,) = gen.generate_sync(prompts[:1], SamplingParams(max_new_tokens=4))
    assert after.token_versions.tolist() == [2] * 4
    gen.close()


def _batch(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor], temperature: float
) -> TrainBatch:
    gen = HFGenerationEngine(tiny_model)
    gens = gen.generate_sync(
        prompts * 2, SamplingParams(max_new_tokens=6, temperature=temperature, seed=2)
    )
    return TrainBatch(
        prompt_ids=prompts * 2,
        response_ids=[g.token_ids for g in gens],
        behaviour_logprobs=[g.logprobs for g in gens],
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]),
        versions=torch.zeros(8, dtype=torch.long),
    )


def test_training_moves_logprobs_along_the_advantage(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    batch = _batch(tiny_model, prompts, temperature=0.8)
    scorer = HFScoringEngine(tiny_model, temperature=0.8)
    before = torch.stack([s.sum() for s in scorer.logprobs(batch.prompt_ids, batch.response_ids)])
    trainer = HFTrainingEngine(
        copy.deepcopy(tiny_model), config=HFTrainingConfig(lr=1e-3, temperature=0.8)
    )
    for step in range(3):
        metrics = trainer.forward_backward(batch, loss_scale=1.0 / len(batch))
        if step == 0:  # first step is on-policy: generation log-probs match the trainer's
            assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert metrics["num_samples"] == 8.0
        stats = trainer.optimizer_step()
        assert stats["grad_norm"] > 0
    assert trainer.version == 3
    after_scorer = HFScoringEngine(trainer.model, temperature=0.8)
    after = torch.stack(
        [s.sum() for s in after_scorer.logprobs(batch.prompt_ids, batch.response_ids)]
    )
    delta = after - before
    positive = batch.advantages > 0
    assert (delta[positive] > 0).all(), f"positive-advantage log-prob change {delta[positive]}"
    assert (delta[~positive] < 0).all(), f"negative-advantage log-prob change {delta[~positive]}"


def test_micro_batching_does_not_change_the_gradient(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    batch = _batch(tiny_model, prompts, temperature=1.0)
    grads = []
    for size in (8, 3):
        config = HFTrainingConfig(max_micro_batch_size=size)
        trainer = HFTrainingEngine(copy.deepcopy(tiny_model), config=config)
        metrics = trainer.forward_backward(batch, loss_scale=0.125)
        assert metrics["micro_batches"] == (1.0 if size == 8 else 3.0)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_state_dict_returns_copies_and_kl_needs_reference(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    batch = _batch(tiny_model, prompts, temperature=1.0)
    trainer = HFTrainingEngine(copy.deepcopy(tiny_model), config=HFTrainingConfig(lr=1e-2))
    snapshot = trainer.state_dict()
    kept = {k: v.clone() for k, v in snapshot.items()}
    trainer.forward_backward(batch, loss_scale=0.125)
    trainer.optimizer_step()
    live = trainer.model.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(live[name], kept[name])  # the weights moved ...
    assert all(torch.equal(snapshot[k], kept[k]) for k in kept)  # ... the snapshot did not
    assert all(not v.requires_grad for v in snapshot.values())
    assert snapshot["lm_head.weight"] is snapshot["model.embed_tokens.weight"]  # tied: one copy

    kl_trainer = HFTrainingEngine(copy.deepcopy(tiny_model), config=HFTrainingConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_trainer.forward_backward(batch, loss_scale=0.125)
    batch.ref_logprobs = HFScoringEngine(tiny_model).logprobs(batch.prompt_ids, batch.response_ids)
    metrics = kl_trainer.forward_backward(batch, loss_scale=0.125)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-5)  # reference == policy


def test_engines_load_from_a_folder(tiny_dir: Path, prompts: list[torch.Tensor]) -> None:
    gen = HFGenerationEngine(tiny_dir)
    out = gen.generate_sync(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
    assert out[0].token_ids.numel() == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFScoringEngine("/nonexistent/model")


def test_empty_responses_are_scored_and_trained_without_error(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    empty = torch.zeros(0, dtype=torch.long)
    responses = [empty, torch.tensor([5, 6]), empty, torch.tensor([7])]
    scored = HFScoringEngine(tiny_model).logprobs(prompts, responses)
    assert [int(s.numel()) for s in scored] == [0, 2, 0, 1]
    trainer = HFTrainingEngine(copy.deepcopy(tiny_model))
    for batch_responses in (responses, [empty] * 4):
        batch = TrainBatch(
            prompt_ids=prompts,
            response_ids=batch_responses,
            behaviour_logprobs=[torch.zeros(int(r.numel())) for r in batch_responses],
            advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
            versions=torch.zeros(4, dtype=torch.long),
        )
        metrics = trainer.forward_backward(batch, loss_scale=0.25)
        assert metrics["num_tokens"] == sum(int(r.numel()) for r in batch_responses)
    assert trainer.optimizer_step()["version"] == 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engines_on_cuda_agree_with_cpu_and_train_along_the_advantage(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    """The same engines on a GPU: generation log-probs equal scoring's, one gradient equals
    the CPU's, and training moves log-probs along the advantage."""
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), device="cuda", seed=0)
    params = SamplingParams(max_new_tokens=8, temperature=0.9, seed=3)
    gens = gen.generate_sync(prompts * 2, params)
    assert all(g.token_ids.device.type == "cpu" for g in gens)
    scored = HFScoringEngine(tiny_model, temperature=0.9, device="cuda").logprobs(
        prompts * 2, [g.token_ids for g in gens]
    )
    assert _max_diff(gens, [s.cpu() for s in scored]) < 1e-4
    gen.close()

    batch = _batch(tiny_model, prompts, temperature=0.8)  # generated on the CPU
    grads = []
    for device in ("cpu", "cuda"):
        trainer = HFTrainingEngine(
            copy.deepcopy(tiny_model), config=HFTrainingConfig(temperature=0.8), device=device
        )
        trainer.forward_backward(batch, loss_scale=0.125)
        grads.append(torch.cat([p.grad.flatten().cpu() for p in trainer.model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-3)

    scorer = HFScoringEngine(tiny_model, temperature=0.8)
    before = torch.stack([s.sum() for s in scorer.logprobs(batch.prompt_ids, batch.response_ids)])
    trainer = HFTrainingEngine(
        copy.deepcopy(tiny_model), config=HFTrainingConfig(lr=1e-3, temperature=0.8), device="cuda"
    )
    for _ in range(3):
        trainer.forward_backward(batch, loss_scale=1.0 / len(batch))
        assert trainer.optimizer_step()["grad_norm"] > 0
    trained = copy.deepcopy(tiny_model)
    trained.load_state_dict(trainer.state_dict())  # (copied from the device)
    after_scorer = HFScoringEngine(trained, temperature=0.8)
    after = torch.stack(
        [s.sum() for s in after_scorer.logprobs(batch.prompt_ids, batch.response_ids)]
    )
    positive = batch.advantages > 0
    assert ((after - before)[positive] > 0).all() and ((after - before)[~positive] < 0).all()


def _grads(trainer: HFTrainingEngine) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_decoupled_objective_on_a_stale_batch(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor]
) -> None:
    """A batch generated at version 0, trained by weights two steps on (version 2). The
    proximal policy is the step's own weights: recomputed by a forward pass it equals the
    current log-probs, and the interpolation (proximal = current version: alpha = 1) gives
    the same gradient without that pass, from per-sample or per-token versions. Where no
    weight exceeds the cap the decoupled objective is the truncated-IS one; with a small cap
    it drops the tokens truncated-IS keeps at the cap."""
    batch = _batch(tiny_model, prompts, temperature=1.0)
    moved = HFTrainingEngine(copy.deepcopy(tiny_model), config=HFTrainingConfig(lr=1e-2))
    for _ in range(2):
        moved.forward_backward(batch, loss_scale=0.125)
        moved.optimizer_step()
    assert moved.version == 2

    def run(**options: object) -> tuple[dict[str, float], torch.Tensor]:
        trainer = HFTrainingEngine(
            copy.deepcopy(moved.model),
            config=HFTrainingConfig(**options),  # type: ignore[arg-type]
            version=2,
        )
        metrics = trainer.forward_backward(batch, loss_scale=0.125)
        return metrics, _grads(trainer)

    tis, g_tis = run(loss="tis", is_cap=100.0)
    recompute, g_recompute = run(loss="decoupled", prox_logp="recompute", is_cap=100.0)
    _, g_interpolate = run(loss="decoupled", prox_logp="interpolate", is_cap=100.0)
    assert recompute["prox_logp_gap"] < 1e-5
    assert tis["is_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the batch is off-policy
    torch.testing.assert_close(g_recompute, g_tis, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(g_interpolate, g_recompute, atol=1e-6, rtol=1e-4)
    batch.extra["token_versions"] = [torch.zeros_like(r) for r in batch.response_ids]
    _, g_tokens = run(loss="decoupled", prox_logp="interpolate", is_cap=100.0)
    torch.testing.assert_close(g_tokens, g_interpolate)
    del batch.extra["token_versions"]

    cap = min(tis["is_weight_mean"], 1.0) * 0.999  # below the weight of some token
    capped_tis, _ = run(loss="tis", is_cap=cap)
    capped, g_capped = run(loss="decoupled", prox_logp="interpolate", is_cap=cap)
    assert capped["is_truncated_frac"] == pytest.approx(capped_tis["is_truncated_frac"])
    assert 0 < capped["is_truncated_frac"] < 1
    assert capped["is_weight_mean"] < capped_tis["is_weight_mean"]  # dropped, not truncated
    assert not torch.allclose(g_capped, g_tis)
    with pytest.raises(ValueError, match="loss must be one of"):
        HFTrainingConfig(loss="ppo")
    with pytest.raises(ValueError, match="prox_logp must be"):
        HFTrainingConfig(prox_logp="rollout")


def _episode_grads(
    model: PreTrainedModel,
    batch: TrainBatch,
    *,
    kl_coef: float = 0.0,
    loss: str = "tis",
) -> list[torch.Tensor]:
    config = HFTrainingConfig(kl_coef=kl_coef, loss=loss)
    engine = HFTrainingEngine(copy.deepcopy(model), config=config)
    engine.forward_backward(batch, 0.5)
    return [p.grad.clone() for p in engine.model.parameters() if p.grad is not None]


@pytest.mark.parametrize(("kl_coef", "loss"), [(0.0, "tis"), (0.1, "tis"), (0.0, "decoupled")])
def test_observation_tokens_never_reach_the_loss(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor], kl_coef: float, loss: str
) -> None:
    """Two multi-turn episodes: the model's turns with observation tokens between them.
    Perturbing the log-probs recorded for the observation tokens (behaviour, and reference
    with a KL term) leaves the gradient bit-identical, with either objective; without the
    loss mask it would not."""
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 300, (n,), generator=gen) for n in (9, 14)]
    masks = [
        torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 1], dtype=torch.bool),  # turn, observation, turn
        torch.tensor([0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0], dtype=torch.bool),
    ]
    behaviour = [torch.full((n,), -1.0) for n in (9, 14)]
    ref = [torch.full((n,), -1.2) for n in (9, 14)]

    def batch(noise: float, mask: bool = True) -> TrainBatch:
        # the observation positions' log-probs moved by ``noise`` (NaN-free, large)
        beh = [b + noise * (~m).float() for b, m in zip(behaviour, masks, strict=True)]
        rl = [r - noise * (~m).float() for r, m in zip(ref, masks, strict=True)]
        return TrainBatch(
            prompt_ids=prompts[:2],
            response_ids=responses,
            behaviour_logprobs=beh,
            advantages=torch.tensor([1.0, -0.5]),
            versions=torch.zeros(2, dtype=torch.int64),
            ref_logprobs=rl,
            loss_mask=masks if mask else None,
        )

    base = _episode_grads(tiny_model, batch(0.0), kl_coef=kl_coef, loss=loss)
    moved = _episode_grads(tiny_model, batch(3.0), kl_coef=kl_coef, loss=loss)
    assert len(base) == len(moved) > 0
    assert all(torch.equal(a, b) for a, b in zip(base, moved, strict=True))
    # the same perturbation without the mask changes the gradient: the test can fail
    plain = _episode_grads(tiny_model, batch(0.0, mask=False), kl_coef=kl_coef, loss=loss)
    plain_moved = _episode_grads(tiny_model, batch(3.0, mask=False), kl_coef=kl_coef, loss=loss)
    assert any(not torch.equal(a, b) for a, b in zip(plain, plain_moved, strict=True))
    # an all-true mask is no mask at all: one-turn responses train exactly as before
    full = [torch.ones(n, dtype=torch.bool) for n in (9, 14)]
    unmasked = batch(0.0, mask=False)
    masked_full = copy.copy(unmasked)
    masked_full.loss_mask = full
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _episode_grads(tiny_model, unmasked),
            _episode_grads(tiny_model, masked_full),
            strict=True,
        )
    )


def test_an_idle_engine_loads_small_weights_on_the_callers_thread(
    tiny_model: PreTrainedModel, prompts: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No call queued and a small state: the copy runs on the event loop's thread (no hop
    to the worker, whose tensor calls wait for the GIL behind the loop). Over
    ``INLINE_LOAD_BYTES``, or behind a queued call, it goes to the worker thread, in
    order. Either way the weights and version are those given."""
    import threading

    import engines.hf.generation as generation

    threads: list[str] = []
    real = generation.load_weights

    def spy(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> None:
        threads.append(threading.current_thread().name)
        real(model, state)

    monkeypatch.setattr(generation, "load_weights", spy)
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), version=0)
    params = SamplingParams(max_new_tokens=4, temperature=0)
    state = {k: v + 0.01 for k, v in tiny_model.state_dict().items()}

    async def go() -> None:
        await gen.update_weights(state, 1)
        assert gen.version == 1
        pending = asyncio.ensure_future(gen.generate(prompts, params))
        await asyncio.sleep(0)
        await gen.update_weights(state, 2)  # queued behind the call
        assert {g.version for g in await pending} == {1}
        monkeypatch.setattr(generation, "INLINE_LOAD_BYTES", 0)
        await gen.update_weights(state, 3)

    asyncio.run(go())
    assert gen.version == 3
    main = threading.main_thread().name
    assert threads[0] == main and all(t.startswith("hf-generate") for t in threads[1:]), threads
    assert len(threads) == 3
    for name, tensor in gen.model.state_dict().items():
        if name in state:
            assert torch.equal(tensor, state[name]), name
    gen.close()
