"""The tiny-model builder: offline, deterministic, cached, loadable as a checkpoint."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.tasks import make_task
from engines.tiny import (
    TinyConfig,
    WarmStartConfig,
    build_tiny,
    build_tokenizer,
    load_tiny,
)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.usefixtures("no_network")
def test_build_is_offline_deterministic_and_cached(tmp_path: Path) -> None:
    # (how fast it builds is a figure for a benchmark: a loaded machine stretches it at will)
    first = build_tiny(cache_dir=tmp_path / "a")
    names = {p.name for p in first.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tiny_build.json"} <= names

    second = build_tiny(cache_dir=tmp_path / "b")
    assert first.name == second.name  # same content hash
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    w1, w2 = _weights(first), _weights(second)
    assert all(torch.equal(w1[k], w2[k]) for k in w1)

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny(cache_dir=tmp_path / "a") == first  # cache hit: nothing rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    other = build_tiny(TinyConfig(seed=1), cache_dir=tmp_path / "a")
    assert other != first
    w3 = _weights(other)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(w1[name], w3[name])


def test_tokenizer_is_the_same_in_a_fresh_process() -> None:
    # Hash randomization differs per process; the trained vocabulary must not.
    here = hashlib.sha256(build_tokenizer().backend_tokenizer.to_str().encode()).hexdigest()
    code = (
        "import hashlib; from engines.tiny import build_tokenizer; "
        "print(hashlib.sha256(build_tokenizer().backend_tokenizer.to_str().encode()).hexdigest())"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert here == there


def test_folder_reloads_with_auto_classes(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.bos_token == "<|bos|>" and tokenizer.pad_token == "<|pad|>"

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3 + 4 ="}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|bos|><|user|>\n3 + 4 =<|eos|>\n<|assistant|>\n"
    ids = tokenizer("123 apples")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:4]) == ["1", "2", "3"]  # one token per digit
    assert tokenizer.decode(ids, skip_special_tokens=True) == "123 apples"
    assert tokenizer.decode(tokenizer("héllo ✓")["input_ids"], skip_special_tokens=True) == (
        "héllo ✓"  # byte-level: any text round-trips
    )


def test_warm_start_is_deterministic_and_cached_separately(tmp_path: Path) -> None:
    task = make_task("arithmetic", seed=0)
    warm = WarmStartConfig(steps=4, batch_size=8)
    plain = build_tiny(cache_dir=tmp_path)
    a = build_tiny(cache_dir=tmp_path, warm_start_task=task, warm_start_config=warm)
    b = build_tiny(cache_dir=tmp_path / "other", warm_start_task=task, warm_start_config=warm)
    assert a != plain and a.name == b.name
    wa, wb, wp = _weights(a), _weights(b), _weights(plain)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.norm.weight"], wp["model.norm.weight"])
    info = (a / "tiny_build.json").read_text()
    assert '"last_loss"' in info and '"arithmetic"' in info
    with pytest.raises(ValueError, match="warm_start_task"):
        build_tiny(cache_dir=tmp_path, warm_start_config=warm)


def test_grouped_query_variant_and_config_validation(tmp_path: Path) -> None:
    model, tokenizer = load_tiny(TinyConfig(num_kv_heads=2, num_layers=1), cache_dir=tmp_path)
    assert model.config.num_key_value_heads == 2 and model.config.num_hidden_layers == 1
    logits = model(torch.tensor([[tokenizer.bos_token_id, 5, 6]])).logits
    assert logits.shape == (1, 3, len(tokenizer))
    with pytest.raises(ValueError, match="vocab_size"):
        TinyConfig(vocab_size=100)
    with pytest.raises(ValueError, match="num_heads"):
        TinyConfig(num_heads=5)


def test_its_tokenizer_loads_as_auto_tokenizer_loads_it(tiny_dir: Path) -> None:
    """``asyncflow.build.build_tokenizer`` loads a tiny folder's tokenizer by the class it
    saved, not through ``AutoTokenizer``: the object must be the same in every respect the
    workflow uses, and the process must not load transformers' model registry for it."""
    from asyncflow.build import build_tokenizer as folder_tokenizer

    direct = folder_tokenizer(tiny_dir)
    auto = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)  # (as build_tokenizer)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
    assert direct.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert direct.chat_template == auto.chat_template
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "padding_side"):
        assert getattr(direct, name) == getattr(auto, name), name
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    assert direct.apply_chat_template(messages, add_generation_prompt=True) == (
        auto.apply_chat_template(messages, add_generation_prompt=True)
    )
    texts = ["123 apples", "héllo ✓", ""]
    assert direct(texts)["input_ids"] == auto(texts)["input_ids"]
    ids = auto("9 + 8 = 17")["input_ids"]
    assert direct.decode(ids, skip_special_tokens=True) == (
        auto.decode(ids, skip_special_tokens=True)
    )

    code = (
        "import sys; from pathlib import Path; from asyncflow.build import build_tokenizer\n"
        f"t = build_tokenizer(Path({str(tiny_dir)!r}))\n"
        "print(type(t).__name__, 'transformers.models.auto.modeling_auto' in sys.modules)"
    )
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert there == [type(auto).__name__, "False"]
