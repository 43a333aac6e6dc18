"""No call hangs forever: bad addresses fail at once, waits end at the end of the stream or
with an error naming the fix, a dead server is noticed, bad times are refused, and a client
keeps the handle it came from."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch
import zmq
import zmq.asyncio

import transferqueue
from transferqueue import Client, UnknownFieldError
from transferqueue.errors import BadRequestError, FinishedError, PeerGoneError
from transferqueue.wire.rpc import RpcClient


@pytest.mark.parametrize(
    "address", ["127.0.0.1:1", "tcp://127.0.0.1", "tcp://:5555", "tcp://h:99999", "", "http://x:1"]
)
def test_connect_to_a_malformed_address_fails_at_once_showing_the_expected_form(
    address: str,
) -> None:
    t0 = time.monotonic()
    with pytest.raises(BadRequestError, match=r"expected tcp://HOST:PORT"):
        transferqueue.connect(address)
    assert time.monotonic() - t0 < 5  # (it hung forever: a socket was left open)


def test_a_socket_that_fails_to_connect_is_closed_so_the_context_can_end() -> None:
    """The root cause of the hang: a socket whose connect failed was never closed, and
    ``Context.term`` waits for every socket."""
    ctx = zmq.asyncio.Context()
    with pytest.raises(BadRequestError, match="cannot connect"):
        RpcClient(ctx, "tcp://no such host:5")  # (well-formed; ZeroMQ refuses it)
    done = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), done.set()), daemon=True).start()
    assert done.wait(10)


@pytest.mark.service
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["127.0.0.1:1"], "expected tcp://HOST:PORT"),
        (["tcp://127.0.0.1:1", "--timeout", "1"], "no TransferQueue controller answered"),
    ],
)
def test_stats_cli_fails_at_once_with_what_to_do(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "transferqueue.deploy.cli", "stats", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_misspelt_field_ends_the_stream_of_a_finished_partition(client: Client) -> None:
    client.put({"score": torch.arange(4.0)}, group=0, partition="p")
    client.finish("p")
    with pytest.raises(UnknownFieldError, match=r"\['scroe'\].*never come.*'score'"):
        for _ in client.stream("t", ["scroe"], 2, partition="p"):
            pass


def test_a_field_a_declared_task_may_still_write_is_waited_for(client: Client) -> None:
    """Not an error while a declared producer task has not started (it may write it)."""
    client.declare_tasks(["rollout", "train"], partition="p")
    client.put({"prompt": torch.arange(4)}, group=0, partition="p")
    client.finish("p")
    meta = client.get_meta("train", ["response"], 2, partition="p", timeout_s=0.3)
    assert len(meta) == 0 and meta.reason == "timeout"
    batch = client.get_meta("rollout", ["prompt"], 4, partition="p", timeout_s=5)
    client.put({"response": torch.arange(4)}, meta=batch)
    assert len(client.get_meta("train", ["response"], 4, partition="p", timeout_s=5)) == 4


def test_put_after_finish_raises_and_clear_reopens(client: Client) -> None:
    first = client.put({"x": torch.arange(2)}, group=0, partition="p")
    client.finish("p")
    with pytest.raises(FinishedError, match="'p' is finished"):
        client.put({"x": torch.arange(2)}, group=0, partition="p")
    client.put({"y": torch.arange(2)}, meta=first)  # fields of existing rows: fine
    client.clear("p")
    client.put({"x": torch.arange(2)}, group=0, partition="p")


@pytest.mark.parametrize("lease_s", [float("inf"), -5.0, 0.0, float("nan")])
def test_lease_times_must_be_finite_and_positive(client: Client, lease_s: float) -> None:
    client.put({"x": torch.arange(2)}, group=0)
    with pytest.raises(BadRequestError, match="lease_s"):
        client.get_meta("t", ["x"], 2, lease_s=lease_s, timeout_s=1)
    meta = client.get_meta("t", ["x"], 2, timeout_s=5)
    with pytest.raises(BadRequestError, match="lease_s"):
        client.put({"y": torch.arange(2)}, meta=meta, lease_s=lease_s)  # (renews the lease)
    with pytest.raises(BadRequestError, match="max_lease_s"):
        client.get_meta("t", ["x"], 2, lease_s=10 * 86400.0, timeout_s=0)


def test_a_negative_timeout_is_refused(client: Client) -> None:
    with pytest.raises(BadRequestError, match="timeout_s"):
        client.get_meta("t", ["x"], 1, timeout_s=-1)


def test_a_client_keeps_its_handle_alive(deploy: transferqueue.TransferQueue) -> None:
    c = deploy().client()
    meta = c.put({"x": torch.arange(3)}, group=0)
    assert c.get_data(meta)["x"].tolist() == [0, 1, 2]  # type: ignore[union-attr]
    c = transferqueue.start(num_units=1).client()  # the handle itself is not kept
    gc.collect()
    meta = c.put({"x": torch.arange(3)}, group=0)
    assert c.get_data(meta)["x"].tolist() == [0, 1, 2]  # type: ignore[union-attr]
    handle = weakref.ref(c.async_client._owner)
    del c, meta
    gc.collect()
    assert handle() is None  # and lets it go (closing it) once the last client is gone


@pytest.mark.service
def test_connect_then_client_without_keeping_the_handle() -> None:
    with transferqueue.serve(num_units=1) as svc:
        client = transferqueue.connect(svc.address).client()
        gc.collect()
        assert client.stats()["controller"]["rows_live"] == 0


@pytest.mark.slow
@pytest.mark.service
@pytest.mark.parametrize("call", ["get_meta", "put"])
def test_a_wait_notices_a_dead_controller(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    """A get_meta or a put waiting for capacity without a timeout waits on the controller in
    slices; a controller that dies is noticed within a slice plus the call timeout."""
    import transferqueue.client.controller_link

    monkeypatch.setattr(transferqueue.client.controller_link, "WAIT_SLICE_S", 0.5)
    with transferqueue.serve(num_units=1, capacity_rows=2) as svc:
        tq = transferqueue.connect(svc.address, call_timeout_s=2)
        client = tq.client()
        client.put({"x": torch.arange(2)}, group=0)  # full
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                if call == "get_meta":
                    client.get_meta("t", ["nothing"], 1)
                else:
                    client.put({"x": torch.arange(2)}, group=0)
            except BaseException as e:
                errors.append(e)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        time.sleep(1.5)
        assert waiter.is_alive()  # waiting, slice after slice
        svc._procs[-1].kill()  # the controller
        waiter.join(30)
        assert not waiter.is_alive() and isinstance(errors[0], PeerGoneError), errors
        tq.close()


def test_a_controller_that_fails_to_grow_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError half way through growing once left the controller's arrays of different
    sizes (an IndexError on every later put); growing is now all or nothing."""
    from transferqueue.controller.core import Controller
    from transferqueue.controller.state import TaskState

    ctl = Controller(num_units=2)
    meta = ctl.writes.allocate(1000, "p")
    ctl.queues.poll(task="t", partition="p", fields=["x"], batch_size=1, lease_s=5)  # a task
    real = TaskState.grown

    def fail(self: TaskState, capacity: int) -> tuple:
        raise MemoryError("simulated")

    monkeypatch.setattr(TaskState, "grown", fail)
    with pytest.raises(MemoryError):
        ctl.writes.allocate(5000, "p")
    monkeypatch.setattr(TaskState, "grown", real)
    assert ctl.stats()["rows_live"] == 1000
    more = ctl.writes.allocate(5000, "p")  # serves as before
    assert more.indexes[0] == meta.indexes[-1] + 1 and len(more) == 5000
    with pytest.raises(BadRequestError, match="4194304"):
        ctl.writes.allocate(300_000_000, "p")  # refused before anything is sized
