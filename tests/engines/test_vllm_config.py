"""The parts of the vLLM engine that need no vLLM: config, errors, and the weights file."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.vllm_config import WORKER_EXTENSION
from engines.vllm_engine import VLLMEngineConfig, VLLMGenerationEngine, VLLMUnavailableError
from engines.vllm_outputs import ResponseParts, switch_positions, token_versions
from engines.weights_io import (
    TensorSpec,
    checkpoint_shapes,
    checkpoint_specs,
    mismatches,
    pack_state,
    unpack_state,
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_model_len", 1),
        ("max_num_seqs", 0),
        ("kv_cache_gib", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("update_mode", "keep"),
        ("update_timeout_s", 0.0),
        ("engine_kwargs", {"weight_transfer_config": {"backend": "nccl"}}),
    ],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        VLLMEngineConfig(model="m", **{field: value})  # type: ignore[arg-type]


def test_engine_args() -> None:
    config = VLLMEngineConfig(model="m", kv_cache_gib=0.5, engine_kwargs={"max_num_seqs": 8})
    cpu = config.engine_args(cpu=True)
    assert cpu["logprobs_mode"] == "processed_logprobs"
    assert cpu["worker_extension_cls"] == "engines.vllm_worker.VLLMWorkerExtension"
    assert cpu["weight_transfer_config"] == {"backend": "asyncflow_shm"}
    assert cpu["kv_cache_memory_bytes"] == 1 << 29
    assert cpu["max_num_seqs"] == 8  # engine_kwargs win
    assert cpu["enable_chunked_prefill"] is False  # seeded requests crash chunked CPU prefill
    assert "enable_chunked_prefill" not in config.engine_args(cpu=False)
    forced = VLLMEngineConfig(model="m", enable_chunked_prefill=True, kv_cache_gib=None)
    assert forced.engine_args(cpu=True)["enable_chunked_prefill"] is True
    assert "kv_cache_memory_bytes" not in forced.engine_args()


def test_missing_vllm_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(VLLMUnavailableError, match=r"pip install \"asyncflow\[vllm\]\""):
        VLLMGenerationEngine(model="m")


def test_importing_the_module_does_not_import_vllm() -> None:
    code = "import sys, engines.vllm_engine; assert 'vllm' not in sys.modules, 'imported vllm'"
    subprocess.run([sys.executable, "-c", code], check=True)
    module, _, name = WORKER_EXTENSION.rpartition(".")
    spec = importlib.util.find_spec(module)  # resolved by name in vLLM's workers
    assert spec is not None and spec.origin is not None
    assert f"class {name}:" in Path(spec.origin).read_text()


def test_weights_file_round_trips_awkward_tensors() -> None:
    tied = torch.randn(10, 4)
    state = {
        "embed": tied,
        "head": tied,  # shares storage: written once
        "bf16": torch.randn(3, 5, dtype=torch.bfloat16),
        "transposed": torch.randn(4, 6).t(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 7),
        "ints": torch.arange(9, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    packed = pack_state(state)
    try:
        assert Path(packed.path).stat().st_size == packed.nbytes
        embed_offset = next(e[3] for e in packed.layout if e[0] == "embed")
        assert next(e[3] for e in packed.layout if e[0] == "head") == embed_offset
        out = dict(unpack_state(packed.path, packed.layout))
        assert list(out) == list(state)
        for name, tensor in state.items():
            assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name
    finally:
        packed.unlink()
        packed.unlink()  # idempotent
    assert not Path(packed.path).exists()


def test_weights_file_casts_floats_only() -> None:
    state = {"w": torch.randn(8, 8), "ids": torch.arange(4)}
    packed = pack_state(state, float_dtype=torch.bfloat16)
    try:
        out = dict(unpack_state(packed.path, packed.layout))
        assert out["w"].dtype == torch.bfloat16 and out["ids"].dtype == torch.int64
        assert torch.equal(out["w"], state["w"].to(torch.bfloat16))
    finally:
        packed.unlink()


def test_weights_file_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['x'\]"):
        pack_state({"x": [1.0]}, directory=tmp_path)  # type: ignore[dict-item]
    packed = pack_state({"x": torch.ones(64)}, directory=tmp_path)
    assert Path(packed.path).parent == tmp_path
    with pytest.raises(ValueError, match="ends at byte"):
        list(unpack_state(packed.path, [["x", "float32", [128], 0]]))
    packed.unlink()


def test_checkpoint_shapes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(3, 4), "b": torch.zeros(2)}, str(tmp_path / "m.safetensors"))
    assert checkpoint_shapes(tmp_path) == {"a.weight": (3, 4), "b": (2,)}
    assert checkpoint_shapes(tmp_path / "missing") is None
    assert checkpoint_shapes("org/hub-name") is None


def test_mismatches_name_every_kind_of_problem(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ckpt = {"embed": torch.zeros(5, 4), "norm": torch.zeros(4, dtype=torch.bfloat16)}
    save_file({**ckpt, "ids": torch.zeros(3, dtype=torch.int64)}, str(tmp_path / "m.safetensors"))
    specs = checkpoint_specs(tmp_path)
    assert specs is not None
    assert specs["norm"] == TensorSpec(shape=(4,), dtype="BF16") and specs["norm"].floating
    assert not specs["ids"].floating
    f32, i64 = torch.float32, torch.int64
    good = [("embed", (5, 4), f32), ("norm", (4,), f32), ("ids", (3,), i64)]  # casts allowed
    assert mismatches(specs, good) is None
    shape = mismatches(specs, [("embed", (4, 5), f32), *good[1:]])
    assert shape is not None and "'embed' has shape (4, 5), the served model has (5, 4)" in shape
    ints = mismatches(specs, [*good[:2], ("ids", (3,), torch.int32)])
    assert ints is not None and "'ids' has dtype torch.int32, the served model has I64" in ints
    floats = mismatches(specs, [*good[:2], ("ids", (3,), f32)])
    assert floats is not None and "'ids' has dtype torch.float32" in floats
    names = mismatches(specs, [*good[1:], ("bogus", (1,), f32)])
    assert names is not None and "unknown: ['bogus'] (1), missing: ['embed'] (1)" in names


def test_vllm_outputs_per_token_versions_and_parts() -> None:
    """Runs of version labels become one version per output token; parts of a response
    submitted again join with their versions; a mismatch or an unknown label fails."""
    from types import SimpleNamespace as Span

    labels = {"default": 0, "4": 4, "5": 5}

    def version_of(label: str) -> int:
        if label not in labels:
            raise KeyError(label)
        return labels[label]

    spans = [Span(start=3, end=5, version="5"), Span(start=0, end=3, version="4")]
    assert token_versions(spans, 5, version_of, current=9) == [4, 4, 4, 5, 5]
    assert token_versions([], 2, version_of, current=9) == [9, 9]
    with pytest.raises(RuntimeError, match="labelled 5 output tokens"):
        token_versions(spans, 6, version_of, current=9)
    with pytest.raises(KeyError):
        token_versions([Span(start=0, end=1, version="broken")], 1, version_of, current=9)
    assert switch_positions([4, 4, 4, 5, 5, 6]) == [3, 5]
    parts = ResponseParts()
    parts.add([11, 12, 13], [-0.1, -0.2, -0.3], [4, 4, 4])
    parts.add([14], [-0.4], [5])
    gen = parts.generation("stop", current=5)
    assert gen.token_ids.tolist() == [11, 12, 13, 14] and gen.version == 4
    assert gen.token_versions.tolist() == [4, 4, 4, 5] and gen.version_span == 1
    assert ResponseParts().generation("length", current=7).version == 7
    with pytest.raises(ValueError, match="one version per token"):
        parts.add([1], [-0.1], [])
