"""asyncflow: asynchronous, streaming RL post-training for LLMs through TransferQueue.

from asyncflow import load_config, run
result = run(load_config(overrides=["train.steps=40", "output.dir=runs/demo"]))
"""

from typing import TYPE_CHECKING

from transferqueue.lazy import lazy_names

if TYPE_CHECKING:
    from asyncflow.build import Components, EngineFactories, build_components
    from asyncflow.config import RunConfig
    from asyncflow.config.load import load_config
    from asyncflow.launch import run
    from asyncflow.stage_runner import StageError
    from asyncflow.workflow import RunResult, Workflow

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

_LAZY = {
    "Components": "asyncflow.build",
    "EngineFactories": "asyncflow.build",
    "build_components": "asyncflow.build",
    "RunConfig": "asyncflow.config",
    "load_config": "asyncflow.config.load",
    "StageError": "asyncflow.stage_runner",
    "RunResult": "asyncflow.workflow",
    "Workflow": "asyncflow.workflow",
    "run": "asyncflow.launch",
}
"""Public names imported on first use (PEP 562): a Ray actor that runs one part of a
deployment (the coordinator) imports that part, not torch and transformers."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
