"""``LoopThread``: an asyncio event loop on a daemon thread, with a blocking ``run``.

Every TransferQueue handle (embedded or connected) owns one: all controller state changes and
all socket I/O happen on that loop, so sync callers on any thread and async callers on any
other loop share one consistent view without locks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from transferqueue.errors import ClosedError

__all__ = ["LoopThread"]

T = TypeVar("T")


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    if loop.is_closed():
        return
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(timeout=5)


class LoopThread:
    """An event loop running forever on its own daemon thread."""

    def __init__(self, name: str = "transferqueue-io") -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()
            # Cancel what is left so no task is destroyed while pending.
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

        self.thread = threading.Thread(target=main, name=name, daemon=True)
        self.thread.start()
        ready.wait()
        self._finalizer = weakref.finalize(self, _stop, self.loop, self.thread)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def in_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self.closed:
            coro.close()
            raise ClosedError("the TransferQueue handle is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        if self.in_loop():
            coro.close()
            raise RuntimeError(
                "a sync TransferQueue call was made on its own I/O loop; use the async client "
                "(tq.async_client()) inside async code"
            )
        return self.submit(coro).result(timeout)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from async code on any loop."""
        if self.in_loop():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        self._finalizer()
