"""Data-parallel training over ``torch.distributed``: one process per rank, gradients summed.

Every rank holds the whole model (DDP's layout, not FSDP's). Each rank runs
``forward_backward`` on its share of a step's samples with the same ``loss_scale`` (1 / the
step's samples over *all* ranks), so the sum of the ranks' gradients is the step's mean
gradient; :func:`all_reduce_gradients` forms that sum on every rank just before the optimizer
step, after which every rank clips and steps identically and the replicas stay equal.

Gradients travel in flat buckets of at most ``bucket_bytes`` (one collective per bucket,
bounded extra memory), in parameter order, which every rank shares. A parameter with no
gradient on a rank (no sample of its share touched it) counts as zeros there.

| backend | tensors on | set up by                                              |
|---------|------------|--------------------------------------------------------|
| gloo    | CPU        | :func:`init_group` (``torch.distributed`` default group) |
| nccl    | CUDA       | the same, chosen from the model's device              |
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "BUCKET_BYTES",
    "all_reduce_gradients",
    "backend_for",
    "broadcast_parameters",
    "free_port",
    "init_group",
    "leave_group",
    "max_over_ranks",
]

BUCKET_BYTES = 64 << 20


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the rank-0 rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_group(
    rank: int, world: int, address: str, port: int, *, backend: str, timeout_s: float = 120.0
) -> None:
    """Join the data-parallel group (this process's default ``torch.distributed`` group).

    ``timeout_s`` bounds every collective: a rank that died makes the others fail with an
    error after at most that long, never hang.
    """
    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def leave_group() -> None:
    """Leave the data-parallel group: wait for every rank (bounded by the group's timeout),
    then tear the group down. A rank process that exits with its gloo group still up can be
    aborted by the C++ runtime (``terminate called without an active exception``) while
    another rank still talks to it; call this on every rank before the process ends."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _buckets(
    params: list[torch.nn.Parameter], bucket_bytes: int
) -> Iterator[list[torch.nn.Parameter]]:
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_gradients(
    module: torch.nn.Module, *, bucket_bytes: int = BUCKET_BYTES, atomic: bool = False
) -> int:
    """Sum every trainable parameter's gradient over the group, in place; returns the
    collectives issued. Call on every rank, between the last ``backward`` and the step.

    ``atomic``: the sums are written back only once every bucket is reduced, so a collective
    that fails (a rank died) leaves this rank's own gradients untouched and the step can be
    redone (one more copy of the gradients, held until the end)."""
    world = dist.get_world_size()
    params = [p for p in module.parameters() if p.requires_grad]
    calls = 0
    if world == 1:
        return calls
    reduced: list[tuple[list[torch.nn.Parameter], torch.Tensor]] = []
    for bucket in _buckets(params, bucket_bytes):
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        )
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        calls += 1
        if atomic:
            reduced.append((bucket, flat))
        else:
            _write_back(bucket, flat)
    for bucket, flat in reduced:
        _write_back(bucket, flat)
    return calls


def _write_back(bucket: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """The summed gradients of ``bucket`` (``flat``, in parameter order) into their ``grad``."""
    offset = 0
    for p in bucket:
        n = p.numel()
        summed = flat[offset : offset + n].view_as(p)
        if p.grad is None:
            p.grad = summed.clone()
        else:
            p.grad.copy_(summed)
        offset += n


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest ``value`` any rank passed (collective; ``device``: where the group's
    backend takes tensors, CUDA for NCCL)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_parameters(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers rank ``src``'s (replicas start equal even if
    their initialization differed)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src)
