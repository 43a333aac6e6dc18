"""Simulated engines: the RL roles with compute replaced by waiting for modelled time.

A benchmark harness runs the real workflow (TransferQueue, adapters, stage runners, staleness
control) on these engines to compare schedules (synchronous, streaming, asynchronous) in
minutes on a laptop: every modelled second takes ``time_scale`` real seconds, and the engines
use almost no CPU, so dozens of virtual accelerators fit on two cores.

| piece                              | role (``engines.protocols``) | models                     |
|------------------------------------|------------------------------|----------------------------|
| :class:`SimulatedGenerationEngine` | GenerationEngine             | continuous batching, sync  |
| :class:`DecodeLatency`             | (model)                      | iteration time, prefill    |
| :class:`LognormalLengths`,         | (model)                      | response lengths: long     |
| :class:`EmpiricalLengths`          |                              | tail, prompt-predictable   |
| :class:`SimulatedTrainingEngine`   | TrainingEngine               | time per token/sample/step |
| :class:`SimulatedReward`           | RewardFn                     | time per sample            |
| :class:`SimulatedEnvironment`      | Environment (engines.envs)   | turns, time per step (long |
|                                    |                              | tail: :class:`EnvLatency`) |
| :class:`LocalSamples`,             | (shared state)               | which sample a request is, |
| :class:`RaySamples`                |                              | across instances/processes |
| :func:`from_calibration`           | builds the above             | ``bench/calibrate.py``     |

Example::

    cal = from_calibration()                         # SmolLM2 on vLLM, measured here
    lengths = cal.lengths_for(sample_prompts)        # the fit moved onto the run's prompts
    gen = cal.generation_engine(
        time_scale=0.01, lengths=lengths, vocab_size=len(tokenizer), version=0
    )
    trainer = cal.training_engine(time_scale=0.01, gpus=4)
"""

from engines.simulated.calibration import BUILTIN, Calibration, calibrated, from_calibration
from engines.simulated.environment import EnvLatency, SimulatedEnvironment
from engines.simulated.generation import (
    DecodeLatency,
    GenerationStats,
    SimulatedGenerationEngine,
)
from engines.simulated.lengths import (
    EmpiricalLengths,
    LengthModel,
    LognormalLengths,
    content_score,
)
from engines.simulated.samples import (
    Cut,
    LocalSamples,
    RaySamples,
    SampleBook,
    SampleStore,
    start_ray_samples,
)
from engines.simulated.training import SimulatedReward, SimulatedTrainingEngine, TrainingCost

__all__ = [
    "BUILTIN",
    "Calibration",
    "Cut",
    "DecodeLatency",
    "EmpiricalLengths",
    "EnvLatency",
    "GenerationStats",
    "LengthModel",
    "LocalSamples",
    "LognormalLengths",
    "RaySamples",
    "SampleBook",
    "SampleStore",
    "SimulatedEnvironment",
    "SimulatedGenerationEngine",
    "SimulatedReward",
    "SimulatedTrainingEngine",
    "TrainingCost",
    "calibrated",
    "content_score",
    "from_calibration",
    "start_ray_samples",
]
