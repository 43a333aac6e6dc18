"""Run configuration: nested dataclasses with defaults that run on 2 CPU cores in about a minute.

| module     | what it holds                                                                |
|------------|------------------------------------------------------------------------------|
| ``sections`` | each stage's section: model, task, rollout, reward, reference, train       |
| ``run``    | the run around them: TransferQueue, output, deploy, checkpoint, eval, ``RunConfig`` |
| ``load``   | defaults < YAML file < ``section.field=value`` overrides, with one-line errors |
| ``check``  | checks that import or open something (model folder, rewards, task data)      |
| ``help``   | every field with its type, default and docstring (``asyncflow run --help``)  |
"""

from asyncflow.config.load import config_to_dict, load_config
from asyncflow.config.run import (
    CheckpointConfig,
    DeployConfig,
    EvalConfig,
    OutputConfig,
    RunConfig,
    TQConfig,
)
from asyncflow.config.sections import (
    LOGGER_NAMES,
    RENAMED_KEYS,
    AutoscaleConfig,
    ConfigError,
    EnvConfig,
    ModelConfig,
    PlacementConfig,
    ReferenceConfig,
    RewardConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "LOGGER_NAMES",
    "RENAMED_KEYS",
    "AutoscaleConfig",
    "CheckpointConfig",
    "ConfigError",
    "DeployConfig",
    "EnvConfig",
    "EvalConfig",
    "ModelConfig",
    "OutputConfig",
    "PlacementConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TQConfig",
    "TaskConfig",
    "TrainConfig",
    "config_to_dict",
    "load_config",
]
