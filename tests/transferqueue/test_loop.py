"""The handle's I/O loop: who runs it, and that every call completes whoever that is."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
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


@pytest.fixture(params=["always", "on-demand", "lend"])
def io(request: pytest.FixtureRequest) -> Iterator[LoopThread]:
    loop = LoopThread("test-io", always=request.param != "on-demand", lend=request.param == "lend")
    yield loop
    loop.close()


def test_a_blocking_call_runs_on_the_caller_when_the_loop_is_on_demand(io: LoopThread) -> None:
    where = [io.run(_where()) for _ in range(20)]
    if not io.always:
        assert all(w is threading.current_thread() for w in where)  # no hop to the daemon
    elif io.lend:  # the daemon lends the loop (unless it keeps it past the hand-over bound)
        assert threading.current_thread() in where
        assert set(where) <= {threading.current_thread(), io.thread}
    else:
        assert all(w is io.thread for w in where)
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


def test_work_run_on_a_connected_handles_loop_calls_there_and_is_cancelled_with_its_await() -> None:
    """``TransferQueue.run_async``: async code on another loop (a stage host's) runs its work
    on the handle's loop; the work's calls await their sockets on that loop's thread (no hop
    per call), round-trip the data, and cancelling the outer await cancels the work."""
    with transferqueue.serve(num_units=2) as svc, transferqueue.connect(svc.address) as tq:
        client = tq.async_client()
        seen: list[threading.Thread] = []
        hung = asyncio.Event()  # (of the handle's loop: set there by the cancellation)

        async def stage() -> list[int]:
            await client.declare_tasks(["t"])
            seen.append(threading.current_thread())
            await client.put({"x": torch.arange(6, dtype=torch.int64)})
            meta = await client.get_meta("t", ["x"], 6, timeout_s=30)
            seen.append(threading.current_thread())
            cols = await client.get_data(meta)
            await client.ack(meta)
            return cols["x"].tolist()  # type: ignore[union-attr]

        async def waits_forever() -> None:
            try:
                await client.get_meta("t", ["x"], 1, timeout_s=60)  # (nothing left to get)
            finally:
                seen.append(threading.current_thread())
                hung.set()

        async def host() -> None:  # the stage host's own loop, on this thread
            assert await tq.run_async(stage()) == list(range(6))
            waiting = asyncio.ensure_future(tq.run_async(waits_forever()))
            await asyncio.sleep(0.3)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting

        asyncio.run(host())
        deadline = time.monotonic() + 10
        while not hung.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hung.is_set(), "the work on the handle's loop was not cancelled with its await"
        assert seen and all(t.name == "transferqueue-client" for t in seen), seen
        assert tq.client().stats()["controller"]["rows_live"] == 0


def test_a_lent_loop_runs_its_own_timers_while_callers_call_and_once_they_stop() -> None:
    """The embedded controller's lease expiry and timeouts are timers on its loop: they fire
    while blocking callers run the loop (back to back) and once they have stopped calling."""
    io = LoopThread("test-io", lend=True)
    try:
        ticks: list[tuple[float, threading.Thread]] = []

        async def arm() -> None:
            loop = asyncio.get_running_loop()

            def tick() -> None:
                ticks.append((time.monotonic(), threading.current_thread()))
                if len(ticks) < 200:
                    loop.call_later(0.005, tick)

            loop.call_later(0.005, tick)

        io.run(arm())
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:  # callers run the loop back to back
            io.run(_where())
        busy = [t for t, _ in ticks]
        assert len(busy) >= 10, f"the loop's timers stalled while callers ran it: {len(busy)}"
        assert threading.current_thread() in {w for _, w in ticks}  # (run by the borrower)
        n = len(ticks)
        deadline = time.monotonic() + 10
        while len(ticks) < n + 10 and time.monotonic() < deadline:  # nobody calls now
            time.sleep(0.01)
        assert len(ticks) >= n + 10, "the daemon did not take the loop back"
        assert ticks[-1][1] is io.thread
    finally:
        io.close()


def test_a_lent_loop_serves_every_thread_and_loop_at_once() -> None:
    """Blocking callers on several threads and async callers on another loop at once: each
    call completes exactly once, whoever runs the loop."""
    io = LoopThread("test-io", lend=True)
    try:
        count = 0

        async def bump() -> int:
            nonlocal count
            await asyncio.sleep(0)
            count += 1
            return count

        def blocking() -> list[int]:
            return [io.run(bump(), timeout=60) for _ in range(300)]

        async def hopping() -> list[int]:
            return [await io.run_async(bump()) for _ in range(300)]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(blocking) for _ in range(3)]
            futs.append(pool.submit(asyncio.run, hopping()))
            got = [v for f in futs for v in f.result(timeout=120)]
        assert sorted(got) == list(range(1, 1201))  # every call ran once, none was lost
    finally:
        io.close()


def test_ctrl_c_during_a_blocking_call_cancels_it(io: LoopThread) -> None:
    """Ctrl-C while a blocking call waits (on the loop this thread runs, or on another's)
    raises ``KeyboardInterrupt`` from the call and cancels it: nothing goes on running for a
    caller that is gone, and the loop keeps serving."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("the test runner handles Ctrl-C itself")
    cancelled = threading.Event()

    async def wait_long() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    for _ in range(2):  # (the second call: on a loop this thread now runs, if lent)
        cancelled.clear()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            io.run(wait_long())
        assert time.monotonic() - t0 < 30
        assert cancelled.wait(10), "the interrupted call went on running on the loop"
        assert io.run(_where()) is not None


def test_ctrl_c_in_an_embedded_wait_does_not_leave_a_waiter_behind() -> None:
    """The main thread runs the embedded controller's loop during its calls: a get_meta
    interrupted by Ctrl-C is withdrawn, so the rows put next go to the next get_meta, not to
    the interrupted one (which would hold them leased until the lease expired)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("the test runner handles Ctrl-C itself")
    with transferqueue.start(num_units=1) as tq:
        client = tq.client()
        client.declare_tasks(["t"])
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            client.get_meta("t", ["x"], 4, timeout_s=60)
        client.put({"x": torch.arange(4)})
        meta = client.get_meta("t", ["x"], 4, timeout_s=10)
        assert torch.equal(client.get_data(meta)["x"], torch.arange(4))  # type: ignore[arg-type]
        client.ack(meta)
        assert client.stats()["controller"]["rows_live"] == 0
