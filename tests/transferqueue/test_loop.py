"""The handle's I/O loop: who runs it, and that every call completes whoever that is."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import transferqueue
from transferqueue.errors import ClosedError
from transferqueue.loop import LoopThread


async def _where() -> threading.Thread:
    await asyncio.sleep(0)
    return threading.current_thread()


@pytest.fixture(params=[True, False], ids=["always", "on-demand"])
def io(request: pytest.FixtureRequest) -> Iterator[LoopThread]:
    loop = LoopThread("test-io", always=request.param)
    yield loop
    loop.close()


def test_a_blocking_call_runs_on_the_caller_when_the_loop_is_on_demand(io: LoopThread) -> None:
    where = io.run(_where())
    if io.always:
        assert where is io.thread
    else:
        assert where is threading.current_thread()  # no hop to the daemon thread
    with pytest.raises(RuntimeError, match="own I/O loop"):

        async def nested() -> None:
            io.run(_where())

        io.run(nested())


def test_calls_from_other_threads_complete_while_one_caller_waits(io: LoopThread) -> None:
    gate = asyncio.Event()
    waiting = threading.Event()
    got: list[str] = []

    async def wait_for_gate() -> str:
        waiting.set()
        await gate.wait()
        return "opened"

    async def open_gate() -> str:
        gate.set()
        return "set"

    waiter = threading.Thread(target=lambda: got.append(io.run(wait_for_gate(), timeout=60)))
    waiter.start()
    assert waiting.wait(60)  # the waiter's call runs (on the loop it drives, or the daemon's)
    assert io.run(open_gate(), timeout=60) == "set"  # handed to whoever runs the loop
    waiter.join(60)
    assert got == ["opened"]


def test_work_a_caller_leaves_behind_finishes_without_further_calls(io: LoopThread) -> None:
    done = threading.Event()

    async def later() -> None:
        await asyncio.sleep(0.05)
        done.set()

    async def spawn() -> None:
        asyncio.get_running_loop().create_task(later())

    io.run(spawn())
    assert done.wait(5), "the task left on the loop never ran"


def test_async_callers_on_other_loops_are_served(io: LoopThread) -> None:
    async def main() -> list[threading.Thread]:
        return list(await asyncio.gather(*(io.run_async(_where()) for _ in range(8))))

    where = asyncio.run(main())
    assert all(w is not threading.current_thread() for w in where)
    # a blocking call from inside another event loop hands the call over (it cannot run ours)

    async def blocking_inside_a_loop() -> threading.Thread:
        return io.run(_where(), timeout=10)

    assert asyncio.run(blocking_inside_a_loop()) is not threading.current_thread()


def test_close_ends_a_call_that_is_waiting_on_the_loop(io: LoopThread) -> None:
    errors: list[BaseException] = []
    started = threading.Event()

    async def sleep_an_hour() -> None:
        started.set()
        await asyncio.sleep(3600)

    def wait_forever() -> None:
        try:
            io.run(sleep_an_hour())
        except BaseException as e:  # recorded for the assertion
            errors.append(e)

    th = threading.Thread(target=wait_forever)
    th.start()
    assert started.wait(60)  # the call is waiting on the loop
    io.close()
    th.join(60)  # ended by the close, not by the hour's sleep
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ClosedError)
    with pytest.raises(ClosedError):
        io.run(_where())


def test_a_connected_client_calls_without_the_hop_and_shares_across_threads() -> None:
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.client()
        client.declare_tasks(["t"])
        got: list[int] = []

        def consume() -> None:  # blocks on the loop until rows come
            meta = client.get_meta("t", ["x"], 6, timeout_s=60)
            got.extend(client.get_data(meta)["x"].tolist())  # type: ignore[union-attr]
            client.ack(meta)

        th = threading.Thread(target=consume)
        th.start()
        time.sleep(0.3)
        for k in range(3):  # from this thread while the consumer waits on the loop
            client.put({"x": torch.tensor([2 * k, 2 * k + 1])})
        th.join(60)
        assert sorted(got) == list(range(6))
        assert tq.client().stats()["controller"]["rows_live"] == 0
