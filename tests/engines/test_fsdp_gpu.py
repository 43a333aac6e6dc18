"""Sharded training on a GPU (needs CUDA; skipped without it): one rank over NCCL, the tiny
model sharded with FSDP2 (bf16 compute over fp32 shards too), against the same engine
unsharded on the same batches; a sharded checkpoint written and read back on the device; the
weights gathered a bucket at a time onto the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.distributed import free_port, init_group, leave_group
from engines.fsdp import FSDPConfig
from engines.hf import HFTrainingConfig, HFTrainingEngine
from tests.engines.fsdp_ranks import STEP_SAMPLES, step_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _losses(engine: HFTrainingEngine, steps: range) -> list[float]:
    vocab = int(engine.model.config.vocab_size)
    out = []
    for step in steps:
        out.append(engine.forward_backward(step_batch(step, vocab), 1.0 / STEP_SAMPLES)["loss"])
        engine.optimizer_step()
    return out


def test_fsdp_on_nccl_trains_like_the_unsharded_engine(tiny_dir: Path, tmp_path: Path) -> None:
    config = HFTrainingConfig(lr=1e-3, max_micro_batch_size=2)
    init_group(0, 1, "127.0.0.1", free_port(), backend="nccl", timeout_s=60)
    try:
        plain = HFTrainingEngine(tiny_dir, config=config, device="cuda")
        want = _losses(plain, range(4))
        sharded = HFTrainingEngine(tiny_dir, config=config, device="cuda")
        sharded.shard(FSDPConfig(bucket_bytes=64 << 10))
        got = _losses(sharded, range(4))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-5)
        buckets = list(sharded.state_buckets(64 << 10))
        assert len(buckets) > 3 and all(t.is_cuda for b in buckets for t in b.values())
        plain_state = plain.state_dict()
        for b in buckets:
            for name, t in b.items():
                torch.testing.assert_close(t, plain_state[name], rtol=1e-3, atol=1e-5)
        sharded.save(tmp_path / "ckpt")
        resumed = HFTrainingEngine(tiny_dir, config=config, device="cuda")
        resumed.shard(FSDPConfig(bucket_bytes=64 << 10))
        resumed.load(tmp_path / "ckpt")
        assert resumed.version == 4
        again = torch.tensor(_losses(resumed, range(4, 6)))
        torch.testing.assert_close(again, torch.tensor(_losses(sharded, range(4, 6))))
        mixed = HFTrainingEngine(tiny_dir, config=config, device="cuda")
        mixed.shard(FSDPConfig(param_dtype="bfloat16", reduce_dtype="float32"))
        close = _losses(mixed, range(2))
        torch.testing.assert_close(
            torch.tensor(close), torch.tensor(want[:2]), rtol=0.05, atol=0.05
        )
    finally:
        leave_group()
