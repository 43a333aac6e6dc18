"""New weights reach a running vLLM engine through asyncflow's weight transports.

The trainer's end (a sender in this process, as on the trainer's rank 0) publishes perturbed
weights of the tiny model; the generator host's end (a receiver in the engine's process, over
the transport's real sockets and gloo links) gets them into host memory, and the engine loads
them through vLLM's weight-transfer engine (the ``asyncflow_shm`` backend) without a restart.
vLLM's behaviour log-probs of its samples then equal transformers' scoring of the same tokens
under the new weights (measured ~3e-7 mean, fp32) and are far from the old weights' (~0.7).
The tiny model ties its embedding and head; the published state leaves ``lm_head.weight`` out,
as tied checkpoints do, so the tied head is exercised (vLLM's reload keeps the old head unless
it is named; the engine names it).
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from asyncflow.transport import make_transport
from engines.hf import HFScoringEngine
from engines.protocols import Generation, SamplingParams
from engines.tiny import build_tiny
from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TEMPERATURE = 0.8
MATCH = 1e-5  # mean |vLLM - HF| under the weights vLLM serves; measured ~3e-7 (fp32)
OPTIONS: dict[str, dict[str, Any]] = {
    "broadcast": {"timeout_s": 60.0, "bucket_bytes": 1 << 20},  # several ranges per version
    "shm": {"timeout_s": 60.0},
}


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    """One event loop for the module: the engine binds to the loop that first uses it."""
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny(cache_dir=tmp_path_factory.mktemp("tiny-cache")))


@pytest.fixture(scope="module")
def hf_model(tiny_path: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    return model


@pytest.fixture(scope="module")
def prompts(tiny_path: str) -> list[torch.Tensor]:
    tok = AutoTokenizer.from_pretrained(tiny_path)
    return [torch.tensor(tok(f"What is {i} + {2 * i}?")["input_ids"]) for i in range(8)]


@pytest.fixture(scope="module")
def engine(tiny_path: str, runner: asyncio.Runner) -> Iterator[VLLMGenerationEngine]:
    config = VLLMEngineConfig(
        model=tiny_path, dtype="float32", max_model_len=256, kv_cache_gib=0.25, version=0
    )
    eng = VLLMGenerationEngine(config)
    yield eng
    eng.close()


def perturbed(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """A copy with every matrix moved by 20% of its spread (the tied embedding/head once)."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            if p.dim() > 1:
                p.add_(0.2 * p.std() * torch.randn(p.shape, generator=gen))
    return other


def gaps(model: PreTrainedModel, prompts: Sequence[torch.Tensor], gens: Sequence[Generation]):
    """(mean, max) |vLLM logprob - HF logprob| of vLLM's samples scored by ``model``."""
    scorer = HFScoringEngine(model, temperature=TEMPERATURE)
    ref = scorer.logprobs(list(prompts), [g.token_ids for g in gens])
    diff = torch.cat([(r - g.logprobs).abs() for r, g in zip(ref, gens, strict=True)])
    return float(diff.mean()), float(diff.max())


def vllm_pids() -> set[int]:
    import psutil  # a dependency of vLLM

    children = psutil.Process().children(recursive=True)
    return {p.pid for p in children if p.name().startswith("VLLM")}


@pytest.mark.parametrize("name", ["broadcast", "shm"])
def test_logprobs_follow_weights_from_the_transport(
    name: str, engine, runner, prompts, hf_model
) -> None:
    old_version = engine.version
    old_model = hf_model if old_version == 0 else perturbed(hf_model, seed=old_version)
    version = old_version + 1
    new_model = perturbed(hf_model, seed=version)
    state = {k: v for k, v in new_model.state_dict().items() if k != "lm_head.weight"}
    llm, pids = engine._resources.llm, vllm_pids()
    params = SamplingParams(max_new_tokens=24, temperature=TEMPERATURE, seed=version)

    transport = make_transport(name, **OPTIONS[name])
    sender = transport.sender()
    member = f"generator-{os.getpid()}"
    receiver = transport.receiver(member)
    try:
        deadline = time.monotonic() + 60
        while member not in sender.members():  # joined (and, for broadcast, linked)
            assert time.monotonic() < deadline, f"{name}: the receiver did not join in 60 s"
            time.sleep(0.05)
        sender.publish(state, version)  # returns once the receiver can get(version)
        assert receiver.wait_newer(old_version, timeout_s=60) == version
        got = receiver.get(version)
        assert set(got) == set(state)
        try:
            runner.run(engine.update_weights(got, version))
        finally:
            receiver.release(version)
    finally:
        receiver.close()
        sender.close()

    assert engine.version == version
    gens = runner.run(engine.generate(prompts, params))
    assert {g.version for g in gens} == {version}
    new_mean, new_max = gaps(new_model, prompts, gens)
    old_mean, _ = gaps(old_model, prompts, gens)
    print(
        f"{name}: |vLLM - HF new| mean {new_mean:.1e} max {new_max:.1e}, "
        f"|vLLM - HF old| mean {old_mean:.2f}"
    )
    assert new_mean < MATCH and new_max < 100 * MATCH
    assert old_mean > 1000 * MATCH
    # No restart: the same AsyncLLM and the same engine-core and worker processes.
    assert engine._resources.llm is llm and vllm_pids() == pids
    statuses = runner.run(llm.collective_rpc("asyncflow_weight_update_status"))
    assert statuses == [{"state": "loaded", "error": None}]  # through the asyncflow_shm backend
    assert not list(Path("/dev/shm").glob(f"asyncflow-weights-{os.getpid()}-*.bin"))
