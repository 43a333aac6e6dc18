"""``Client``: the blocking facade over :class:`AsyncClient`, for threads and scripts.

Each method is the async method of the same name, run on the handle's I/O loop until done
(:func:`_blocking` derives it, signature and docstring included, so the API is written once,
in :class:`AsyncClient`); errors raised there are re-raised here. Use ``tq.async_client()``
inside async code instead: a blocking call would stall your event loop.

On a connected handle, ``get_meta``, ``ack`` and ``release`` (one controller request each)
skip the loop: the calling thread sends the request itself (:mod:`transferqueue.client.direct`,
the same request built by :mod:`transferqueue.client.requests`, the same guarantees).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, TypeVar, overload

import torch

from transferqueue.client.async_client import AsyncClient, as_format, check_format
from transferqueue.client.direct import DirectCalls
from transferqueue.client.requests import ack_request, get_meta_request, release_request
from transferqueue.errors import ClosedError
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.schema import Column
from transferqueue.wire.messages import GetMeta
from transferqueue.wire.protocol import ControllerRequest

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Client"]

P = ParamSpec("P")
T = TypeVar("T")


def _consumer(
    fn: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
    request: Callable[P, ControllerRequest[T]],
) -> Callable[Concatenate[Client, P], T]:
    """:func:`_blocking`, but sent straight from the calling thread where the handle allows
    it (``request`` builds the controller request from the call's arguments)."""

    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        direct = self._direct
        if direct is None or self._io.in_loop():
            return self._io.run(fn(self._a, *args, **kwargs))
        msg = request(*args, **kwargs)
        if isinstance(msg, GetMeta):
            holder = self._a.holder
            if holder is not None:
                holder.start()
                msg.holder = holder.id
        return direct.call(msg)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = f"Blocking :meth:`AsyncClient.{fn.__name__}`.\n\n{fn.__doc__ or ''}"
    return call


def _blocking(
    fn: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Client, P], T]:
    def call(self: Client, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._io.run(fn(self._a, *args, **kwargs))

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = f"Blocking :meth:`AsyncClient.{fn.__name__}`.\n\n{fn.__doc__ or ''}"
    return call


class Client:
    """Sync TransferQueue client. Get one from ``tq.client()``; safe to share across threads."""

    def __init__(
        self, aclient: AsyncClient, io: LoopThread, direct: DirectCalls | None = None
    ) -> None:
        self._a = aclient
        self._io = io
        self._direct = direct  # (a connected handle's; None: every call runs on the loop)

    @property
    def async_client(self) -> AsyncClient:
        return self._a

    put = _blocking(AsyncClient.put)
    get_meta = _consumer(AsyncClient.get_meta, get_meta_request)

    def ack(self, meta: BatchMeta) -> None:
        """Blocking :meth:`AsyncClient.ack`: consume the batch's rows for its task
        (idempotent)."""
        self._settle(meta, ack_request, self._a.ack)

    def release(self, meta: BatchMeta) -> None:
        """Blocking :meth:`AsyncClient.release`: give the batch's rows back to its task
        unconsumed (e.g. a consumer shutting down)."""
        self._settle(meta, release_request, self._a.release)

    def _settle(
        self,
        meta: BatchMeta,
        request: Callable[[BatchMeta], ControllerRequest[None] | None],
        on_loop: Callable[[BatchMeta], Coroutine[Any, Any, None]],
    ) -> None:
        direct = self._direct
        if direct is None or self._io.in_loop():
            return self._io.run(on_loop(meta))
        msg = request(meta)
        if msg is not None:
            self._a.settled(meta)
            direct.call(msg)
            meta.acked = True
        return None

    declare_tasks = _blocking(AsyncClient.declare_tasks)
    finish = _blocking(AsyncClient.finish)
    clear = _blocking(AsyncClient.clear)
    stats = _blocking(AsyncClient.stats)
    specs = _blocking(AsyncClient.specs)
    status = _blocking(AsyncClient.status)
    reset_consumption = _blocking(AsyncClient.reset_consumption)
    set_custom_meta = _blocking(AsyncClient.set_custom_meta)
    get_custom_meta = _blocking(AsyncClient.get_custom_meta)
    lost_rows = _blocking(AsyncClient.lost_rows)
    retire_groups = _blocking(AsyncClient.retire_groups)
    claim = _blocking(AsyncClient.claim)
    kv_put = _blocking(AsyncClient.kv_put)
    kv_batch_put = _blocking(AsyncClient.kv_batch_put)
    kv_get = _blocking(AsyncClient.kv_get)
    kv_batch_get = _blocking(AsyncClient.kv_batch_get)
    kv_meta = _blocking(AsyncClient.kv_meta)
    kv_list = _blocking(AsyncClient.kv_list)
    kv_delete = _blocking(AsyncClient.kv_delete)
    kv_clear = _blocking(AsyncClient.kv_clear)
    save = _blocking(AsyncClient.save)
    load = _blocking(AsyncClient.load)

    @overload
    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["torch"] = "torch",
        device: str | torch.device | None = None,
    ) -> dict[str, Column]: ...

    @overload
    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["arrow"],
        device: None = None,
    ) -> pa.Table: ...

    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: str = "torch",
        device: str | torch.device | None = None,
    ) -> dict[str, Column] | pa.Table:
        """See :meth:`AsyncClient.get_data` (``format="arrow"``: a ``pyarrow.Table``;
        ``device``: columns land on that device)."""
        check_format(format)
        if device is not None:
            if format != "torch":
                raise ValueError("get_data(device=...) returns tensors: use format='torch'")
            return self._io.run(self._a.get_data(meta, fields, device=device))
        return as_format(self._io.run(self._a.get_data(meta, fields)), format)

    def stream(
        self, task: str, fields: Sequence[str], batch_size: int, **options: Any
    ) -> Iterator[tuple[BatchMeta, dict[str, Column]]]:
        """Blocking :meth:`AsyncClient.stream` (same keywords): batches until the task's
        stream ends, each acked when the loop body is done with it."""
        batches = self._a.stream(task, fields, batch_size, **options)
        try:
            while True:
                try:
                    item = self._io.run(_next(batches))
                except StopAsyncIteration:
                    return
                yield item
        finally:
            with contextlib.suppress(ClosedError):
                self._io.run(batches.aclose())


async def _next(batches: AsyncIterator[T]) -> T:
    return await anext(batches)
