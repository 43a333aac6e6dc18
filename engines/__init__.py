"""Engines of the RL loop: generation, scoring, training and rewards.

Engines know nothing of TransferQueue; see :mod:`engines.protocols` for the roles.
"""

from typing import TYPE_CHECKING

from engines.lazy import lazy_names

if TYPE_CHECKING:
    from engines.protocols import (
        CheckpointableEngine,
        Generation,
        GenerationEngine,
        RewardFn,
        SamplingParams,
        ScoringEngine,
        TrainBatch,
        TrainingEngine,
    )

__all__ = [
    "CheckpointableEngine",
    "Generation",
    "GenerationEngine",
    "RewardFn",
    "SamplingParams",
    "ScoringEngine",
    "TrainBatch",
    "TrainingEngine",
]

_LAZY = dict.fromkeys(__all__, "engines.protocols")
"""Imported on first use (PEP 562): the config, the tasks and the rewards import without
torch, so a run can start Ray while torch loads (:mod:`asyncflow.deploy.ray_start`)."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
