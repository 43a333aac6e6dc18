"""Where the HF engines get their model: a folder path or an in-memory model.

Called by the constructors of the HF engines.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

__all__ = ["ModelSource", "eos_token_ids", "load_model", "load_weights", "read_folder_state"]

ModelSource = str | os.PathLike[str] | PreTrainedModel
"""A saved model folder (``save_pretrained`` layout) or a model object used as is."""


def load_model(
    source: ModelSource, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """Load ``source`` from disk (offline), or return the given model moved to ``device``.

    An in-memory model is used as is (not copied): an engine built from it shares its
    parameters with the caller. ``dtype`` applies to folders only.
    """
    if isinstance(source, PreTrainedModel):
        return _to_device(source, device)
    path = os.fspath(source)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model folder {path!r} does not exist; pass a save_pretrained folder or a model"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return _to_device(model, device)


def _to_device(model: PreTrainedModel, device: str | torch.device) -> PreTrainedModel:
    # transformers wraps ``PreTrainedModel.to`` in a decorator that hides its signature from
    # type checkers; ``nn.Module.to`` is the same call with a precise type.
    torch.nn.Module.to(model, device)
    return model


def eos_token_ids(model: PreTrainedModel, extra: Iterable[int] = ()) -> frozenset[int]:
    """EOS ids of the model's generation config and config, plus ``extra``."""
    ids: set[int] = set(int(i) for i in extra)
    for cfg in (getattr(model, "generation_config", None), model.config):
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def load_weights(model: PreTrainedModel, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model``'s parameters and buffers in place (casting dtypes).

    Every key of the model must be present, except a tied parameter (``lm_head.weight`` tied
    to the embedding) whose twin is present. Unknown keys raise ``KeyError`` naming them.
    """
    with torch.no_grad():
        result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise KeyError(
            f"weights have keys the model does not: {sorted(result.unexpected_keys)[:8]}; "
            "publish the state_dict of the same architecture"
        )
    if result.missing_keys:
        own = model.state_dict()
        loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
        untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
        if untied:
            raise KeyError(
                f"weights lack keys the model needs: {sorted(untied)[:8]}; publish a full "
                "state_dict (tied parameters may be left out)"
            )


def read_folder_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The tensors of a ``save_pretrained`` folder's safetensors files (one file or the
    shards of an index), on the CPU, as saved: what :func:`load_weights` takes."""
    from safetensors.torch import load_file

    folder = os.fspath(path)
    files = (
        sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        if os.path.isdir(folder)
        else []
    )
    if not files:
        raise FileNotFoundError(
            f"{folder!r} holds no .safetensors file: not a save_pretrained folder written with "
            "safe_serialization"
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    return state
