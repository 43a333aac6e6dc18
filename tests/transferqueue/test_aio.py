"""Bounded waits end on cancellation even when what they wait for completes in the same loop
iteration (``asyncio.wait_for`` on Python 3.11 returns the result then, and a loop around it
outlives its ``cancel()``: a hang at shutdown, seen once in CI)."""

from __future__ import annotations

import asyncio

import pytest

from asyncflow.registry import Registry
from transferqueue.aio import wait_event, within

BOUND_S = 30.0  # bounds waits that end on events; nothing here measures time


async def _cancel_as_it_completes(task: asyncio.Task[object], complete: object) -> None:
    """Complete what ``task`` waits on and cancel ``task`` in the same loop iteration, then
    require that the cancellation arrives (bounded, so a swallowed one fails, not hangs)."""
    complete()  # type: ignore[operator]
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=BOUND_S)
    assert done, "the task outlived its cancel()"
    assert task.cancelled()


def test_wait_event_loop_ends_when_cancelled_as_the_event_is_set() -> None:
    async def go() -> None:
        ev = asyncio.Event()

        async def follow() -> None:
            while True:
                ev.clear()
                await wait_event(ev, BOUND_S)

        task = asyncio.ensure_future(follow())
        await asyncio.sleep(0.01)  # the loop is waiting on the event
        await _cancel_as_it_completes(task, ev.set)

    asyncio.run(go())


def test_within_raises_cancelled_when_cancelled_as_the_result_arrives() -> None:
    async def go() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def waiter() -> None:
            await within(asyncio.shield(fut), BOUND_S)
            while True:  # a swallowed cancellation would leave the task here
                await asyncio.sleep(0.01)

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0.01)
        await _cancel_as_it_completes(task, lambda: fut.set_result(1))

    asyncio.run(go())


def test_wait_event_and_within_report_timeouts() -> None:
    async def go() -> None:
        ev = asyncio.Event()
        assert await wait_event(ev, 0.01) is False
        ev.set()
        assert await wait_event(ev, 0.0) is True  # already set: no wait at all
        with pytest.raises(TimeoutError):
            await within(asyncio.Event().wait(), 0.01)
        assert await within(asyncio.sleep(0, result=7), None) == 7

    asyncio.run(go())


def test_registry_follower_ends_when_cancelled_as_it_is_poked() -> None:
    """The CI hang: a generator's follower in ``wait_update`` woken by another generator's
    update in the iteration its host was cancelled."""

    async def go() -> None:
        reg = Registry(0, policy="eager", poll_s=BOUND_S)
        await reg.register("g0", 0)
        task = asyncio.ensure_future(reg.wait_update("g0", BOUND_S))
        await asyncio.sleep(0.01)
        await _cancel_as_it_completes(task, reg.poke)

    asyncio.run(go())
