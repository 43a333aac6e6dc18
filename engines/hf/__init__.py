"""HF transformers engines: generation, scoring and training on one causal LM.

| class               | role (engines.protocols) | built from                         |
|---------------------|--------------------------|------------------------------------|
| HFGenerationEngine  | GenerationEngine         | model folder or in-memory model    |
| HFScoringEngine     | ScoringEngine            | model folder or in-memory model    |
| HFTrainingEngine    | TrainingEngine           | model folder or in-memory model    |

All three share one log-prob convention: ``log_softmax(logits / temperature)``.
"""

from typing import TYPE_CHECKING

from engines.lazy import lazy_names

if TYPE_CHECKING:
    from engines.hf.generation import HFGenerationEngine, sample_tokens
    from engines.hf.loading import ModelSource, load_model, load_weights
    from engines.hf.scoring import HFScoringEngine
    from engines.hf.text import decode_responses, encode_prompts
    from engines.hf.training import HFTrainingConfig, HFTrainingEngine

__all__ = [
    "HFGenerationEngine",
    "HFScoringEngine",
    "HFTrainingConfig",
    "HFTrainingEngine",
    "ModelSource",
    "decode_responses",
    "encode_prompts",
    "load_model",
    "load_weights",
    "sample_tokens",
]

_LAZY = {
    "HFGenerationEngine": "engines.hf.generation",
    "sample_tokens": "engines.hf.generation",
    "ModelSource": "engines.hf.loading",
    "load_model": "engines.hf.loading",
    "load_weights": "engines.hf.loading",
    "HFScoringEngine": "engines.hf.scoring",
    "decode_responses": "engines.hf.text",
    "encode_prompts": "engines.hf.text",
    "HFTrainingConfig": "engines.hf.training",
    "HFTrainingEngine": "engines.hf.training",
}
"""Public names imported on first use (PEP 562): a process that only decodes text (a reward
worker, the rollout's dispatcher) imports ``engines.hf.text``, not the model code."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
