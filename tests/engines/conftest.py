"""Fixtures: one tiny model folder per pytest run, built offline into a temporary cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engines.tiny import build_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(cache_dir=tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture
def tiny_model(tiny_dir: Path) -> PreTrainedModel:
    """A fresh copy of the tiny model for each test (loading takes milliseconds)."""
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_dir)
