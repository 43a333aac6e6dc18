"""Deterministic pseudo-randomness from hashes: the same inputs give the same draws anywhere.

The simulated engines must produce the same lengths, tokens and rewards for the same prompt,
sample index and seed in every process and run, whatever the order of calls, so they derive
their randomness from stable hashes (BLAKE2b, SplitMix64), never from a shared generator.
"""

from __future__ import annotations

import hashlib
import math
import struct
from statistics import NormalDist

import numpy as np
import torch

__all__ = ["hash64", "normal", "prompt_key", "token_weights", "uniform"]

_MASK = (1 << 64) - 1
_STD_NORMAL = NormalDist()


def prompt_key(prompt: torch.Tensor) -> bytes:
    """8-byte digest of a prompt's token ids (dtype-independent)."""
    ids = prompt.reshape(-1).to(torch.int64).numpy()
    return hashlib.blake2b(ids.tobytes(), digest_size=8).digest()


def hash64(*parts: bytes | int | str) -> int:
    """A 64-bit hash of ``parts`` (bytes, ints or strings, in order)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, bytes):
            h.update(b"b" + struct.pack("<I", len(part)) + part)
        elif isinstance(part, int):
            h.update(b"i" + (part & _MASK).to_bytes(8, "little"))
        else:
            data = part.encode()
            h.update(b"s" + struct.pack("<I", len(data)) + data)
    return int.from_bytes(h.digest(), "little")


def uniform(*parts: bytes | int | str) -> float:
    """A uniform draw in the open interval (0, 1) determined by ``parts``."""
    return ((hash64(*parts) >> 11) + 0.5) / float(1 << 53)


def normal(*parts: bytes | int | str) -> float:
    """A standard normal draw determined by ``parts`` (inverse CDF of :func:`uniform`)."""
    return _STD_NORMAL.inv_cdf(uniform(*parts))


def token_weights(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random weight in [-sqrt 3, sqrt 3] (mean 0, variance 1) per token id.

    SplitMix64 of ``id ^ salt``, vectorized: the same id always gets the same weight, so any
    function of a prompt's bag of tokens built from these weights is a linear function of its
    token counts (what a bag-of-tokens regressor can learn).
    """
    x = (ids.astype(np.uint64) ^ np.uint64(salt & _MASK)) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)  # [0, 1)
    return (2.0 * u - 1.0) * math.sqrt(3.0)
