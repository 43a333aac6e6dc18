"""Sharded training (engines/fsdp.py, HFTrainingEngine.shard): two real gloo ranks in two
processes on the tiny model (tests/engines/fsdp_ranks.py).

- FSDP2 trains the same batches to the same losses, gradient norms and weights as
  data-parallel replicas with all-reduced gradients (DDP), with the ranks running different
  numbers of micro-batches;
- its checkpoint (sharded weights and AdamW state, and the gathered policy folder) survives
  the ranks being killed right after it: resumed ranks continue as if never stopped;
- the weights gathered for publishing come one bucket at a time, each at most the bucket size
  (or one tensor, if larger);
- the policy folder gathered bucket by bucket loads with ``from_pretrained``.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.distributed import free_port
from tests.engines.fsdp_ranks import BUCKET_BYTES, kill, run_rank

pytestmark = pytest.mark.service


def _run(model: Path, out: Path, job: dict[str, Any], *, killed: bool = False) -> list[Any]:
    """Two ranks of ``job``; their results (or, ``killed``: SIGKILL both once they saved)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=run_rank, args=(r, port, str(model), str(out), job)) for r in range(2)
    ]
    for p in procs:
        p.start()
    if killed:
        deadline = time.monotonic() + 180
        while not all((out / f"saved{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not save their checkpoint"
            assert all(p.is_alive() for p in procs), "a rank died before saving"
            time.sleep(0.2)
        for p in procs:
            assert p.pid is not None
            kill(p.pid)
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == (-9 if killed else 0), f"rank exited with {p.exitcode}"
    return [] if killed else [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _step_losses(ranks: list[Any]) -> torch.Tensor:
    return torch.tensor(ranks[0]["losses"]) + torch.tensor(ranks[1]["losses"])


def test_fsdp_trains_like_ddp_on_the_same_batches(tiny_dir: Path, tmp_path: Path) -> None:
    steps = range(4)
    ddp = _run(tiny_dir, tmp_path / "ddp", {"mode": "ddp", "steps": steps})
    policy = tmp_path / "policy"
    fsdp = _run(tiny_dir, tmp_path / "fsdp", {"mode": "fsdp", "steps": steps, "policy": policy})
    torch.testing.assert_close(_step_losses(fsdp), _step_losses(ddp), rtol=1e-4, atol=1e-6)
    for r in range(2):
        torch.testing.assert_close(
            torch.tensor(fsdp[r]["norms"]), torch.tensor(ddp[r]["norms"]), rtol=1e-4, atol=1e-6
        )
    assert fsdp[0]["version"] == ddp[0]["version"] == 4
    assert fsdp[0]["state"].keys() == ddp[0]["state"].keys()
    for name, want in ddp[0]["state"].items():
        torch.testing.assert_close(fsdp[0]["state"][name], want, rtol=1e-4, atol=1e-5)
    # trained, not left as loaded
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    assert not torch.equal(fsdp[0]["state"]["model.norm.weight"], loaded["model.norm.weight"])
    # publishing gathers one bucket at a time
    sizes, largest = fsdp[0]["bucket_sizes"], fsdp[0]["largest"]
    assert len(sizes) > 3
    assert max(sizes) <= max(BUCKET_BYTES, largest)
    # the policy folder (one safetensors file per bucket) loads as a HF model
    assert len(list(policy.glob("model-*.safetensors"))) == len(sizes)
    reloaded = AutoModelForCausalLM.from_pretrained(policy).state_dict()
    for name, want in fsdp[0]["state"].items():
        assert torch.equal(reloaded[name], want), name


@pytest.mark.slow
def test_fsdp_checkpoint_survives_killed_ranks(tiny_dir: Path, tmp_path: Path) -> None:
    straight = _run(tiny_dir, tmp_path / "straight", {"mode": "fsdp", "steps": range(5)})
    ckpt = tmp_path / "ckpt"
    first = {"mode": "fsdp", "steps": range(5), "save_after": 2, "checkpoint": str(ckpt)}
    _run(tiny_dir, tmp_path / "first", first, killed=True)
    assert (ckpt / "trainer_state.pt").is_file() and (ckpt / "sharded" / ".metadata").is_file()
    assert len(list((ckpt / "sharded").glob("*.distcp"))) == 2  # one file per rank's shards
    resumed = _run(
        tiny_dir, tmp_path / "resumed", {"mode": "fsdp", "steps": range(2, 5), "load": str(ckpt)}
    )
    assert resumed[0]["version"] == 5
    torch.testing.assert_close(_step_losses(resumed), _step_losses(straight)[2:], rtol=0, atol=0)
    for name, want in straight[0]["state"].items():
        assert torch.equal(resumed[0]["state"][name], want), name
    # the checkpoint's policy folder holds the weights after step 2, loadable as they are
    policy = AutoModelForCausalLM.from_pretrained(ckpt / "policy").state_dict()
    assert set(policy) >= {"model.embed_tokens.weight", "model.norm.weight"}


def test_sharded_checkpoints_refuse_what_does_not_fit(tiny_dir: Path, tmp_path: Path) -> None:
    """A sharded checkpoint read by another number of ranks, or by an engine that is not
    sharded, fails naming the fix (one rank, in this process)."""
    import json

    from engines.distributed import init_group, leave_group
    from engines.hf import HFTrainingEngine

    init_group(0, 1, "127.0.0.1", free_port(), backend="gloo", timeout_s=30)
    try:
        engine = HFTrainingEngine(tiny_dir)
        engine.shard()
        with pytest.raises(RuntimeError, match="already sharded"):
            engine.shard()
        engine.save(tmp_path / "ckpt")
        meta = tmp_path / "ckpt" / "sharded" / "sharded.json"
        assert json.loads(meta.read_text())["world_size"] == 1
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "world_size": 2}))
        with pytest.raises(ValueError, match=r"resume with train\.dp_size=2"):
            engine.load(tmp_path / "ckpt")
        with pytest.raises(ValueError, match=r"train\.strategy"):
            HFTrainingEngine(tiny_dir).load(tmp_path / "ckpt")
    finally:
        leave_group()
