"""``LoopThread``: an asyncio event loop with a daemon thread, and a blocking ``run``.

Every TransferQueue handle (embedded or connected) owns one: all controller state changes and
all socket I/O happen on that loop, so sync callers on any thread and async callers on any
other loop share one consistent view without locks. One thread at a time runs the loop (it
holds ``_drive``).

Two ways to run it:

- ``always=True`` (servers, the embedded deployment): the daemon thread runs the loop for the
  handle's lifetime, and every call hops onto it.
- ``always=False`` (a connected client): the loop runs only while somebody waits on it. A
  blocking call from a thread with no loop of its own, finding the loop free, runs the loop
  itself until its call is done: its replies wake the calling thread directly, with no hop
  to the daemon thread and back (on two cores that hop cost 0.35-0.9 ms per put + get cycle
  of four calls). Calls that find the loop taken (another thread's call, async callers on
  other loops) are handed to whoever runs it; when a caller leaves work behind (tasks still
  pending, calls handed to it), the daemon thread takes the loop over until that is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from transferqueue.aio import within
from transferqueue.errors import ClosedError

__all__ = ["LoopThread"]

T = TypeVar("T")


class _State:
    """What the daemon thread and the finalizer share (never the LoopThread itself)."""

    def __init__(self) -> None:
        self.drive = threading.Lock()  # held by the thread running the loop
        self.want = threading.Event()  # the daemon thread should run the loop
        self.closing = False


async def _until_idle() -> None:
    """Run until no other task is pending on this loop."""
    me = asyncio.current_task()
    while True:
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if not pending:
            return
        await asyncio.wait(pending)


def _pending(loop: asyncio.AbstractEventLoop) -> bool:
    return any(not t.done() for t in asyncio.all_tasks(loop))


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, state: _State) -> None:
    if loop.is_closed():
        return
    state.closing = True
    state.want.set()
    if loop.is_running():
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(timeout=5)


class LoopThread:
    """An event loop and the daemon thread that runs it (always, or when callers leave work
    behind: see the module docstring)."""

    def __init__(self, name: str = "transferqueue-io", *, always: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.always = always
        state = self._state = _State()
        loop = self.loop
        if always:
            state.want.set()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            ready.set()
            while True:
                state.want.wait()
                with state.drive:
                    state.want.clear()
                    if state.closing:
                        break
                    with contextlib.suppress(RuntimeError):  # stopped by close
                        if always:
                            loop.run_forever()
                        else:
                            loop.run_until_complete(_until_idle())
            with state.drive:
                # Cancel what is left so no task is destroyed while pending.
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                with contextlib.suppress(RuntimeError):
                    if pending:
                        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self.thread = threading.Thread(target=main, name=name, daemon=True)
        self.thread.start()
        ready.wait()
        self._finalizer = weakref.finalize(self, _stop, self.loop, self.thread, state)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def in_loop(self) -> bool:
        """Whether the calling thread is the one running the loop right now."""
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop (from any thread); whoever runs the loop runs it."""
        if self.closed:
            coro.close()
            raise ClosedError("the TransferQueue handle is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        self._state.want.set()  # (a caller running the loop leaves it to the daemon after)
        return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        if self.in_loop():
            coro.close()
            raise RuntimeError(
                "a sync TransferQueue call was made on its own I/O loop; use the async client "
                "(tq.async_client()) inside async code"
            )
        if not self.always and not _has_loop() and self._state.drive.acquire(blocking=False):
            try:
                if self.closed:
                    coro.close()
                    raise ClosedError("the TransferQueue handle is closed")
                main = coro if timeout is None else within(coro, timeout)
                try:
                    return self.loop.run_until_complete(main)
                except RuntimeError:
                    if self.closed:  # close() stopped the loop under this call
                        raise ClosedError("the TransferQueue handle was closed") from None
                    raise
            finally:
                left = not self.loop.is_closed() and _pending(self.loop)
                self._state.drive.release()
                if left:  # tasks still pending: the daemon thread runs the loop until done
                    self._state.want.set()
        try:
            return self.submit(coro).result(timeout)
        except concurrent.futures.CancelledError:
            if self.closed:  # close() cancelled the call
                raise ClosedError("the TransferQueue handle was closed") from None
            raise

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from async code on any loop."""
        if self.in_loop():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        self._finalizer()


def _has_loop() -> bool:
    """Whether the calling thread runs an event loop of its own (it must not run ours)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
