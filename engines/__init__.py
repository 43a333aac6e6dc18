"""Engines of the RL loop: generation, scoring, training and rewards.

Engines know nothing of TransferQueue; see :mod:`engines.protocols` for the roles.
"""

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
