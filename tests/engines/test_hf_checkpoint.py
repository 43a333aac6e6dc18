"""HFTrainingEngine checkpoints: a resumed engine continues bit for bit where the saved one was."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from engines.hf import HFGenerationEngine, HFTrainingConfig, HFTrainingEngine, encode_prompts
from engines.protocols import CheckpointableEngine, SamplingParams, TrainBatch

TEXTS = ["3 + 4 =", "What is 12 * 7?", "1 ="]


def _batch(model: PreTrainedModel, prompts: list[torch.Tensor], seed: int) -> TrainBatch:
    gens = HFGenerationEngine(model).generate_sync(
        prompts * 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=seed)
    )
    return TrainBatch(
        prompt_ids=prompts * 2,
        response_ids=[g.token_ids for g in gens],
        behaviour_logprobs=[g.logprobs for g in gens],
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0]),
        versions=torch.zeros(6, dtype=torch.long),
    )


def _step(engine: HFTrainingEngine, batch: TrainBatch) -> None:
    engine.forward_backward(batch, loss_scale=1 / 6)
    engine.optimizer_step()


def test_resumed_engine_continues_exactly(
    tiny_model: PreTrainedModel, tiny_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    prompts = encode_prompts(tiny_tokenizer, TEXTS)
    b1, b2 = _batch(tiny_model, prompts, 1), _batch(tiny_model, prompts, 2)
    config = HFTrainingConfig(lr=1e-3, weight_decay=0.01)
    straight = HFTrainingEngine(copy.deepcopy(tiny_model), config=config)
    saved = HFTrainingEngine(copy.deepcopy(tiny_model), config=config)
    assert isinstance(saved, CheckpointableEngine)
    _step(straight, b1)
    _step(saved, b1)
    saved.save(tmp_path / "ckpt")
    # a fresh engine from the original weights, then the checkpoint: as if never stopped
    resumed = HFTrainingEngine(copy.deepcopy(tiny_model), config=config)
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 1
    _step(straight, b2)
    _step(resumed, b2)
    assert resumed.version == straight.version == 2
    for (name, a), b in zip(
        straight.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name  # AdamW's moments and step count came back too
    # the policy folder loads with from_pretrained and holds the saved weights
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "policy")
    assert (tmp_path / "ckpt" / "policy" / "model.safetensors").is_file()
    after_b1 = saved.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, after_b1[name]), name


def test_load_refuses_what_is_not_a_checkpoint(tiny_model: PreTrainedModel, tmp_path: Path) -> None:
    engine = HFTrainingEngine(tiny_model)
    with pytest.raises(FileNotFoundError, match=r"trainer_state\.pt is missing"):
        engine.load(tmp_path)
    engine.save_policy(tmp_path / "policy")  # a policy alone is not enough to resume
    with pytest.raises(FileNotFoundError, match="not a training checkpoint"):
        engine.load(tmp_path)
