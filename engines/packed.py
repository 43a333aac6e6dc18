"""Prompts and generations as a few flat arrays, for calls between processes.

A generate call carries a micro-batch of prompts one way and as many :class:`Generation`
objects back, each three small tensors. Pickled one tensor at a time (what a Ray actor call
or a pipe does with a list of them) that is hundreds of objects per call: 13 ms out and 27 ms
back for a 64-sample call of the tiny demo under Ray. Packed into one array per field
(concatenated, with lengths), a call moves a handful of NumPy arrays, which pickle as their
buffers; the receiving side takes each row as a view of the flat arrays.

Used by the HF engine's child process (``engines.hf.process``) and by the generator hosts
of ``deploy=ray`` (``asyncflow.deploy.ray_hosts``, ``asyncflow.deploy.remote``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engines.protocols import Generation

__all__ = [
    "PackedGenerations",
    "pack_generations",
    "pack_prompts",
    "unpack_generations",
    "unpack_prompts",
]

PackedGenerations = tuple[
    np.ndarray,  # token ids, every row's concatenated (int64)
    np.ndarray,  # log-probs, concatenated (float32)
    np.ndarray,  # each row's length (int64)
    np.ndarray,  # each row's finish reason, an index into the next item (int64)
    tuple[str, ...],  # the finish reasons that occur
    np.ndarray,  # token versions, concatenated (int64)
    np.ndarray,  # each row's version (int64)
]


def pack_prompts(prompts: Sequence[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """``(flat token ids, lengths)``; every prompt must be a non-empty 1-D token tensor."""
    for i, prompt in enumerate(prompts):
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"prompt {i} must be a non-empty 1-D token tensor, got shape {tuple(prompt.shape)}"
            )
    lengths = np.fromiter((int(p.numel()) for p in prompts), dtype=np.int64, count=len(prompts))
    if not len(prompts):
        return np.zeros(0, dtype=np.int64), lengths
    flat = torch.cat([p.detach().reshape(-1).long().cpu() for p in prompts]).numpy()
    return flat, lengths


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its memory, copied first when it is read-only (an array
    deserialized from a shared buffer: torch must not write through it)."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def unpack_prompts(flat: np.ndarray, lengths: np.ndarray) -> list[torch.Tensor]:
    """The prompts :func:`pack_prompts` packed (views of ``flat``)."""
    if not len(lengths):
        return []
    return list(torch.split(_tensor(flat), lengths.tolist()))


def pack_generations(gens: Sequence[Generation]) -> PackedGenerations:
    """The generations as flat arrays (:data:`PackedGenerations`)."""
    reasons = tuple(sorted({g.finish_reason for g in gens}))
    if not gens:
        empty = np.zeros(0, dtype=np.int64)
        return empty, np.zeros(0, dtype=np.float32), empty, empty, reasons, empty, empty
    code = {r: i for i, r in enumerate(reasons)}
    return (
        torch.cat([g.token_ids.detach().long().cpu() for g in gens]).numpy(),
        torch.cat([g.logprobs.detach().float().cpu() for g in gens]).numpy(),
        np.array([len(g.token_ids) for g in gens], dtype=np.int64),
        np.array([code[g.finish_reason] for g in gens], dtype=np.int64),
        reasons,
        torch.cat([g.token_versions.cpu() for g in gens]).numpy(),
        np.array([g.version for g in gens], dtype=np.int64),
    )


def unpack_generations(packed: PackedGenerations) -> list[Generation]:
    """The generations :func:`pack_generations` packed; each row's tensors are views of the
    flat arrays, and its parts are consistent by construction (no per-row checks)."""
    tokens, logprobs, lengths, finish, reasons, token_versions, versions = packed
    tokens_t, logprobs_t = _tensor(tokens), _tensor(logprobs)
    token_versions_t = _tensor(token_versions)
    out: list[Generation] = []
    start = 0
    rows = zip(lengths.tolist(), finish.tolist(), versions.tolist(), strict=True)
    for n, fin, ver in rows:
        end = start + n
        out.append(
            Generation.checked_by_caller(
                tokens_t[start:end],
                logprobs_t[start:end],
                reasons[fin],
                ver,
                token_versions_t[start:end],
            )
        )
        start = end
    return out
