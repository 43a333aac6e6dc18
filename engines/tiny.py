"""A tiny causal LM built offline in seconds, for the CPU demo and tests.

Nothing is downloaded: the tokenizer is trained by ``tokenizers`` on text generated here, the
model is a small Llama initialized from a seed, and an optional supervised warm start
teaches it a task's answer format. The result is a ``save_pretrained`` folder (``config.json``,
``model.safetensors``, ``generation_config.json``, tokenizer files, ``tiny_build.json``) that
transformers and vLLM load like any checkpoint.

Folders are cached under ``cache_dir`` by a hash of everything that determines their content
(the configs, the task spec, the builder's format version and the torch/transformers/tokenizers
versions), so a second call is a load from disk. Building is deterministic for a given seed on
a given software stack (and thread count).

Tokenizer: byte-level BPE with every digit its own token (numbers are read digit by digit,
which makes arithmetic learnable for a tiny model), special tokens ``<|bos|> <|eos|> <|pad|>
<|user|> <|assistant|> <|system|>`` and a chat template::

    <|bos|><|user|>\\n{content}<|eos|>\\n<|assistant|>\\n{reply}<|eos|>\\n

A recipe that learns on 2 CPU cores (GRPO, measured over 4 seeds, ~25 s for 300 steps on one
core): single-digit addition (``ArithmeticConfig()`` defaults), the default
:class:`WarmStartConfig` (50 steps, ~2 s: greedy accuracy ~0.3), then 8 prompts x 8 samples per
step, temperature 0.7, ``max_new_tokens=4``, binary ``MathAnswerReward``, AdamW lr 2e-4 with
grad-norm clip 1.0. Mean sampled reward rises from ~0.22 (first 10% of 300 steps) to ~0.5
(last 10%). Without the warm start the random model rarely writes a number (reward ~0.01) and
300 steps reach only ~0.1; a format-only warm start reaches ~0.14. RL lr >= 5e-4 intermittently
collapses the policy.

Called by examples, tests and benchmarks that need a model without a hub.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from engines.hf.text import encode_prompts
from engines.tasks import Task, TaskItem

if TYPE_CHECKING:  # transformers' model classes load where a model is built or loaded
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "SPECIAL_TOKENS",
    "TinyConfig",
    "WarmStartConfig",
    "build_model",
    "build_tiny",
    "build_tokenizer",
    "corpus",
    "default_cache_dir",
    "load_tiny",
    "load_tokenizer",
    "warm_start",
]

_FORMAT_VERSION = 1  # bump when the builder's output changes for the same inputs
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_WORDS_TEXT = """
    what is the answer compute add subtract multiply divide sum difference product quotient
    use each number once to make reach target with numbers and or not equals result step think
    first then write only a plus minus times over is are of in on for it this that solve
    problem question correct wrong final value expression let us we have so get"""


@dataclass(kw_only=True, frozen=True)
class TinyConfig:
    """Shape of the tiny model and its tokenizer.

    The architecture is Llama: its folders load with the tokenizer saved here through
    ``AutoTokenizer`` everywhere, whereas model types such as ``qwen2`` make ``AutoTokenizer``
    substitute their own tokenizer class (adding tokens the model does not have).
    """

    vocab_size: int = 320
    """Target BPE vocabulary (the 256 bytes and the special tokens included)."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads (``hidden_size`` must be divisible by it)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when smaller than ``num_heads``)."""
    intermediate_size: int = 512
    """Width of the MLP."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt and response)."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output head."""
    seed: int = 0
    """Seeds the weight initialization (the tokenizer does not depend on it)."""

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes and special "
                f"tokens), got {self.vocab_size}"
            )
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}), and num_heads by num_kv_heads ({self.num_kv_heads})"
            )


@dataclass(kw_only=True, frozen=True)
class WarmStartConfig:
    """Supervised warm start on a task's reference completions (see :func:`warm_start`)."""

    steps: int = 50
    """AdamW steps. The defaults (about 2 s on one core) take single-digit addition to about
    30% greedy accuracy: the format is learned and there is room left for RL to show."""
    batch_size: int = 32
    """Examples per step."""
    lr: float = 1e-3
    """Learning rate (3e-3 and above make the tiny model stall on a constant answer)."""
    format_only: bool = False
    """Train on the reference of a *different* item: teaches the format, not the answers."""
    start_index: int = 1_000_000
    """First task item used, far from the indexes a training run starts with."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(
                f"steps, batch_size and lr must be positive, got {self.steps}, "
                f"{self.batch_size}, {self.lr}"
            )


def default_cache_dir() -> Path:
    """``~/.cache/asyncflow/tiny``, where :func:`build_tiny` caches when given no folder."""
    return Path.home() / ".cache" / "asyncflow" / "tiny"


def corpus() -> list[str]:
    """The tokenizer's training text: arithmetic, countdown and a few hundred word lines."""
    rng = random.Random(0)
    words = _WORDS_TEXT.split()
    lines: list[str] = []
    for _ in range(1500):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        lines.append(f"What is {a} {op} {b}? The answer is {rng.randint(-999, 9999)}.")
        nums = " ".join(str(rng.randint(1, 99)) for _ in range(rng.randint(2, 5)))
        lines.append(f"Use {nums} to make {rng.randint(1, 999)}. ({a} - {b}) * {a // 7} = {b}")
        lines.append(" ".join(rng.choice(words) for _ in range(12)).capitalize() + ".")
    return lines


def build_tokenizer(config: TinyConfig | None = None) -> PreTrainedTokenizerFast:
    """Train the byte-level, digit-splitting BPE tokenizer (well under a second)."""
    from transformers import PreTrainedTokenizerFast

    config = config or TinyConfig()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(config: TinyConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialized model sized for ``tokenizer``; the same weights for the same seed."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    config: WarmStartConfig | None = None,
) -> dict[str, float]:
    """Supervised fine-tuning in place on ``task``'s reference completions.

    Prompts are encoded with :func:`engines.hf.text.encode_prompts` (the chat template), as the
    rollout encodes them; the target is the reference text followed by EOS. A multi-turn task
    (one with an environment, whose items give ``turns``) trains on whole correct episodes
    instead: its turns with the observations its environment (default options) answers
    between them, the loss on the model's turns only (:mod:`engines.episodes.reference`).
    Deterministic: the data is the task's items from ``config.start_index`` (modulo the task's
    size if it is finite) and nothing is sampled. Returns the first and last step losses and
    the seconds taken.
    """
    from engines.hf.batching import response_logprobs, right_pad

    config = config or WarmStartConfig()
    if tokenizer.eos_token_id is None:
        raise ValueError("warm_start needs a tokenizer with an eos token")
    eos = int(tokenizer.eos_token_id)
    episodes = _reference_episodes(task, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.99))
    model.train()
    started = time.perf_counter()
    losses: list[float] = []
    for step in range(config.steps):
        first = config.start_index + step * config.batch_size
        # A finite task (a file read for a few epochs) is read round and round.
        limit = task.num_items()
        indexes = range(first, first + config.batch_size + 1)
        items = [task.item(i if limit is None else i % limit) for i in indexes]
        prompts = encode_prompts(tokenizer, [it.prompt for it in items[:-1]])
        targets = items[1:] if config.format_only else items[:-1]
        if episodes is not None:
            pairs = [episodes(it) for it in targets]
            responses = [ids for ids, _ in pairs]
            train_mask = right_pad([m for _, m in pairs], False, torch.bool)[0]
        else:
            responses = [
                torch.tensor([*tokenizer(it.reference, add_special_tokens=False)["input_ids"], eos])
                for it in targets
            ]
            train_mask = None
        scored = response_logprobs(model, prompts, responses)
        mask = scored.mask if train_mask is None else scored.mask & train_mask
        loss = -((scored.logprobs * mask).sum() / mask.sum())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "seconds": time.perf_counter() - started,
    }


def _reference_episodes(
    task: Task, tokenizer: PreTrainedTokenizerBase
) -> Callable[[TaskItem], tuple[torch.Tensor, torch.Tensor]] | None:
    """For a multi-turn task: item -> its correct episode's tokens and loss mask."""
    if task.environment is None:
        return None
    from engines.envs import environment_factory
    from engines.episodes.format import TurnFormat
    from engines.episodes.reference import reference_episode

    factory = environment_factory(task.environment)
    turn_format = TurnFormat(tokenizer)
    return functools.partial(reference_episode, factory=factory, turn_format=turn_format)


def _cache_key(config: TinyConfig, task: Task | None, warm: WarmStartConfig | None) -> str:
    spec = {
        "format": _FORMAT_VERSION,
        "tiny": asdict(config),
        "warm_start": None
        if task is None
        else {"task": task.spec(), **asdict(warm or WarmStartConfig())},
        # (transformers' version from its metadata: a cached folder is found without it)
        "versions": [
            torch.__version__,
            importlib.metadata.version("transformers"),
            tokenizers.__version__,
        ],
    }
    blob = json.dumps(spec, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def build_tiny(
    config: TinyConfig | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    warm_start_task: Task | None = None,
    warm_start_config: WarmStartConfig | None = None,
) -> Path:
    """Build (or find in the cache) the tiny model folder and return its path.

    With ``warm_start_task`` the saved weights are those after :func:`warm_start`. Concurrent
    builders of the same key are safe: each writes a private folder and renames it into place;
    the first rename wins.
    """
    config = config or TinyConfig()
    if warm_start_task is None and warm_start_config is not None:
        raise ValueError("warm_start_config was given without warm_start_task")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = _cache_key(config, warm_start_task, warm_start_config)
    name = f"llama-h{config.hidden_size}-l{config.num_layers}-{key}"
    target = root / name
    if (target / "tiny_build.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    info: dict[str, Any] = {"key": key, "tiny": asdict(config)}
    if warm_start_task is not None:
        warm = warm_start_config or WarmStartConfig()
        stats = warm_start(model, tokenizer, warm_start_task, warm)
        info["warm_start"] = {"task": warm_start_task.spec(), **asdict(warm), **stats}
    info["build_seconds"] = time.perf_counter() - started
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "tiny_build.json").write_text(json.dumps(info, indent=2, sort_keys=True))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "tiny_build.json").is_file():  # not a lost race: a real error
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_tiny(
    config: TinyConfig | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    warm_start_task: Task | None = None,
    warm_start_config: WarmStartConfig | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """:func:`build_tiny`, then load the folder: ``(model in eval mode, tokenizer)``."""
    path = build_tiny(
        config,
        cache_dir=cache_dir,
        warm_start_task=warm_start_task,
        warm_start_config=warm_start_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model.eval()
    return model, load_tokenizer(path)


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """The tokenizer of a folder :func:`build_tiny` wrote: the class it saved, loaded directly.

    ``AutoTokenizer`` gives the same object (a test checks it), but resolving the class loads
    transformers' model registry, about 1.4 s of CPU more in every process that needs only
    the tokenizer (the driver, a reward worker).
    """
    from transformers import PreTrainedTokenizerFast

    tokenizer: PreTrainedTokenizerFast = PreTrainedTokenizerFast.from_pretrained(
        path, local_files_only=True
    )
    return tokenizer
