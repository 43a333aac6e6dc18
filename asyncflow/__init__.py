"""asyncflow: asynchronous, streaming RL post-training for LLMs through TransferQueue.

from asyncflow import load_config, run
result = run(load_config(overrides=["train.steps=40", "output.dir=runs/demo"]))
"""

from asyncflow.build import Components, EngineFactories, build_components
from asyncflow.config import RunConfig
from asyncflow.config.load import load_config
from asyncflow.stage_runner import StageError
from asyncflow.workflow import RunResult, Workflow, run

__all__ = [
    "Components",
    "EngineFactories",
    "RunConfig",
    "RunResult",
    "StageError",
    "Workflow",
    "build_components",
    "load_config",
    "run",
]
