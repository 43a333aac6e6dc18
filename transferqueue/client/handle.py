"""``TransferQueue``: a handle on a running TransferQueue, embedded or remote.

It owns the I/O loop and the links; clients made from it share them and keep it alive.
``close()`` is idempotent and also runs once the handle and all its clients are gone.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from transferqueue.client.async_client import AsyncClient
from transferqueue.client.buffers import ResultBuffers
from transferqueue.client.device_io import DeviceSide
from transferqueue.client.direct import DirectCalls
from transferqueue.client.holder import Holder
from transferqueue.client.links import ControllerLink, UnitLink
from transferqueue.client.sync_client import Client
from transferqueue.device.staging import CHUNK_BYTES, DeviceStaging
from transferqueue.loop import LoopThread
from transferqueue.wire import messages as m

__all__ = ["TransferQueue"]

T = TypeVar("T")


class TransferQueue:
    """A running TransferQueue. Make clients with :meth:`client` / :meth:`async_client`."""

    def __init__(
        self,
        io: LoopThread,
        controller: ControllerLink,
        units: Sequence[UnitLink],
        *,
        closers: Sequence[Callable[[], None]] = (),
        address: str | None = None,
        mode: str = "embedded",
        direct: DirectCalls | None = None,
        holder: str | None = None,
        release_io: Callable[[], None] | None = None,
    ) -> None:
        """``direct``: where sync clients send their consumer calls without the loop (a
        connected handle's, see :mod:`transferqueue.client.direct`; closed by ``closers``).
        ``holder``: the name the leases of this handle are held under (default ``host:pid``;
        see :mod:`transferqueue.client.holder`). ``release_io``: lets go of an ``io`` shared
        with other handles (closed by its last user), instead of closing it."""
        self._io = io
        self._controller = controller
        self._units = list(units)
        self.address = address
        self.mode = mode
        self._direct = direct
        self._closers = list(closers)
        self._buffers = ResultBuffers()  # reused by the reads of every client made here
        # device columns: pinned chunks, shared columns (nothing made before it is needed)
        self._device = DeviceSide(io, controller)
        self._closers.insert(0, self._device.close)  # (while the loop still runs)
        # the leases' holder: beats over the direct sockets (a connected handle), and says it
        # is gone before they close
        self.holder = Holder(holder, None if direct is None else direct.call, address)
        self._closers.insert(0, self.holder.close)
        self._finalizer = weakref.finalize(
            self, _close_all, self._closers, io.close if release_io is None else release_io
        )

    @property
    def num_units(self) -> int:
        return len(self._units)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def async_client(self) -> AsyncClient:
        """An asyncio client (its calls hop onto this handle's I/O loop when needed)."""
        return AsyncClient(
            self._io, self._controller, self._units, self._buffers, self, self._device, self.holder
        )

    def client(self) -> Client:
        """A blocking client, safe to share across threads."""
        return Client(self.async_client(), self._io, self._direct)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine of this handle's async clients on its I/O loop and wait for it,
        from any thread but the loop's own: for blocking calls layered over the async client
        (a compatibility facade), whose awaits then land on the loop without a hop each."""
        return self._io.run(coro, timeout)

    async def run_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await a coroutine run on this handle's I/O loop, from async code on any loop:
        a program whose work is mostly this handle's calls (a stage host) runs that work
        here, and each of its calls then awaits the sockets directly instead of hopping to
        the loop and back (two thread wake-ups a call). Cancelling the await cancels it."""
        return await self._io.run_async(coro)

    def configure_device(self, *, pinned_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Size the pinned memory that CUDA columns move through (default
        :data:`~transferqueue.device.staging.PINNED_BYTES` in chunks of
        :data:`~transferqueue.device.staging.CHUNK_BYTES`): at most ``pinned_bytes`` is pinned,
        reused by every client of this handle, freed on close. Call before the first device put
        or read (clients made after it use the new pool)."""
        if self._device.staging.pool.made:
            raise RuntimeError("configure_device must come before the first device put or read")
        old, self._device.staging = self._device.staging, DeviceStaging(pinned_bytes, chunk_bytes)
        old.close()

    @property
    def _staging(self) -> DeviceStaging:
        return self._device.staging

    def add_closer(self, closer: Callable[[], None]) -> None:
        """Run ``closer`` when the handle closes (after the ones given at construction)."""
        self._closers.append(closer)

    def replace_earlier_holders(self) -> int:
        """Say that this handle replaces every earlier handle of its holder name (a stage
        host restarted by its deployment, connected with the same ``holder=``): their leases'
        rows go back to their queues now instead of after their silence. Returns the rows
        given back."""
        return self.holder.replace_earlier()

    def reset(self) -> None:
        """Forget everything stored: rows, tasks, leases and field specs, for every client
        of this TransferQueue. Clients made before the reset must not be used after it."""
        self._io.run(self._reset())

    async def _reset(self) -> None:
        await self._controller.call(m.Reset())
        for unit in self._units:
            await unit.reset()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> TransferQueue:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f" at {self.address}" if self.address else ""
        return f"TransferQueue({self.mode}{where}, units={self.num_units})"


def _close_all(closers: list[Callable[[], None]], close_io: Callable[[], None]) -> None:
    for close in closers:
        with contextlib.suppress(Exception):  # one failing closer must not skip the rest
            close()
    close_io()
