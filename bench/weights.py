"""Weight transports: GB/s from the trainer to 1 and 2 generator hosts, in one run.

    python -m bench.weights              # 268 MB and 1.6 MB states, 1 and 2 receivers (~2 min)
    python -m bench.weights --quick      # smaller, for a smoke test
    python -m bench.weights --no-ray     # skip the Ray baseline

Every transport moves the same state dict (a transformer-like shape mix: a tied 32768 x 1024
embedding, attention and MLP matrices, norms; float32) from this process, the trainer, to
receivers in other processes (``inprocess``: threads of this one), measured after a warm-up:

- ``publish``: ``sender.publish(state, v)`` until it returns, i.e. until every receiver can
  ``get(v)`` (shm: the file is written and mapped; broadcast: every byte arrived and is
  committed).
- ``publish+load``: until every receiver has also copied ``get(v)`` into its own warm
  buffers, as an engine loading weights does.

Baselines in the same run: a plain copy of the same bytes in this process (``clone`` into
fresh memory and ``copy_`` into warm buffers), and Ray's object store (``ray.put`` of the
state dict, actors that take it as an argument and copy it into warm buffers: what an RL
framework on Ray does). Prints one line per case and the ratios; writes
``bench/results/weights.json`` and ``weights.png``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from asyncflow.transport import WeightReceiver, WeightTransport, make_transport
from bench.common import RESULTS_DIR, line, write_json

State = dict[str, torch.Tensor]


def model_state(hidden: int, intermediate: int, vocab: int, layers: int) -> State:
    """A float32 decoder's state dict (tied embedding and head)."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(vocab, hidden, generator=g)
    state: State = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g)
        state[p + "mlp.gate_proj.weight"] = torch.randn(intermediate, hidden, generator=g)
        state[p + "mlp.up_proj.weight"] = torch.randn(intermediate, hidden, generator=g)
        state[p + "mlp.down_proj.weight"] = torch.randn(hidden, intermediate, generator=g)
        state[p + "input_layernorm.weight"] = torch.ones(hidden)
        state[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    state["model.norm.weight"] = torch.ones(hidden)
    state["lm_head.weight"] = embed
    return state


def nbytes(state: State) -> int:
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in state.values()}
    return sum(seen.values())


# -- receivers ----------------------------------------------------------------------------------


class Loader:
    """A generator host's weight follower: waits for a version and copies it into warm buffers."""

    def __init__(self, receiver: WeightReceiver) -> None:
        self.receiver = receiver
        self.buffers: State = {}

    def load(self, version: int, timeout_s: float = 120.0) -> None:
        newest = self.receiver.wait_newer(version - 1, timeout_s)
        if newest < version:
            raise TimeoutError(f"version {version} did not arrive within {timeout_s} s")
        state = self.receiver.get(newest)
        try:
            for name, tensor in state.items():
                if name not in self.buffers:
                    self.buffers[name] = torch.empty_like(tensor)
                self.buffers[name].copy_(tensor)
        finally:
            self.receiver.release(newest)


def host_main(conn: Connection) -> None:
    """A receiver process: joins the transports it is sent and loads the versions asked for."""
    torch.set_num_threads(1)
    loader: Loader | None = None
    while True:
        command, *args = conn.recv()
        if command == "join":
            loader = Loader(args[0].receiver(args[1]))
        elif command == "load":
            assert loader is not None
            loader.load(args[0])
        elif command == "leave":
            assert loader is not None
            loader.receiver.close()
            loader = None
        elif command == "exit":
            conn.send("bye")
            return
        conn.send("ok")  # also the answer to "ping"


class Host:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=host_main, args=(child,), daemon=True)
        self.process.start()

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def done(self, timeout_s: float = 180.0) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"a receiver process did not answer within {timeout_s} s")
        assert self.conn.recv() in ("ok", "bye")


class ThreadHost:
    """``inprocess`` receivers: a thread of this process with the same commands."""

    def __init__(self) -> None:
        self.loader: Loader | None = None
        self.worker: threading.Thread | None = None
        self.error: BaseException | None = None

    def send(self, *command: Any) -> None:
        def run() -> None:
            try:
                if command[0] == "join":
                    self.loader = Loader(command[1].receiver(command[2]))
                elif command[0] == "load":
                    assert self.loader is not None
                    self.loader.load(command[1])
                elif command[0] == "leave":
                    assert self.loader is not None
                    self.loader.receiver.close()
            except BaseException as e:
                self.error = e

        self.worker = threading.Thread(target=run)
        self.worker.start()

    def done(self, timeout_s: float = 180.0) -> None:
        assert self.worker is not None
        self.worker.join(timeout_s)
        if self.error is not None:
            raise self.error


# -- measurements -------------------------------------------------------------------------------


def measure_transport(
    transport: WeightTransport, hosts: list[Any], state: State, repeat: int
) -> dict[str, float]:
    """Median seconds of publish, and of publish + every receiver loading the version."""
    sender = transport.sender()
    try:
        for i, host in enumerate(hosts):
            host.send("join", transport, f"host{i}")
        for host in hosts:
            host.done()
        deadline = time.monotonic() + 120
        while len(sender.members()) < len(hosts):
            if time.monotonic() > deadline:
                raise TimeoutError("receivers did not join within 120 s")
            time.sleep(0.01)
        publish, total = [], []
        for version in range(repeat + 1):  # version 0 warms up (allocations, page faults)
            t0 = time.perf_counter()
            sender.publish(state, version)
            t1 = time.perf_counter()
            for host in hosts:
                host.send("load", version)
            for host in hosts:
                host.done()
            t2 = time.perf_counter()
            if version:
                publish.append(t1 - t0)
                total.append(t2 - t0)
        for host in hosts:
            host.send("leave")
        for host in hosts:
            host.done()
    finally:
        sender.close()
    return {"publish_s": statistics.median(publish), "publish_load_s": statistics.median(total)}


def measure_copy(state: State, repeat: int) -> dict[str, float]:
    """Median seconds to clone every tensor (fresh memory) and to copy_ into warm buffers."""
    tensors = list({t.data_ptr(): t for t in state.values()}.values())
    warm = [torch.empty_like(t) for t in tensors]
    fresh, copy = [], []
    for i in range(repeat + 1):
        t0 = time.perf_counter()
        clones = [t.clone() for t in tensors]
        t1 = time.perf_counter()
        for dst, src in zip(warm, tensors, strict=True):
            dst.copy_(src)
        t2 = time.perf_counter()
        del clones
        if i:
            fresh.append(t1 - t0)
            copy.append(t2 - t1)
    return {"clone_s": statistics.median(fresh), "copy_s": statistics.median(copy)}


class RayHost:
    """A generator host on Ray: takes the state dict (by reference) and copies it into warm
    buffers."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.buffers: State = {}

    def load(self, state: State) -> int:
        for name, tensor in state.items():
            if name not in self.buffers or self.buffers[name].shape != tensor.shape:
                self.buffers[name] = torch.empty_like(tensor)
            self.buffers[name].copy_(tensor)
        return len(state)


def measure_ray(
    states: dict[str, State], receivers: list[int], repeats: dict[str, int]
) -> dict[str, Any]:
    try:
        import ray
    except ImportError:
        return {}
    for k, v in {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }.items():
        os.environ.setdefault(k, v)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict[str, Any] = {}
    try:
        actors = [ray.remote(num_cpus=0)(RayHost).remote() for _ in range(max(receivers))]
        for name, state in states.items():
            for n in receivers:
                times = []
                for i in range(repeats[name] + 1):
                    t0 = time.perf_counter()
                    ref = ray.put(state)
                    ray.get([a.load.remote(ref) for a in actors[:n]], timeout=600)
                    if i:
                        times.append(time.perf_counter() - t0)
                    del ref
                out[f"{name}/{n}"] = {"publish_load_s": statistics.median(times)}
    finally:
        ray.shutdown()
    return out


# -- report -------------------------------------------------------------------------------------


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    big = results["states"][0]
    gbps = results["GBps"]
    systems = [s for s in gbps if f"{big}/1" in gbps[s]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / 2
    for k, n in enumerate((1, 2)):
        vals = [gbps[s].get(f"{big}/{n}", {}).get("publish_load", 0.0) for s in systems]
        ax.bar(np.arange(len(systems)) + k * width, vals, width, label=f"{n} receiver(s)")
    copy = results["copy_GBps"][big]
    ax.axhline(copy["clone"], color="grey", ls="--", lw=1, label=f"clone {copy['clone']:.2f} GB/s")
    ax.axhline(copy["copy"], color="grey", ls=":", lw=1, label=f"copy_ {copy['copy']:.2f} GB/s")
    ax.set_xticks(np.arange(len(systems)) + width / 2, systems)
    ax.set_ylabel("publish + load GB/s (higher is better)")
    ax.set_title(f"Weight transports, {results['bytes'][big] / 1e6:.0f} MB float32 state, one host")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        states = {
            "medium": model_state(512, 2048, 8192, 2),
            "small": model_state(128, 512, 2048, 2),
        }
    else:
        states = {
            "large": model_state(1024, 4096, 32768, 2),
            "small": model_state(128, 512, 2048, 2),
        }
    sizes = {name: nbytes(s) for name, s in states.items()}
    receivers = [1, 2]
    repeats = {name: args.repeat if sizes[name] > 64 << 20 else 10 for name in states}
    transports: dict[str, Callable[[], WeightTransport]] = {
        "inprocess": lambda: make_transport("inprocess"),
        "shm": lambda: make_transport("shm"),
        "broadcast": lambda: make_transport("broadcast"),
    }
    hosts = [Host() for _ in range(max(receivers))]
    results: dict[str, Any] = {"states": list(states), "bytes": sizes, "seconds": {}}
    try:
        for host in hosts:  # started (torch imported) before anything is timed
            host.send("ping")
        for host in hosts:
            host.done()
        copies = {name: measure_copy(state, repeats[name]) for name, state in states.items()}
        for name, c in copies.items():
            for kind in ("clone", "copy"):
                line(
                    f"baseline {kind} {name} ({sizes[name] / 1e6:.1f} MB)",
                    sizes[name] / c[f"{kind}_s"] / 1e9,
                    "GB/s",
                )
        for system, make in transports.items():
            results["seconds"][system] = {}
            for name, state in states.items():
                for n in receivers:
                    group: list[Any] = (
                        [ThreadHost() for _ in range(n)] if system == "inprocess" else hosts[:n]
                    )
                    t = measure_transport(make(), group, state, repeats[name])
                    results["seconds"][system][f"{name}/{n}"] = t
                    for kind, s in t.items():
                        label = kind.removesuffix("_s").replace("_", "+")
                        line(f"{system} {label} {name} -> {n}", sizes[name] / s / 1e9, "GB/s")
    finally:
        for host in hosts:
            host.send("exit")
        for host in hosts:
            host.done(30)
    if not args.no_ray:
        results["seconds"]["ray object store"] = measure_ray(states, receivers, repeats)
        for key, t in results["seconds"]["ray object store"].items():
            name, n = key.split("/")
            line(f"ray publish+load {name} -> {n}", sizes[name] / t["publish_load_s"] / 1e9, "GB/s")
    gbps = {
        system: {
            key: {k.removesuffix("_s"): sizes[key.split("/")[0]] / s / 1e9 for k, s in t.items()}
            for key, t in per.items()
        }
        for system, per in results["seconds"].items()
    }
    copy_gbps = {
        name: {kind: sizes[name] / c[f"{kind}_s"] / 1e9 for kind in ("clone", "copy")}
        for name, c in copies.items()
    }
    ratios: dict[str, float] = {}
    for system in ("shm", "broadcast"):
        for name in states:
            for n in receivers:
                key = f"{name}/{n}"
                mine = gbps[system][key]["publish_load"]
                ratios[f"{system} {key} vs clone"] = mine / copy_gbps[name]["clone"]
                if gbps.get("ray object store", {}).get(key):
                    ratios[f"{system} {key} vs ray"] = (
                        mine / gbps["ray object store"][key]["publish_load"]
                    )
    for k, v in ratios.items():
        line(f"ratio {k}", v, "x")
    results.update(GBps=gbps, copy_GBps=copy_gbps, ratios=ratios, repeats=repeats)
    write_json("weights", results)
    plot(results, str(RESULTS_DIR / "weights.png"))


if __name__ == "__main__":
    main()
