"""Adapters: each turns one engine role into a producer-consumer stage of TransferQueue.

| adapter           | task      | consumes                        | produces                    |
|-------------------|-----------|---------------------------------|-----------------------------|
| RolloutAdapter    | rollout   | prompt_ids                      | response_ids, finish_reason,|
|                   |           |                                 | behaviour_logprobs          |
| RewardAdapter     | reward    | prompt, response_ids, answer    | reward                      |
| ReferenceAdapter  | reference | prompt_ids, response_ids        | ref_logprobs                |
| TrainAdapter      | train     | prompt_ids, response_ids,       | optimizer steps (acks)      |
|                   |           | behaviour_logprobs, reward      |                             |

``FusedAdapter`` runs two adjacent stages as one (the rollout and a cheap reward:
``reward.colocate``).
"""

from adapters.base import Adapter, StageOutput
from adapters.fused import FusedAdapter
from adapters.ranker import LengthRanker
from adapters.reference import ReferenceAdapter
from adapters.reward import RewardAdapter
from adapters.rollout import (
    GenerationInstance,
    InstanceLostError,
    LeastLoadedRouter,
    LengthAwareRouter,
    RolloutAdapter,
    Router,
)
from adapters.train import StepReport, TrainAdapter, group_advantages, make_train_batch

__all__ = [
    "Adapter",
    "FusedAdapter",
    "GenerationInstance",
    "InstanceLostError",
    "LeastLoadedRouter",
    "LengthAwareRouter",
    "LengthRanker",
    "ReferenceAdapter",
    "RewardAdapter",
    "RolloutAdapter",
    "Router",
    "StageOutput",
    "StepReport",
    "TrainAdapter",
    "group_advantages",
    "make_train_batch",
]
