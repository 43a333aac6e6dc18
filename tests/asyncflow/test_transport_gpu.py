"""Weight transports on GPUs (needs CUDA; skipped without it): ``ipc`` with real CUDA IPC
handles, and ``broadcast`` over NCCL.

Receivers run in processes of their own (a CUDA IPC handle cannot be opened by the process
that exported it; NCCL needs one rank per GPU). Comparisons are bit-exact, on the host.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from asyncflow.transport import WeightTransport, make_transport, publish_stream
from tests.asyncflow.test_transport import awkward_state, check_same, raw, wait_until
from tests.asyncflow.test_transport_buckets import as_buckets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAST = {"heartbeat_s": 0.2, "dead_after_s": 5.0, "timeout_s": 60.0}


def cuda_state(seed: int) -> dict[str, torch.Tensor]:
    """The awkward state (tied, bf16, 0-d, empty, non-contiguous, bool) on the GPU."""
    state = awkward_state(seed)
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = id(t)
        if key not in moved:
            moved[key] = t.cuda()
        out[name] = moved[key]
    out["layer.0.t"] = state["layer.0.t"].t().contiguous().cuda().t()  # non-contiguous on GPU
    return out


def _receiver(transport: WeightTransport, member: str, device: int, conn: Connection) -> None:
    torch.cuda.set_device(device)
    receiver = transport.receiver(member)
    conn.send("ready")
    while True:
        command, *args = conn.recv()
        if command == "load":
            version = receiver.wait_newer(args[0], 60.0)
            state = receiver.get(version)
            devices = sorted({str(t.device) for t in state.values() if t.numel()})
            tied = state["embed.weight"].data_ptr() == state["lm_head.weight"].data_ptr()
            host = {k: v.cpu() for k, v in state.items()}
            conn.send((version, raw(host), devices, tied, getattr(receiver, "transfer_s", {})))
            receiver.release(version)
        else:
            receiver.close()
            conn.send("closed")
            return


class GPUHost:
    def __init__(self, transport: WeightTransport, member: str, device: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver, args=(transport, member, device, child))
        self.process.start()
        assert self.conn.poll(120) and self.conn.recv() == "ready"

    def load(self, after: int) -> tuple[int, dict[str, Any], list[str], bool, dict[int, float]]:
        self.conn.send(("load", after))
        assert self.conn.poll(120), "no answer from the receiver"
        return self.conn.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(("close",))
            self.conn.poll(60)
        self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def _host(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.cpu() for k, v in state.items()}


def test_ipc_publish_maps_the_trainers_tensors_in_another_process() -> None:
    """``publish``: the receiver's tensors are the trainer's CUDA memory, mapped (on the
    trainer's GPU, tied names one tensor), bit-exact; a newcomer gets the newest version."""
    transport = make_transport("ipc", **FAST)
    sender = transport.sender()
    hosts = [GPUHost(transport, "a")]
    try:
        wait_until(lambda: sender.members() == ["a"], why="the receiver to join")
        states = [cuda_state(seed) for seed in range(2)]
        sender.publish(states[0], 0)
        version, got, devices, tied, transfer = hosts[0].load(-1)
        assert version == 0 and devices == ["cuda:0"] and tied
        check_same(got, _host(states[0]))
        assert 0 in transfer
        sender.publish(states[1], 1)
        hosts.append(GPUHost(transport, "b"))  # joins after: exported at its join
        for host in hosts:
            version, got, _, _, _ = host.load(0)
            assert version == 1
            check_same(got, _host(states[1]))
        assert sender.last_sync is not None and sender.last_sync.version == 1
    finally:
        for host in hosts:
            host.close()
        sender.close()


def test_ipc_buckets_land_in_the_receivers_own_device_memory() -> None:
    """``publish_buckets`` (a sharded trainer): each bucket is copied device to device into
    the receiver's own image; the sender's buckets can go at once; a newcomer copies a
    holder's image."""
    transport = make_transport("ipc", **FAST)
    sender = transport.sender()
    hosts = [GPUHost(transport, "a")]
    try:
        wait_until(lambda: sender.members() == ["a"], why="the receiver to join")
        state = cuda_state(3)
        specs, buckets = as_buckets(state, bucket_bytes=64 << 10)
        publish_stream(sender, specs, iter(buckets), 0)
        del buckets
        version, got, devices, tied, _ = hosts[0].load(-1)
        assert version == 0 and devices == ["cuda:0"] and tied
        check_same(got, _host(state))
        hosts.append(GPUHost(transport, "b"))
        version, got, _, _, _ = hosts[1].load(-1)
        assert version == 0
        check_same(got, _host(state))
    finally:
        for host in hosts:
            host.close()
        sender.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: 2 GPUs")
def test_broadcast_over_nccl_between_two_gpus() -> None:
    """The broadcast transport with ``backend="nccl"`` (what ``deploy=ray`` picks when the
    trainer and generators are on CUDA): CUDA tensors reach a receiver on another GPU."""
    port = _free_port()
    transport = make_transport(
        "broadcast", address=f"tcp://127.0.0.1:{port}", backend="nccl", **FAST
    )
    sender = transport.sender()
    host = GPUHost(transport, "a", device=1)
    try:
        wait_until(lambda: sender.members() == ["a"], why="the receiver's NCCL link")
        state = cuda_state(5)
        sender.publish(state, 0)
        version, got, _, tied, _ = host.load(-1)
        assert version == 0 and tied
        check_same(got, _host(state))
    finally:
        host.close()
        sender.close()


def _free_port() -> int:
    from engines.distributed import free_port

    return free_port()
