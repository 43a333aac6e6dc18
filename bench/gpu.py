"""GPU paths against the hardware, on one GPU, in one run (at most about 4 minutes).

    python -m bench.gpu            # 512 MiB columns, a ~1 GB state, a ~150M-parameter model
    python -m bench.gpu --quick    # smaller (a smoke test)

Each case is timed after a warm-up and divided by a baseline measured in the same run, on the
same GPU (medians; GB/s of the case over GB/s of the baseline, or step time of the baseline
over step time of the case):

| case                                         | baseline                                   |
|----------------------------------------------|--------------------------------------------|
| device put: a bf16 CUDA column into an       | ``copy_`` into pinned host memory (D2H)    |
| embedded TransferQueue (and a local service) |                                            |
| get to device: ``get_data(meta, device=)``   | ``copy_`` from pinned host memory (H2D)    |
| IPC read: a column another process shares    | a device-to-device ``copy_``               |
| (``put(share=...)``), read onto the GPU      |                                            |
| ipc weights: ``publish`` + the generator's   | a device-to-device ``copy_`` of the state  |
| load into its warm buffers (another process) | into warm buffers                          |
| FSDP step (``HFTrainingEngine.shard``, one   | the same model's step unsharded (DDP's     |
| rank, NCCL; fp32 like the baseline)          | layout)                                    |

Targets (issue 40): each of the first four >= 0.5x. Writes ``bench/results/gpu.json`` and
``gpu.png``. Without a CUDA device it exits at once (status 2) saying so.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

NO_GPU = (
    "bench.gpu needs a CUDA device and this process sees none (torch.cuda.is_available() is "
    "False); run it on a GPU machine: python -m bench.gpu"
)


def _gpu_or_exit() -> None:
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        raise SystemExit(2)


def _median_s(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- columns ------------------------------------------------------------------------------------


def columns(nbytes: int, repeat: int) -> dict[str, Any]:
    """Device put and get-to-device through TransferQueue, against pinned copies."""
    import torch

    import transferqueue
    from bench.common import line

    rows = nbytes // (8192 * 2)
    col = torch.randn(rows, 8192, device="cuda").to(torch.bfloat16)  # [rows, 8192] bf16
    size = col.numel() * col.element_size()
    pinned = torch.empty(col.shape, dtype=col.dtype, pin_memory=True)
    d2h = size / _median_s(lambda: pinned.copy_(col, non_blocking=True), repeat) / 1e9
    back = torch.empty_like(col)
    h2d = size / _median_s(lambda: back.copy_(pinned, non_blocking=True), repeat) / 1e9
    line("pinned D2H (baseline)", d2h, "GB/s")
    line("pinned H2D (baseline)", h2d, "GB/s")
    out: dict[str, Any] = {"bytes": size, "pinned_d2h_GBps": d2h, "pinned_h2d_GBps": h2d}
    for mode in ("embedded", "service"):
        svc = transferqueue.serve(num_units=1) if mode == "service" else None
        tq = transferqueue.connect(svc.address) if svc else transferqueue.start(num_units=1)
        try:
            out[mode] = _through(tq, col, repeat, d2h, h2d, mode)
        finally:
            tq.close()
            if svc is not None:
                svc.close()
    return out


def _through(tq: Any, col: Any, repeat: int, d2h: float, h2d: float, mode: str) -> dict[str, Any]:
    """Device put and get to device of ``col`` through ``tq`` (one deployment)."""
    import torch

    from bench.common import line

    client = tq.client()
    size, rows = col.numel() * col.element_size(), int(col.shape[0])
    times = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        client.put({"x": col}, partition="p")
        if i:  # (the first put warms the pool and the unit)
            times.append(time.perf_counter() - t0)
        client.clear("p")
    put_gbps = size / statistics.median(times) / 1e9
    client.put({"x": col}, partition="g")
    meta = client.get_meta("t", ["x"], rows, partition="g", timeout_s=60)
    get_gbps = size / _median_s(lambda: client.get_data(meta, device="cuda:0"), repeat) / 1e9
    host_gbps = size / _median_s(lambda: client.get_data(meta)["x"].cuda(), repeat) / 1e9
    line(f"device put ({mode})", put_gbps, "GB/s", ratio=put_gbps / d2h)
    line(f"get to device ({mode})", get_gbps, "GB/s", ratio=get_gbps / h2d)
    line(f"get + .cuda() ({mode}, the old way)", host_gbps, "GB/s", ratio=host_gbps / h2d)
    return {
        "put_GBps": put_gbps,
        "put_ratio": put_gbps / d2h,
        "get_GBps": get_gbps,
        "get_ratio": get_gbps / h2d,
        "get_then_cuda_GBps": host_gbps,
        "pool_chunks": tq._staging.pool.made,
    }


def _share_producer(address: str, rows: int, conn: Connection) -> None:
    """Another process of the node: puts a CUDA column with ``share`` and waits."""
    import torch

    import transferqueue

    with transferqueue.connect(address) as tq:
        client = tq.client()
        col = torch.randn(rows, 8192, device="cuda").to(torch.bfloat16)
        client.put({"x": col}, share=["x"], partition="ipc")
        conn.send("put")
        conn.recv()


def ipc_read(nbytes: int, repeat: int) -> dict[str, Any]:
    """A column shared by a producer process, read onto the GPU, against a D2D copy."""
    import torch

    import transferqueue
    from bench.common import line

    rows = nbytes // (8192 * 2)
    src = torch.randn(rows, 8192, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    size = src.numel() * src.element_size()
    d2d = size / _median_s(lambda: dst.copy_(src), repeat) / 1e9
    line("D2D copy (baseline)", d2d, "GB/s")
    ctx = mp.get_context("spawn")
    with transferqueue.serve(num_units=1) as svc, transferqueue.connect(svc.address) as tq:
        mine, theirs = ctx.Pipe()
        producer = ctx.Process(target=_share_producer, args=(svc.address, rows, theirs))
        producer.start()
        try:
            assert mine.poll(180) and mine.recv() == "put"
            client = tq.client()
            meta = client.get_meta("t", ["x"], rows, partition="ipc", timeout_s=60)
            read = size / _median_s(lambda: client.get_data(meta, device="cuda:0"), repeat) / 1e9
            line("IPC read (shared column)", read, "GB/s", ratio=read / d2d)
        finally:
            mine.send("done")
            producer.join(60)
    return {"bytes": size, "d2d_GBps": d2d, "ipc_read_GBps": read, "ipc_read_ratio": read / d2d}


# -- weights ------------------------------------------------------------------------------------


def _state(nbytes: int) -> dict[str, Any]:
    import torch

    hidden = 2048
    layers = max(1, nbytes // (12 * hidden * hidden * 2))
    g = torch.Generator(device="cuda").manual_seed(0)
    embed = torch.randn(32000, hidden, device="cuda", generator=g).to(torch.bfloat16)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed}
    for i in range(layers):
        for name, shape in (
            ("q", (hidden, hidden)),
            ("k", (hidden, hidden)),
            ("v", (hidden, hidden)),
            ("o", (hidden, hidden)),
            ("up", (4 * hidden, hidden)),
            ("down", (hidden, 4 * hidden)),
        ):
            t = torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)
            state[f"model.layers.{i}.{name}.weight"] = t
    return state


def _weights_receiver(transport: Any, conn: Connection) -> None:
    import torch

    receiver = transport.receiver("generator")
    warm: dict[int, torch.Tensor] = {}
    conn.send("ready")
    while True:
        version = conn.recv()
        if version < 0:
            receiver.close()
            return
        newest = receiver.wait_newer(version - 1, 120.0)
        state = receiver.get(newest)
        unique = {t.data_ptr(): t for t in state.values()}  # tied names: one parameter
        for ptr, t in unique.items():  # an engine's load: into its own warm parameters
            if ptr not in warm:
                warm[ptr] = torch.empty_like(t)
            warm[ptr].copy_(t)
        torch.cuda.synchronize()
        receiver.release(newest)
        conn.send(newest)


def ipc_weights(nbytes: int, repeat: int) -> dict[str, Any]:
    """``ipc`` publish + a generator's load, against a D2D copy of the same state."""
    import torch

    from asyncflow.transport import make_transport
    from bench.common import line

    state = _state(nbytes)
    unique = {t.data_ptr(): t for t in state.values()}
    size = sum(t.numel() * t.element_size() for t in unique.values())
    warm = {k: torch.empty_like(t) for k, t in unique.items()}

    def copy() -> None:
        for k, t in unique.items():
            warm[k].copy_(t)

    d2d = size / _median_s(copy, repeat) / 1e9
    line("D2D copy of the state (baseline)", d2d, "GB/s", bytes=size)
    transport = make_transport("ipc")
    sender = transport.sender()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=_weights_receiver, args=(transport, theirs))
    proc.start()
    try:
        assert mine.poll(180) and mine.recv() == "ready"
        deadline = time.monotonic() + 60
        while sender.members() != ["generator"]:
            assert time.monotonic() < deadline, "the receiver did not join"
            time.sleep(0.05)
        times, publish, transfer = [], [], []
        for version in range(repeat + 2):
            snapshot = {k: t.clone() for k, t in state.items()}  # what state_dict() hands over
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sender.publish(snapshot, version)
            mine.send(version)
            assert mine.poll(120) and mine.recv() == version
            if version >= 2:
                times.append(time.perf_counter() - t0)
                assert sender.last_sync is not None
                publish.append(sender.last_sync.publish_s)
                transfer.append(sender.last_sync.transfer_s)
        gbps = size / statistics.median(times) / 1e9
        line("ipc publish + load", gbps, "GB/s", ratio=gbps / d2d)
    finally:
        mine.send(-1)
        proc.join(60)
        sender.close()
    return {
        "bytes": size,
        "d2d_GBps": d2d,
        "publish_load_GBps": gbps,
        "ratio": gbps / d2d,
        "publish_s": statistics.median(publish),
        "transfer_s": statistics.median(transfer),
    }


# -- training -----------------------------------------------------------------------------------


def fsdp_step(quick: bool, repeat: int) -> dict[str, Any]:
    """One rank: the same model's step unsharded (DDP's layout) and sharded (FSDP2)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.common import line
    from engines.distributed import free_port, init_group, leave_group
    from engines.fsdp import FSDPConfig
    from engines.hf import HFTrainingConfig, HFTrainingEngine
    from engines.protocols import TrainBatch

    layers, hidden = (2, 256) if quick else (8, 1024)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=True,
    )
    g = torch.Generator().manual_seed(0)
    samples = 16
    batch = TrainBatch(
        prompt_ids=[torch.randint(1, 32000, (64,), generator=g) for _ in range(samples)],
        response_ids=[torch.randint(1, 32000, (192,), generator=g) for _ in range(samples)],
        behaviour_logprobs=[-torch.rand(192, generator=g) for _ in range(samples)],
        advantages=torch.randn(samples, generator=g),
        versions=torch.zeros(samples, dtype=torch.int64),
    )
    init_group(0, 1, "127.0.0.1", free_port(), backend="nccl")
    try:
        out: dict[str, Any] = {"layers": layers, "hidden": hidden}
        for name in ("ddp", "fsdp"):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            out["params"] = sum(p.numel() for p in model.parameters())
            engine = HFTrainingEngine(model, config=HFTrainingConfig(lr=1e-5), device="cuda")
            if name == "fsdp":
                engine.shard(FSDPConfig())

            def step(engine: HFTrainingEngine = engine) -> None:
                engine.forward_backward(batch, 1.0 / samples)
                engine.optimizer_step()

            out[f"{name}_step_s"] = _median_s(step, repeat, warmup=1)
            del engine, model
            torch.cuda.empty_cache()
        out["ratio"] = out["ddp_step_s"] / out["fsdp_step_s"]
        line("DDP step (baseline)", out["ddp_step_s"] * 1e3, "ms", params=out["params"])
        line("FSDP step", out["fsdp_step_s"] * 1e3, "ms", ratio=out["ratio"])
        return out
    finally:
        leave_group()


# -- report -------------------------------------------------------------------------------------


def ratios(results: dict[str, Any]) -> dict[str, float]:
    return {
        "device put\n(embedded)": results["columns"]["embedded"]["put_ratio"],
        "device put\n(service)": results["columns"]["service"]["put_ratio"],
        "get to device\n(embedded)": results["columns"]["embedded"]["get_ratio"],
        "get to device\n(service)": results["columns"]["service"]["get_ratio"],
        "IPC read": results["ipc_read"]["ipc_read_ratio"],
        "ipc weights\npublish+load": results["ipc_weights"]["ratio"],
        "FSDP step\n(DDP = 1)": results["fsdp"]["ratio"],
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = ratios(results)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(values)), list(values.values()), color="tab:blue")
    ax.axhline(0.5, color="tab:red", ls="--", lw=1, label="target 0.5x")
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xticks(range(len(values)), list(values), fontsize=8)
    ax.set_ylabel("x its baseline (same run, same GPU)")
    ax.set_title(f"GPU paths on {results['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test)")
    args = ap.parse_args(argv)
    _gpu_or_exit()
    import torch

    from bench.common import RESULTS_DIR, write_json

    t0 = time.perf_counter()
    column_bytes = (64 if args.quick else 512) << 20
    state_bytes = (128 if args.quick else 1024) << 20
    repeat = 3 if args.quick else 5
    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "quick": args.quick}
    results["columns"] = columns(column_bytes, repeat)
    results["ipc_read"] = ipc_read(column_bytes, repeat)
    results["ipc_weights"] = ipc_weights(state_bytes, repeat)
    results["fsdp"] = fsdp_step(args.quick, repeat)
    results["ratios"] = {k.replace("\n", " "): v for k, v in ratios(results).items()}
    results["wall_s"] = time.perf_counter() - t0
    print(
        f"\n{results['gpu']}: " + ", ".join(f"{k} {v:.2f}x" for k, v in results["ratios"].items())
    )
    write_json("gpu", results)
    plot(results, str(RESULTS_DIR / "gpu.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
