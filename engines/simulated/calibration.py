"""Simulated-engine models calibrated on real engines: ``bench/data/calibration.json``.

``bench/calibrate.py`` measures real engines and writes *profiles*; :func:`from_calibration`
reads one back as a :class:`Calibration`, which builds the simulated engines. Without the file
(an installed package, or a checkout without ``bench/``) the built-in :data:`BUILTIN` profiles
are used; they hold the numbers of the recorded calibration.

| profile       | decode (t(b), prefill) | weight sync         | training              | lengths |
|---------------|------------------------|---------------------|-----------------------|---------|
| smollm2       | vLLM, SmolLM2 bf16     | vLLM update_weights | HFTrainingEngine fp32 | SmolLM2 |
| smollm2-flops | as smollm2             | as smollm2          | 3 x prefill per token | SmolLM2 |
| tiny          | HFGenerationEngine     | HF load_weights     | HFTrainingEngine      | SmolLM2 |

Recorded (``smollm2``, modelled seconds): ``t(b) = 39.8 ms + 1.40 ms x b`` (24 tokens/s at
b = 1, 496 at b = 64), prefill 0.58 ms per prompt token, weight sync 0.74 s, training
9.3 ms per token and 0.88 s per optimizer step. The HF trainer (fp32, eager, one thread) is
about 5x less efficient per token than vLLM's kernels, which makes training unusually heavy
next to generation; ``smollm2-flops`` instead derives training from the prefill cost (forward
+ backward ~ 3 forwards), the ratio an accelerator running both sides with equally good
kernels has. SmolLM2 lengths (all profiles): see :mod:`engines.simulated.lengths`.

All times are of this machine's engines (2 shared CPU cores); a harness modelling faster
hardware scales them (``DecodeLatency.scaled``) or picks ``time_scale``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from engines.simulated.generation import DecodeLatency, SimulatedGenerationEngine
from engines.simulated.lengths import EmpiricalLengths, LengthModel, LognormalLengths
from engines.simulated.training import SimulatedTrainingEngine, TrainingCost

__all__ = ["BUILTIN", "DATA_DIR", "Calibration", "calibrated", "from_calibration"]

DATA_DIR = Path(__file__).resolve().parents[2] / "bench" / "data"
"""``bench/data`` of the source checkout, where ``bench/calibrate.py`` writes."""
_FILE = "calibration.json"

_LENGTHS = {
    "median": 130.0,
    "sigma": 0.668,
    "prompt_scale": 1.86,
    "ref_len": 63.2,
    "prompt_sigma": 0.184,
    "overlong_p": 0.0339,
    "overlong_slope": 0.55,
    "prompt_share": 0.185,
    "max_len": 1024,
}
_SMOLLM2_DECODE = {
    "base_s": 0.03975,
    "per_seq_s": 0.001396,
    "prefill_s_per_token": 0.0005788,
    "max_batch": 64,
}
BUILTIN: dict[str, Any] = {
    "default_profile": "smollm2",
    "profiles": {
        "smollm2": {
            "decode": _SMOLLM2_DECODE,
            "sync_s": 0.7448,
            "training": {"per_token_s": 0.009279, "per_sample_s": 0.0, "step_s": 0.8774},
            "lengths": _LENGTHS,
            "lengths_file": "lengths_smollm2.json",
        },
        "smollm2-flops": {
            "decode": _SMOLLM2_DECODE,
            "sync_s": 0.7448,
            "training": {"per_token_s": 0.001736, "per_sample_s": 0.0, "step_s": 0.8774},
            "lengths": _LENGTHS,
            "lengths_file": "lengths_smollm2.json",
        },
        "tiny": {
            "decode": {
                "base_s": 0.0008668,
                "per_seq_s": 4.884e-05,
                "prefill_s_per_token": 1.5e-05,
                "max_batch": 64,
            },
            "sync_s": 0.0005328,
            "training": {"per_token_s": 5.475e-05, "per_sample_s": 0.0, "step_s": 0.002794},
            "lengths": _LENGTHS,
            "lengths_file": "lengths_smollm2.json",
        },
    },
}
"""The recorded calibration (``bench/data/calibration.json``), for when the file is absent."""


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """One calibrated profile: the models, and builders of the simulated engines."""

    profile: str
    """Profile name (``smollm2``, ``tiny``)."""
    latency: DecodeLatency
    """Iteration-time model of one generation instance."""
    sync_s: float
    """Modelled seconds a weight update pauses generation."""
    training: TrainingCost
    """Training cost model (one device)."""
    lengths: LognormalLengths
    """Lognormal fit of the measured response lengths, centred on the calibration prompts
    (``ref_len`` tokens of SmolLM2's chat template): use :meth:`lengths_for` for others."""
    prompt_share: float
    """Measured share of the log-length variance between prompts."""
    lengths_file: Path | None
    """The measured lengths (for :meth:`empirical_lengths`), if the file exists."""
    source: str = field(compare=False)
    """Where the numbers came from: a file path or ``"built-in"``."""

    def lengths_for(
        self, prompts: Sequence[torch.Tensor], *, prompt_share: float | None = None
    ) -> LognormalLengths:
        """The fitted lengths moved onto the run's prompts (a few hundred of them, encoded).

        The median becomes the calibrated median over ``prompts`` and the prompt explains
        ``prompt_share`` of the log-variance on them (default: the measured share), whatever
        their tokenizer and template. Without this, prompts much shorter than ``ref_len``
        get far shorter responses (the prompt-length exponent extrapolated).
        """
        share = self.prompt_share if prompt_share is None else prompt_share
        return self.lengths.adapted(prompts, prompt_share=share)

    def generation_engine(
        self, *, time_scale: float, lengths: LengthModel | None = None, **kwargs: Any
    ) -> SimulatedGenerationEngine:
        """A generation engine with this profile's latency, ``sync_s`` and lengths.

        Pass ``lengths=cal.lengths_for(prompts)`` unless the prompts resemble the calibration
        prompts (SmolLM2 chat template, ~63 tokens); other keywords go to the engine.
        """
        kwargs.setdefault("sync_s", self.sync_s)
        return SimulatedGenerationEngine(
            self.latency, lengths or self.lengths, time_scale=time_scale, **kwargs
        )

    def training_engine(self, *, time_scale: float, **kwargs: Any) -> SimulatedTrainingEngine:
        """A training engine with this profile's cost (``gpus``, ``version`` as keywords)."""
        return SimulatedTrainingEngine(self.training, time_scale=time_scale, **kwargs)

    def empirical_lengths(
        self, prompts: Sequence[torch.Tensor] | None = None, **kwargs: Any
    ) -> EmpiricalLengths:
        """The measured lengths replayed, the measured share holding on ``prompts`` if given.

        Keywords override :class:`EmpiricalLengths` arguments (e.g. ``prompt_share``, ``seed``).
        """
        if self.lengths_file is None:
            raise FileNotFoundError(
                f"profile {self.profile!r} ({self.source}) has no lengths file; run "
                "python -m bench.calibrate with vLLM and SmolLM2 installed"
            )
        model = EmpiricalLengths.from_json(self.lengths_file, **kwargs)
        return model if prompts is None else model.adapted(prompts)


def from_calibration(
    path: str | os.PathLike[str] | None = None, *, profile: str | None = None
) -> Calibration:
    """Load a calibration profile (default: the file's default profile).

    ``path`` None reads ``bench/data/calibration.json`` of the checkout if present, else the
    built-in copy. Raises ``ValueError`` naming the known profiles for an unknown one.
    """
    if path is None:
        candidate = DATA_DIR / _FILE
        data, source, folder = (
            (json.loads(candidate.read_text()), f"bench/data/{_FILE}", DATA_DIR)
            if candidate.is_file()
            else (BUILTIN, "built-in", DATA_DIR)
        )
    else:
        file = Path(path)
        data, source, folder = json.loads(file.read_text()), str(file), file.parent
    profiles: dict[str, Any] = data.get("profiles", {})
    name = profile or data.get("default_profile", "")
    if name not in profiles:
        raise ValueError(f"unknown calibration profile {name!r}; known: {sorted(profiles)}")
    p = profiles[name]
    lengths_file = folder / p["lengths_file"] if p.get("lengths_file") else None
    known = {f.name for f in fields(LognormalLengths)}
    return Calibration(
        profile=name,
        latency=DecodeLatency(**p["decode"]),
        sync_s=float(p["sync_s"]),
        training=TrainingCost(**p["training"]),
        lengths=LognormalLengths(**{k: v for k, v in p.get("lengths", {}).items() if k in known}),
        prompt_share=float(p.get("lengths", {}).get("prompt_share", 0.0)),
        lengths_file=lengths_file if lengths_file is not None and lengths_file.is_file() else None,
        source=source,
    )


def calibrated(profile: str | None = None) -> Calibration:
    """:func:`from_calibration` of the recorded file (or the built-in copy)."""
    return from_calibration(profile=profile)
