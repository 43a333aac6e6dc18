"""Sharded data parallelism for causal LMs: torch FSDP2 (``fully_shard``), its checkpoints, and
its weights gathered one bucket at a time.

Each rank of the default ``torch.distributed`` group (gloo on CPU, NCCL on CUDA;
:func:`engines.distributed.init_group`) holds ``1/world`` of every parameter, of its gradient
and of the optimizer's state (AdamW's two moments), instead of all of them: a 7B model with
fp32 AdamW state needs about 112 GB on one rank, 14 GB on each of 8. Layers are sharded one
decoder layer at a time (the model's ``_no_split_modules`` classes), then the root (embedding,
final norm, head; tied weights stay in one group); a forward or backward pass gathers one
layer's parameters at a time and reduce-scatters its gradients.

What each rank holds, and when:

| state                          | every rank holds                                       |
|--------------------------------|--------------------------------------------------------|
| parameters, gradients, AdamW   | its shard (``DTensor`` with a ``Shard(0)`` placement)  |
| during forward / backward      | + one layer gathered (two with prefetching)            |
| :func:`state_buckets`          | + one bucket of full tensors (``bucket_bytes``)        |
| :func:`save_sharded`           | its shard, written by itself (``torch.distributed.checkpoint``) |
| :func:`write_policy`           | + one bucket; rank 0 writes it as one safetensors file |

Every function here is *collective*: every rank calls it, in the same order, with the same
arguments. A checkpoint written by :func:`save_sharded` is read back by the same number of
ranks (:func:`load_sharded` checks it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engines.weights_io import StateSpec

__all__ = [
    "FSDPConfig",
    "StateSpec",
    "full_tensor",
    "is_sharded",
    "load_sharded",
    "save_sharded",
    "shard_model",
    "state_buckets",
    "state_specs",
    "write_policy",
]

_META = "sharded.json"  # beside the DCP files: the world size and format of the checkpoint
_FORMAT = 1


@dataclass(kw_only=True)
class FSDPConfig:
    """How :func:`shard_model` shards a model (``train.strategy_options`` in a run)."""

    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward pass (gathered again for the
    backward): the memory of one layer at a time. False keeps them until the backward (one
    all-gather less per layer per pass, the memory of the whole model on every rank)."""
    param_dtype: str | None = None
    """Compute dtype of the gathered parameters (``bfloat16`` on GPUs); the shards, the
    gradients' reduction and AdamW keep the dtype the model was loaded in (keep float32
    there). None computes in that dtype too."""
    reduce_dtype: str | None = None
    """Dtype gradients are reduce-scattered in; None: ``param_dtype`` (or the model's)."""
    bucket_bytes: int = 256 << 20
    """Bytes of full tensors gathered at once when publishing weights or writing the policy
    folder: the memory each rank needs beyond its shard then."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(f"{name}={value!r} is not a torch dtype (e.g. 'bfloat16')")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether :func:`shard_model` (or any ``fully_shard``) was applied to ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, config: FSDPConfig | None = None) -> torch.nn.Module:
    """Shard ``model`` in place over the default process group; returns it (the same object,
    its class now also an ``FSDPModule``). Call on every rank, with replicas equal (every
    rank loaded the same weights: ``fully_shard`` keeps each rank's slice of *its* copy).

    Any optimizer must be built after this, over ``model.parameters()`` (now ``DTensor``s).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs the process group first (engines.distributed.init_group)"
        )
    cfg = config or FSDPConfig()
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, cfg.param_dtype) if cfg.param_dtype else None,
        reduce_dtype=getattr(torch, cfg.reduce_dtype) if cfg.reduce_dtype else None,
    )
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, mp_policy=policy)
    # The root's parameters (embedding, final norm, a tied head) are used at both ends of
    # the pass: resharding them after forward would only gather them again for the head.
    # Its policy casts floating inputs only, so token ids go in as they are.
    fully_shard(
        model, reshard_after_forward=cfg.reshard_after_forward and not layers, mp_policy=policy
    )
    return model


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t``: gathered from every rank for a ``DTensor``
    (collective), ``t`` detached otherwise."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t.detach()


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _entries(model: torch.nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The model's state-dict entries, tied names grouped (``keep_vars`` keeps one object per
    parameter, so tied names share it)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in groups:
            groups[key][0].append(name)
        else:
            groups[key] = ([name], tensor)
    return list(groups.values())


def state_specs(model: torch.nn.Module) -> list[StateSpec]:
    """Names, global shapes and dtypes of the full state, in state-dict order (local: no
    communication)."""
    return [
        StateSpec(tuple(names), tuple(int(d) for d in t.shape), t.dtype)
        for names, t in _entries(model)
    ]


def state_buckets(
    model: torch.nn.Module, bucket_bytes: int, *, copy: bool = True
) -> Iterator[dict[str, torch.Tensor]]:
    """The full state, one bucket of at most ``bucket_bytes`` (or one tensor, if larger) at a
    time, in :func:`state_specs` order; tied names map to one tensor. Collective: every rank
    iterates to the end (a rank that stops early leaves the others waiting in a gather until
    the group's timeout), and every rank gets the full tensors.

    Gathered tensors are fresh on the parameters' device and nobody else refers to them; a
    tensor that is not sharded is cloned (``copy=False`` hands it out as is: only for readers
    that finish with a bucket before the next step).
    """
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    with torch.no_grad():
        for names, tensor in _entries(model):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = {}, 0
            whole = full_tensor(tensor)
            if copy and not _is_dtensor(tensor):
                whole = whole.clone()
            for name in names:
                bucket[name] = whole
            size += nbytes
    if bucket:
        yield bucket


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def save_sharded(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: str | os.PathLike[str],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write every rank's shard of the model and the optimizer into ``directory`` with
    ``torch.distributed.checkpoint`` (one file per rank, plus its metadata), and
    ``sharded.json`` (the world size; ``extra``). Collective; ``directory`` must be one
    folder every rank sees."""
    import torch.distributed.checkpoint as dcp

    root = Path(directory)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(root))
    if dist.get_rank() == 0:
        meta = {"format": _FORMAT, "world_size": dist.get_world_size(), **(extra or {})}
        (root / _META).write_text(json.dumps(meta))
    dist.barrier()


def load_sharded(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | os.PathLike[str]
) -> dict[str, Any]:
    """Read what :func:`save_sharded` wrote into the sharded ``model`` and ``optimizer``, in
    place; returns ``sharded.json``. Collective. Raises ``FileNotFoundError`` /
    ``ValueError`` naming what is missing or does not fit (another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    root = Path(directory)
    meta_path = root / _META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} is missing: {root} is not a sharded checkpoint")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, this reads {_FORMAT}")
    world = dist.get_world_size()
    if int(meta["world_size"]) != world:
        raise ValueError(
            f"{root} was written by {meta['world_size']} ranks and {world} read it; resume "
            f"with train.dp_size={meta['world_size']}"
        )
    state = _dcp_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(root))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return dict(meta)


def write_policy(
    model: torch.nn.Module, directory: str | os.PathLike[str], bucket_bytes: int
) -> None:
    """The full model as a Hugging Face folder (``config.json``, ``generation_config.json``,
    safetensors), gathered one bucket at a time: rank 0 writes each bucket as one
    ``model-0000i-of-0000n.safetensors`` file (and ``model.safetensors.index.json``), or
    ``model.safetensors`` when one bucket holds everything. A tied name is written once
    (under its first name, as ``save_pretrained`` does); ``from_pretrained`` ties it again.
    Collective; only rank 0 touches ``directory``."""
    from safetensors.torch import save_file

    root = Path(directory)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    plan = _plan_files(state_specs(model), bucket_bytes)
    files = len(plan)
    weight_map: dict[str, str] = {}
    total = 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
    for i, bucket in enumerate(state_buckets(model, bucket_bytes, copy=False)):
        if not rank0:
            continue
        name = (
            "model.safetensors" if files == 1 else f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        )
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for key, tensor in bucket.items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            tensors[key] = tensor.detach().to("cpu").contiguous()
            weight_map[key] = name
            total += tensors[key].numel() * tensors[key].element_size()
        save_file(tensors, str(root / name), metadata={"format": "pt"})
    if not rank0:
        return
    if files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(str(root))
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(root))


def _plan_files(specs: list[StateSpec], bucket_bytes: int) -> list[list[StateSpec]]:
    """The buckets :func:`state_buckets` will yield (same rule), from the specs alone."""
    files: list[list[StateSpec]] = []
    size = 0
    for spec in specs:
        if files and files[-1] and size + spec.nbytes <= bucket_bytes:
            files[-1].append(spec)
            size += spec.nbytes
        else:
            files.append([spec])
            size = spec.nbytes
    return files
