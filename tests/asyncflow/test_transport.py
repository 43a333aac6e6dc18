"""Weight transports: one set of behaviour checks applied to every implementation.

In-process tests run sender and receivers in the test process (receivers of ``shm`` and
``broadcast`` still talk over their real sockets and process groups). ``service`` tests put
receivers in real processes (multiprocessing spawn) driven over a pipe; ``ray`` tests put
one in a Ray actor. Comparisons are bit-exact: dtype, shape and raw bytes.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.transport import (
    ReceiverFailedError,
    StateError,
    TransportClosedError,
    VersionError,
    WeightReceiver,
    WeightSender,
    WeightTransport,
    make_transport,
    register_transport,
    transport_names,
)
from asyncflow.transport import links as links_module
from asyncflow.transport.links import DIRECT_MIN_BYTES, plan_ranges
from asyncflow.transport.shm import sweep_orphans
from engines.weights_io import plan_state, unpack_buffer

NAMES = ["inprocess", "shm", "broadcast", "ipc"]
# Fast failure detection for tests; small buckets so that every range kind and split occurs.
FAST: dict[str, dict[str, Any]] = {
    "inprocess": {},
    "shm": {"heartbeat_s": 0.2, "dead_after_s": 3.0, "timeout_s": 30.0},
    "broadcast": {
        "heartbeat_s": 0.2,
        "dead_after_s": 3.0,
        "timeout_s": 30.0,
        "bucket_bytes": 1 << 20,
    },
    # host tensors through shared files: the ipc protocol without a GPU (tests/asyncflow/
    # test_transport_gpu.py runs it with CUDA IPC handles)
    "ipc": {"sharer": "file", "heartbeat_s": 0.2, "dead_after_s": 3.0, "timeout_s": 30.0},
}
Raw = dict[str, tuple[str, tuple[int, ...], bytes]]


def awkward_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every case a state dict can hold: float32, bf16, int64 buffers, tied weights, 0-d,
    empty, non-contiguous, bool, and a tensor large enough to go out directly (>= 1 MiB)."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(50, 16, generator=g)
    return {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: one tensor under two names
        "layer.0.w": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(7, generator=g),
        "layer.0.t": torch.randn(12, 9, generator=g).t(),  # non-contiguous
        "big": torch.randn(300, 1000, generator=g),  # 1.2 MB: a direct range
        "position_ids": torch.arange(17, dtype=torch.int64) + seed,
        "scale": torch.tensor(1.5 + seed),  # 0-d
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
    }


def raw(state: Mapping[str, torch.Tensor]) -> Raw:
    """dtype, shape and bytes of every tensor (picklable, compared bit-exactly)."""
    out: Raw = {}
    for name, t in state.items():
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = (str(t.dtype), tuple(t.shape), data)
    return out


def check_same(got: Mapping[str, torch.Tensor] | Raw, want: Mapping[str, torch.Tensor]) -> None:
    have = got if all(isinstance(v, tuple) for v in got.values()) else raw(got)  # type: ignore[arg-type]
    assert list(have) == list(want)
    for name, (dtype, shape, data) in raw(want).items():
        assert have[name] == (dtype, shape, data), name  # type: ignore[comparison-overlap]


def tied(state: Mapping[str, torch.Tensor]) -> bool:
    return bool(state["embed.weight"].data_ptr() == state["lm_head.weight"].data_ptr())


def wait_until(what: Callable[[], bool], timeout_s: float = 60.0, why: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {why}")
        time.sleep(0.02)


def shm_files() -> set[str]:
    """Version files (shm) and shared tensors (ipc over files) this process left behind."""
    shm = Path("/dev/shm")
    patterns = (f"asyncflow-weights-{os.getpid()}-*.bin", f"asyncflow-share-{os.getpid()}-*.bin")
    return {p.name for pattern in patterns for p in shm.glob(pattern)}


@pytest.fixture(params=NAMES)
def transport(request: pytest.FixtureRequest) -> WeightTransport:
    return make_transport(request.param, **FAST[request.param])


# -- in-process: every transport, receivers in this process ---------------------------------


def test_round_trip_versions_and_late_receiver(transport: WeightTransport) -> None:
    sender = transport.sender()
    early = transport.receiver("early")
    try:
        assert isinstance(sender, WeightSender) and isinstance(early, WeightReceiver)
        assert early.newest() == -1
        wait_until(lambda: "early" in sender.members(), why="the receiver to join")
        states = [awkward_state(seed) for seed in range(3)]
        sender.publish(states[0], 0)
        assert early.wait_newer(-1, timeout_s=30) == 0
        got = early.get(0)
        check_same(got, states[0])
        if transport.name != "inprocess":
            assert tied(got)  # one copy, viewed under both names
        sender.publish(states[1], 1)
        sender.publish(states[2], 2)
        assert early.wait_newer(1, timeout_s=30) == 2  # newest wins
        check_same(early.get(0), states[0])  # pinned by the get above: still there
        early.release(0)
        early.release(0)
        with pytest.raises(VersionError, match="version 0 is not available"):
            early.get(0)
        with pytest.raises(VersionError, match="version 1 is not available"):
            early.get(1)  # superseded before anyone pinned it
        check_same(early.get(2), states[2])
        early.release(2)
        late = transport.receiver("late")  # a restarted host: no republish
        try:
            assert late.wait_newer(-1, timeout_s=30) == 2
            check_same(late.get(2), states[2])
            late.release(2)
        finally:
            late.close()
    finally:
        early.close()
        sender.close()
        sender.close()  # idempotent
    with pytest.raises(TransportClosedError):
        sender.publish(states[0], 3)
    with pytest.raises(TransportClosedError):
        early.newest()
    assert not shm_files()


def test_bad_input_is_a_typed_error(transport: WeightTransport) -> None:
    sender = transport.sender()
    try:
        with pytest.raises(StateError, match=r"state\['w'\] must be a torch.Tensor, got list"):
            sender.publish({"w": [1.0, 2.0]}, 0)  # type: ignore[dict-item]
        with pytest.raises(TypeError):  # StateError is also a TypeError and a ValueError
            sender.publish({"w": 1.0}, 0)  # type: ignore[dict-item]
        with pytest.raises(StateError, match=r"state\['w'\] is on the meta device"):
            sender.publish({"w": torch.empty(3, device="meta")}, 0)
        with pytest.raises(StateError, match=r"layout torch\.sparse_coo"):
            sender.publish({"w": torch.eye(3).to_sparse()}, 0)
        with pytest.raises(StateError, match="keys must be str"):
            sender.publish({1: torch.ones(1)}, 0)  # type: ignore[dict-item]
        with pytest.raises(VersionError, match="must be >= 0, got -1"):
            sender.publish({"w": torch.ones(1)}, -1)
        with pytest.raises(VersionError, match="must be an int, got bool"):
            sender.publish({"w": torch.ones(1)}, True)
        sender.publish({"w": torch.ones(1)}, 5)
        for stale in (5, 4):
            with pytest.raises(
                VersionError, match=f"newer than the last published version 5, got {stale}"
            ):
                sender.publish({"w": torch.ones(1)}, stale)
        sender.publish({}, 6)  # an empty state is a valid version
    finally:
        sender.close()


@pytest.mark.parametrize("keep_newest", [False, True])
def test_broadcast_newcomer_with_no_holder(keep_newest: bool) -> None:
    """The only receiver restarts: with ``keep_newest`` the sender serves it the newest version
    from its own copy; without, it gets the next published version."""
    transport = make_transport("broadcast", **FAST["broadcast"], keep_newest=keep_newest)
    sender = transport.sender()
    try:
        states = [awkward_state(seed) for seed in range(2)]
        sender.publish(states[0], 0)  # nobody listens yet
        receiver = transport.receiver("restarted")
        try:
            wait_until(lambda: sender.members() == ["restarted"], why="the receiver to link")
            if keep_newest:
                assert receiver.wait_newer(-1, 30) == 0
                check_same(receiver.get(0), states[0])
                receiver.release(0)
            else:
                assert receiver.wait_newer(-1, 1.0) == -1
            sender.publish(states[1], 1)
            assert receiver.newest() == 1  # publish returned: it has it
            check_same(receiver.get(1), states[1])
        finally:
            receiver.close()
    finally:
        sender.close()


def test_broadcast_publish_right_after_the_link_waits_for_the_receivers_side(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sender counts a link from when its side is up; the receiver's side comes up in a
    thread of its own, a moment later on a busy machine. A publish sent in between reached a
    receiver with "no link here" (seen in CI: the Ray actor test's publish waited out
    timeout_s). The receiver waits for its side of the link."""
    pair_group, late = links_module.pair_group, []

    def receiver_side_late(store: Any, prefix: str, rank: int, **kw: Any) -> Any:
        group = pair_group(store, prefix, rank, **kw)
        if rank == 1 and prefix.startswith("link/"):  # the receiver's side of its link
            late.append(prefix)
            time.sleep(1.5)
        return group

    monkeypatch.setattr(links_module, "pair_group", receiver_side_late)
    transport = make_transport("broadcast", **FAST["broadcast"])
    sender = transport.sender()
    receiver = transport.receiver("r")
    try:
        wait_until(lambda: sender.members() == ["r"], why="the sender's side of the link")
        state = awkward_state(1)
        sender.publish(state, 0)  # raised ReceiverFailedError (range 0 not sent) before
        assert late == ["link/1"]
        assert receiver.newest() == 0  # publish returned: it has it
        check_same(receiver.get(0), state)
        receiver.release(0)
    finally:
        receiver.close()
        sender.close()


def test_broadcast_publish_a_receiver_failed_ends_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A receiver that fails the publish on its side posts no receive: the sender names it
    with the receiver's reason at once instead of waiting out timeout_s on its sends."""
    host_image = links_module.host_image

    def no_room_in_receivers(nbytes: int) -> torch.Tensor:
        if threading.current_thread().name.startswith("broadcast-"):  # (the receiver's worker)
            raise MemoryError("no room for the image (test)")
        return host_image(nbytes)

    monkeypatch.setattr(links_module, "host_image", no_room_in_receivers)
    transport = make_transport("broadcast", **{**FAST["broadcast"], "timeout_s": 600.0})
    sender = transport.sender()
    receiver = transport.receiver("r")
    try:
        wait_until(lambda: sender.members() == ["r"], why="the receiver to link")
        with pytest.raises(ReceiverFailedError, match="no room for the image") as err:
            sender.publish(awkward_state(), 0)  # (waited 600 s before)
        assert list(err.value.failures) == ["r"]
        assert receiver.newest() == -1
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("name", ["shm", "broadcast", "ipc"])
def test_ends_dropped_without_close_stop_their_threads(name: str) -> None:
    before = set(threading.enumerate())

    def use_and_forget() -> None:
        transport = make_transport(name, **FAST[name])
        sender = transport.sender()
        receiver = transport.receiver("r")
        wait_until(lambda: sender.members() == ["r"], why="the receiver to join")
        sender.publish(awkward_state(), 0)
        assert receiver.wait_newer(-1, 30) == 0

    use_and_forget()
    gc.collect()
    # threads end within their bounds (a control loop wakes every heartbeat_s)
    wait_until(lambda: not (set(threading.enumerate()) - before), 30, "the threads to end")
    assert not shm_files()


def test_registry_and_configs_pickle() -> None:
    assert set(NAMES) <= set(transport_names())
    with pytest.raises(
        ValueError, match="unknown weight transport 'nope'; known: broadcast, inprocess, ipc, shm"
    ):
        make_transport("nope")
    with pytest.raises(
        ValueError, match="has no option 'bucket'; options: address, backend, bucket_bytes"
    ):
        make_transport("broadcast", bucket="1")
    with pytest.raises(ValueError, match="already registered"):
        register_transport("shm")(type("Other", (), {}))
    with pytest.raises(ValueError, match="backend must be one of"):
        make_transport("broadcast", backend="mpi")
    with pytest.raises(ValueError, match="keep_newest keeps the sender's copy in host memory"):
        make_transport("broadcast", backend="nccl", keep_newest=True)
    with pytest.raises(ValueError, match="address must be tcp://HOST:PORT"):
        make_transport("broadcast", address="ipc:///tmp/x")
    with pytest.raises(ValueError, match="dead_after_s must exceed two heartbeats"):
        make_transport("shm", heartbeat_s=1.0, dead_after_s=1.5)
    for name in NAMES:
        config = make_transport(name)
        assert pickle.loads(pickle.dumps(config)) == config
        assert len(pickle.dumps(config)) < 1000  # small: it travels to every actor
    foreign = dataclasses.replace(make_transport("inprocess"), pid=os.getpid() + 1)
    with pytest.raises(TransportClosedError, match="only in the process that made it"):
        foreign.receiver("x")


@pytest.mark.parametrize("chunk_bytes", [64, 192, 4096, 1 << 20])
def test_ranges_cover_the_image_exactly(chunk_bytes: int) -> None:
    """What the broadcast sender streams, put back together as a receiver does, unpacks
    bit-exactly; ranges are 64-aligned, at most one chunk, and never overlap."""
    state = awkward_state(1)
    state["huge"] = torch.randn(DIRECT_MIN_BYTES // 2 + 123, dtype=torch.float64)  # >1 MiB
    plan = plan_state(state)
    ranges = plan_ranges(plan, chunk_bytes=chunk_bytes, device="cpu")
    image = torch.zeros(plan.nbytes, dtype=torch.uint8)
    bucket = torch.empty(chunk_bytes, dtype=torch.uint8)
    end = 0
    for r in ranges:
        assert r.start % 64 == 0 and r.start >= end and 0 < r.nbytes <= chunk_bytes
        image[r.start : r.end] = r.pack(bucket)
        end = r.end
    assert any(r.direct is not None for r in ranges) and any(r.parts for r in ranges)
    check_same(dict(unpack_buffer(image, plan.layout)), state)
    with pytest.raises(ValueError, match="multiple of 64"):
        plan_ranges(plan, chunk_bytes=100, device="cpu")


# -- real processes ---------------------------------------------------------------------------


def receiver_main(transport: WeightTransport, member: str, conn: Connection) -> None:
    """A generator host's stand-in: serves the test's commands over ``conn``."""
    receiver = transport.receiver(member)
    conn.send(("ready", os.getpid()))
    while True:
        command, *args = conn.recv()
        if command == "wait_newer":
            conn.send(receiver.wait_newer(args[0], args[1]))
        elif command == "get":
            state = receiver.get(args[0])
            conn.send((raw(state), tied(state)))
            receiver.release(args[0])
        elif command == "close":
            receiver.close()
            conn.send("closed")
            return


class Host:
    """A receiver in its own process (spawned), driven over a pipe."""

    def __init__(self, transport: WeightTransport, member: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=receiver_main, args=(transport, member, child), daemon=True
        )
        self.process.start()
        self.member = member
        ready, self.pid = self.ask(timeout_s=120)
        assert ready == "ready"

    def ask(self, *command: Any, timeout_s: float = 60.0) -> Any:
        if command:
            self.conn.send(command)
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"{self.member}: no answer to {command} within {timeout_s} s")
        return self.conn.recv()

    def newest_after(self, version: int) -> int:
        return int(self.ask("wait_newer", version, 30.0))

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.process.join(30)  # reaped, as a supervisor (Ray) would

    def close(self) -> None:
        if self.process.is_alive():
            assert self.ask("close") == "closed"
        self.process.join(30)
        if self.process.is_alive():
            self.kill()


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for host in started:
        if host.process.is_alive():
            os.kill(host.pid, signal.SIGCONT)
            host.kill()


@pytest.mark.slow
@pytest.mark.service
@pytest.mark.parametrize("name", ["shm", "broadcast", "ipc"])
def test_processes_round_trip_kill_and_join(name: str, hosts: list[Host]) -> None:
    """Bit-exact across processes; a receiver SIGKILLed while the sender is delivering to it
    does not hang the sender; the next publish reaches the survivor and a newcomer."""
    transport = make_transport(name, **FAST[name])
    sender = transport.sender()
    try:
        a, b = Host(transport, "a"), Host(transport, "b")
        hosts += [a, b]
        wait_until(lambda: set(sender.members()) == {"a", "b"}, why="a and b to join")
        states = [awkward_state(seed) for seed in range(3)]
        sender.publish(states[0], 0)
        for host in (a, b):
            assert host.newest_after(-1) == 0
            got, is_tied = host.ask("get", 0)
            check_same(got, states[0])
            assert is_tied
        # b stops (it receives nothing more), the publish blocks on it, then b is killed.
        os.kill(b.pid, signal.SIGSTOP)
        big = {**states[1], "blob": torch.randn(4 << 20)}  # 16 MB: many ranges to b
        failure: list[BaseException] = []
        started = time.monotonic()

        def publish() -> None:
            try:
                sender.publish(big, 1)
            except BaseException as e:
                failure.append(e)

        publishing = threading.Thread(target=publish)
        publishing.start()
        time.sleep(0.5)
        b.kill()
        publishing.join(timeout=transport.timeout_s + 30)  # type: ignore[attr-defined]
        assert not publishing.is_alive(), "publish hung on a dead receiver"
        assert time.monotonic() - started < transport.timeout_s  # type: ignore[attr-defined]
        assert len(failure) == 1 and isinstance(failure[0], ReceiverFailedError), failure
        assert set(failure[0].failures) == {"b"} and failure[0].version == 1
        assert a.newest_after(0) == 1
        check_same(a.ask("get", 1)[0], big)
        # a newcomer gets the newest version by itself, then the next publish reaches both
        c = Host(transport, "c")
        hosts.append(c)
        assert c.newest_after(-1) == 1
        check_same(c.ask("get", 1)[0], big)
        wait_until(lambda: set(sender.members()) == {"a", "c"}, why="b to be dropped")
        sender.publish(states[2], 2)
        for host in (a, c):
            assert host.newest_after(1) == 2
            check_same(host.ask("get", 2)[0], states[2])
            host.close()
    finally:
        sender.close()
    assert not shm_files(), "version files left in /dev/shm"


@pytest.mark.slow
@pytest.mark.service
def test_broadcast_hung_receiver_is_bounded_and_rejoins(hosts: list[Host]) -> None:
    """A receiver that stops answering (SIGSTOP) costs one publish at most ``timeout_s``;
    once it runs again it joins again by itself and gets the newest version."""
    options = {**FAST["broadcast"], "dead_after_s": 2.0, "timeout_s": 8.0}
    transport = make_transport("broadcast", **options)
    sender = transport.sender()
    try:
        a, b = Host(transport, "a"), Host(transport, "b")
        hosts += [a, b]
        wait_until(lambda: set(sender.members()) == {"a", "b"}, why="a and b to link")
        os.kill(b.pid, signal.SIGSTOP)
        state = {**awkward_state(0), "blob": torch.randn(4 << 20)}  # more than socket buffers
        with pytest.raises(ReceiverFailedError) as failed:
            sender.publish(state, 0)
        assert set(failed.value.failures) == {"b"}
        assert a.newest_after(-1) == 0
        os.kill(b.pid, signal.SIGCONT)
        assert b.newest_after(-1) == 0  # rejoined, served by a
        check_same(b.ask("get", 0)[0], state)
        wait_until(lambda: set(sender.members()) == {"a", "b"}, why="b to link again")
        sender.publish(awkward_state(1), 1)
        assert a.newest_after(0) == 1 and b.newest_after(0) == 1
        a.close()
        b.close()
    finally:
        sender.close()


SENDER_SCRIPT = """
import sys, time, torch
from asyncflow.transport import make_transport
sender = make_transport("shm").sender()
sender.publish({"w": torch.ones(1000)}, 0)
print("published", flush=True)
time.sleep(600)
"""


@pytest.mark.service
def test_shm_files_of_a_killed_sender_are_swept() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SENDER_SCRIPT], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
        pattern = f"asyncflow-weights-{proc.pid}-*.bin"
        assert list(Path("/dev/shm").glob(pattern)), "the sender's file should exist"
        assert sweep_orphans() == [], "a live sender's file must not be swept"
    finally:
        proc.kill()
        proc.wait(30)
    removed = sweep_orphans()
    assert any(f"asyncflow-weights-{proc.pid}-" in path for path in removed)
    assert not list(Path("/dev/shm").glob(pattern))


# -- Ray actors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        # address="local": a cluster of our own, never one another process on this host started
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Ray workers cannot import this test module (tests/ is not a package): ship its classes
    # by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    if started:
        ray.shutdown()


class GeneratorHost:
    """A stand-in generator host actor: it builds its receiver from the pickled config."""

    def __init__(self, transport: WeightTransport, member: str) -> None:
        self.receiver = transport.receiver(member)

    def newest(self) -> int:
        return self.receiver.newest()

    def load(self, after: int) -> tuple[int, Raw]:
        version = self.receiver.wait_newer(after, 60.0)
        state = self.receiver.get(version)
        try:
            return version, raw(state)
        finally:
            self.receiver.release(version)

    def close(self) -> None:
        self.receiver.close()


@pytest.mark.ray
@pytest.mark.parametrize("name", ["shm", "broadcast", "ipc"])
def test_ray_actor_receives(name: str, ray_cluster: Any) -> None:
    ray = ray_cluster
    transport = make_transport(name, **FAST[name])
    sender = transport.sender()
    actor_cls = ray.remote(num_cpus=0)(GeneratorHost)
    actor = actor_cls.remote(transport, "actor")
    try:
        assert ray.get(actor.newest.remote(), timeout=120) in (-1, 3)  # surfaces init errors
        wait_until(lambda: sender.members() == ["actor"], why="the actor to join")
        state = awkward_state(2)
        sender.publish(state, 3)
        version, got = ray.get(actor.load.remote(-1), timeout=120)
        assert version == 3
        check_same(got, state)
        ray.get(actor.close.remote(), timeout=60)
    finally:
        ray.kill(actor)
        sender.close()
    assert not shm_files()


def _never() -> None:
    time.sleep(600)  # (cancelled by the test)


@pytest.mark.slow
@pytest.mark.ray
def test_ray_object_store_weights_reach_an_actor_newest_first_and_a_stuck_fetch_is_bounded(
    ray_cluster: Any,
) -> None:
    """``deploy.weight_transport=ray``: the coordinator actor keeps the newest version's
    object; an actor that asks after version -1 gets only the newest, bit-exact; an older
    version is refused at the sender; a fetch whose object never arrives fails within the
    transport's ``timeout_s`` with an error naming it, instead of hanging the generator."""
    from asyncflow.deploy.coordinator import Coordinator
    from asyncflow.deploy.ray_weights import ObjectStoreWeights

    ray = ray_cluster
    name = f"weights-coordinator-{os.getpid()}"
    coord = ray.remote(Coordinator).options(name=name, num_cpus=0).remote()
    transport = ObjectStoreWeights(name, timeout_s=3.0)
    sender = transport.sender()
    actor = ray.remote(num_cpus=0)(GeneratorHost).remote(transport, "actor")
    stuck = ray.remote(num_cpus=0)(_never).remote()
    try:
        assert ray.get(actor.newest.remote(), timeout=120) == -1
        sender.publish(awkward_state(1), 1)
        sender.publish(awkward_state(2), 2)
        version, got = ray.get(actor.load.remote(-1), timeout=120)
        assert version == 2
        check_same(got, awkward_state(2))
        with pytest.raises(ValueError, match="not newer"):
            sender.publish(awkward_state(1), 1)
        ray.get(coord.put_weights.remote(3, [stuck]), timeout=60)  # (an object never made)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"version 3 .*ObjectStoreWeights\.timeout_s"):
            ray.get(actor.load.remote(2), timeout=120)
        assert time.monotonic() - started < 60
    finally:
        ray.cancel(stuck, force=True)
        ray.kill(actor)
        ray.kill(coord)
