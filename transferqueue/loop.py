"""``LoopThread``: an asyncio event loop with a daemon thread, and a blocking ``run``.

Every TransferQueue handle (embedded or connected) owns one: all controller state changes and
all socket I/O happen on that loop, so sync callers on any thread and async callers on any
other loop share one consistent view without locks. One thread at a time runs the loop (it
holds ``_drive``).

Three ways to run it:

- ``always=True`` (servers): the daemon thread runs the loop for the handle's lifetime, and
  every call hops onto it.
- ``always=False`` (a connected client): the loop runs only while somebody waits on it. A
  blocking call from a thread with no loop of its own, finding the loop free, runs the loop
  itself until its call is done: its replies wake the calling thread directly, with no hop
  to the daemon thread and back (on two cores that hop cost 0.35-0.9 ms per put + get cycle
  of four calls). Calls that find the loop taken (another thread's call, async callers on
  other loops) are handed to whoever runs it; when a caller leaves work behind (tasks still
  pending, calls handed to it), the daemon thread takes the loop over until that is done.
- ``always=True, lend=True`` (the embedded deployment, whose controller has work of its own:
  lease expiry, timers): the daemon thread runs the loop whenever no blocking caller does,
  and lends it to them. A blocking call that finds the daemon running the loop asks for it
  (the daemon stops after its current step and hands the loop over); the calls that follow
  from any thread with no loop of its own run it themselves, as in ``always=False``, and the
  daemon takes it back once callers have left it alone for ``_LINGER_S`` (or at once when a
  call is handed to it from another event loop). Background work thus never waits longer
  than that, and a thread making calls back to back pays no hop at all.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator
from types import FrameType
from typing import Any, TypeVar

from transferqueue.aio import within
from transferqueue.errors import ClosedError

__all__ = ["LoopThread", "shared_loop"]

T = TypeVar("T")

# ``lend``: how long blocking callers may leave the loop idle before the daemon takes it back
# (the longest the controller's own timers then wait), and the longest the daemon sleeps
# between looks while a caller runs the loop.
_LINGER_S = 0.01
_LOOK_MAX_S = 0.05
# How long a blocking call waits for the daemon to hand the loop over before it hands its
# call to whoever runs the loop instead (another caller took it first, or the daemon is in
# a long step).
_HANDOVER_S = 0.02


class _State:
    """What the daemon thread and the finalizer share (never the LoopThread itself)."""

    def __init__(self) -> None:
        self.drive = threading.Lock()  # held by the thread running the loop
        self.want = threading.Event()  # the daemon thread should run the loop
        self.closing = False
        # ``lend``: the daemon is in run_forever (a caller may ask for the loop); a caller
        # asked; when a blocking caller last left the loop (monotonic).
        self.forever = False
        self.asked = False
        self.left_at = 0.0


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


def _await_turn(state: _State) -> None:
    """``lend``: return holding the loop's drive once work was handed to the daemon, or once
    blocking callers have left the loop alone for ``_LINGER_S``."""
    look = _LINGER_S
    while True:
        if state.want.wait(look) or state.closing:
            state.drive.acquire()  # (a caller running the loop does that work meanwhile)
            return
        if time.monotonic() - state.left_at >= _LINGER_S and state.drive.acquire(blocking=False):
            return
        # a caller runs the loop: look less often the longer it does
        look = min(look * 2, _LOOK_MAX_S) if state.drive.locked() else _LINGER_S


class LoopThread:
    """An event loop and the daemon thread that runs it (always, when callers leave work
    behind, or whenever blocking callers lend it: see the module docstring)."""

    def __init__(
        self, name: str = "transferqueue-io", *, always: bool = True, lend: bool = False
    ) -> None:
        if lend and not always:
            raise ValueError("LoopThread(lend=True) needs always=True")
        self.loop = asyncio.new_event_loop()
        self.always = always
        self.lend = lend
        state = self._state = _State()
        loop = self.loop
        if always:
            state.want.set()
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(loop)
            ready.set()
            while True:
                if lend:
                    _await_turn(state)
                else:
                    state.want.wait()
                    state.drive.acquire()
                try:
                    state.want.clear()
                    if state.closing:
                        break
                    with contextlib.suppress(RuntimeError):  # stopped by close
                        if not always:
                            loop.run_until_complete(_until_idle())
                        elif not lend:
                            loop.run_forever()
                        else:
                            state.forever = True
                            try:
                                loop.run_forever()
                            finally:
                                state.forever = False
                            if state.asked:  # stopped to lend the loop: linger from now
                                state.asked = False
                                state.left_at = time.monotonic()
                                # (calls handed over meanwhile: the borrower runs the loop)
                                state.want.clear()
                finally:
                    state.drive.release()
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
        state = self._state
        if (not self.always or self.lend) and not _has_loop():
            if state.drive.acquire(blocking=False):
                return self._run_here(coro, timeout)
            if self.lend and state.forever and self._borrow():
                if timeout is not None:
                    timeout = max(timeout - _HANDOVER_S, 0.0)
                return self._run_here(coro, timeout)
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.CancelledError:
            if self.closed:  # close() cancelled the call
                raise ClosedError("the TransferQueue handle was closed") from None
            raise
        except BaseException:  # a timeout, Ctrl-C: the call must not go on without its caller
            fut.cancel()
            raise

    def _borrow(self) -> bool:
        """``lend``: ask the daemon for the loop; True once this thread holds its drive."""
        with contextlib.suppress(RuntimeError):  # (closed meanwhile: the caller says so)
            self.loop.call_soon_threadsafe(self._lent)
        return self._state.drive.acquire(timeout=_HANDOVER_S)

    def _lent(self) -> None:
        """On the loop: a blocking caller asked for it; the daemon stops after this step."""
        state = self._state
        if state.forever and threading.current_thread() is self.thread:
            state.asked = True
            self.loop.stop()

    def _run_here(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run the loop on this thread until ``coro`` is done (the drive is held)."""
        state = self._state
        try:
            if self.closed:
                coro.close()
                raise ClosedError("the TransferQueue handle is closed")
            main = coro if timeout is None else within(coro, timeout)
            task = self.loop.create_task(main)
            with _ctrl_c_cancels(task) as interrupted:
                try:
                    return self.loop.run_until_complete(task)
                except asyncio.CancelledError:
                    if interrupted:
                        raise KeyboardInterrupt from None
                    raise
                except RuntimeError:
                    if self.closed:  # close() stopped the loop under this call
                        raise ClosedError("the TransferQueue handle was closed") from None
                    raise
        finally:
            if self.lend:  # the daemon takes the loop back once callers leave it alone
                state.left_at = time.monotonic()
                state.drive.release()
            else:
                left = not self.loop.is_closed() and _pending(self.loop)
                state.drive.release()
                if left:  # tasks still pending: the daemon thread runs the loop until done
                    state.want.set()

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` on the loop from async code on any loop."""
        if self.in_loop():
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def close(self) -> None:
        self._finalizer()


@contextlib.contextmanager
def _ctrl_c_cancels(task: asyncio.Task[Any]) -> Iterator[list[bool]]:
    """While the main thread runs the loop for ``task``, Ctrl-C cancels the task (at an await:
    the controller's state is never left half-changed, as a ``KeyboardInterrupt`` raised in
    the middle of a handler would) and the call then raises ``KeyboardInterrupt``; a second
    Ctrl-C raises it at once. The way ``asyncio.run`` treats Ctrl-C. Yields the flag (a
    one-item list once interrupted)."""
    interrupted: list[bool] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupted  # (another thread, or the program handles Ctrl-C itself)
        return
    loop = task.get_loop()

    def on_ctrl_c(signum: int, frame: FrameType | None) -> None:
        if interrupted or task.done():
            raise KeyboardInterrupt
        interrupted.append(True)
        task.cancel()
        loop.call_soon_threadsafe(lambda: None)  # (wakes the loop out of its select)

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _has_loop() -> bool:
    """Whether the calling thread runs an event loop of its own (it must not run ours)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


_SHARED_LOCK = threading.Lock()
_SHARED: dict[int, list[Any]] = {}  # pid -> [LoopThread, users]


def shared_loop(name: str) -> tuple[LoopThread, Callable[[], None]]:
    """The process's shared ``always=False`` loop (made if there is none) and the function
    that lets go of it (idempotent): the loop closes when its last user lets go. The
    connected handles that ask for it (``connect(shared_loop=True)``) run their calls on one
    thread between them, not one each: thousands of handles in one process do not become
    thousands of threads contending for the GIL."""
    pid = os.getpid()
    with _SHARED_LOCK:
        entry = _SHARED.get(pid)
        if entry is None or entry[0].closed:
            _SHARED.clear()  # (a parent's, inherited by fork: its thread is not here)
            entry = _SHARED[pid] = [LoopThread(name, always=False), 0]
        entry[1] += 1
    io: LoopThread = entry[0]
    released = [False]

    def release() -> None:
        with _SHARED_LOCK:
            if released[0]:
                return
            released[0] = True
            entry[1] -= 1
            last = entry[1] == 0 and _SHARED.get(pid) is entry
            if last:
                del _SHARED[pid]
        if last:
            io.close()

    return io, release
