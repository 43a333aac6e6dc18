"""How many intra-op threads torch gets in each of a run's processes (``torch_threads``).

``torch_threads: auto`` (the default) applies one rule, per process:

1. A policy under ``AUTO_MIN_PARAMETERS`` parameters gets **one** thread. Its operations are
   too small to split: on the 2-core reference machine the tiny demo model (0.6M parameters)
   ran 20% slower per synchronous step with two threads than with one (75-77 against
   60-62 ms), the threads' hand-offs costing more than they save.
2. Otherwise the process gets **its cores, shared by the stages that are busy at the same
   time**: every core where the stages run in turn (``train.max_staleness=0``: generation,
   reward and training one after the other), half of them each where generation overlaps
   training (``max_staleness >= 1``: the run's process, which trains, and the rollout's engine
   process, or the two stage threads of one process). SmolLM2-135M at ``max_staleness=0``
   took 22-24 s per step with two threads against 29-33 s with one on the same machine.
3. Under ``deploy=ray`` a stage host's cores are the CPUs its placement reserves
   (``placement.num_cpus``, at least one): Ray's placement is the sharing rule there.

An integer pins the count in every process of the run; ``null`` leaves torch's default.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncflow.config import RunConfig

__all__ = [
    "AUTO_MIN_PARAMETERS",
    "available_cores",
    "folder_parameters",
    "intra_op_threads",
    "policy_parameters",
]

AUTO_MIN_PARAMETERS = 20_000_000
"""Below this many parameters, ``torch_threads: auto`` gives one thread (rule 1)."""

TINY_PARAMETERS = 565_888
"""The tiny demo model's parameters (``engines.tiny.TinyConfig``'s defaults)."""

SMOLLM2_PARAMETERS = 134_515_008
"""SmolLM2-135M's parameters (tied embeddings), before its folder is converted."""


def available_cores() -> int:
    """The cores this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))


def _safetensors_parameters(file: Path) -> int:
    """Elements of every tensor in a safetensors file, from its header alone."""
    with file.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for d in entry["shape"]:
            n *= int(d)
        total += n
    return total


def folder_parameters(folder: Path) -> int | None:
    """The parameters of a Hugging Face model folder, counted from its safetensors headers
    (no tensor is read); None when it has none (``.bin`` weights, or not a folder)."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    try:
        return sum(_safetensors_parameters(f) for f in files)
    except (OSError, ValueError, KeyError, struct.error):
        return None


def policy_parameters(cfg: RunConfig) -> int | None:
    """The policy's size as ``model.name`` tells it, before any engine loads it (None:
    unknown, e.g. a model a custom factory builds)."""
    name = cfg.model.name
    if name == "tiny":
        return TINY_PARAMETERS  # (no import of engines.tiny: it loads transformers)
    if name == "smollm2":
        return SMOLLM2_PARAMETERS
    return folder_parameters(Path(name).expanduser())


def intra_op_threads(
    cfg: RunConfig, *, cores: int | None = None, ray_host: bool = False
) -> int | None:
    """``torch_threads`` resolved for one process (module docstring): an integer as given,
    None for torch's default, or the ``auto`` rule. ``cores``: the process's cores (default:
    those it may run on); ``ray_host``: a stage host under Ray, whose cores its placement
    reserved (no further sharing)."""
    given = cfg.torch_threads
    if given is None or isinstance(given, int):
        return given
    params = policy_parameters(cfg)
    if params is None or params < AUTO_MIN_PARAMETERS:
        return 1
    n = available_cores() if cores is None else max(1, cores)
    if ray_host:
        return n
    busy = 1 if cfg.train.max_staleness == 0 else 2
    return max(1, n // busy)
