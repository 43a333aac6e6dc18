"""HF transformers engines: generation, scoring and training on one causal LM.

| class               | role (engines.protocols) | built from                         |
|---------------------|--------------------------|------------------------------------|
| HFGenerationEngine  | GenerationEngine         | model folder or in-memory model    |
| HFScoringEngine     | ScoringEngine            | model folder or in-memory model    |
| HFTrainingEngine    | TrainingEngine           | model folder or in-memory model    |

All three share one log-prob convention: ``log_softmax(logits / temperature)``.
"""

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
