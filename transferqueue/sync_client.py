"""``Client``: the blocking facade over :class:`AsyncClient`, for threads and scripts.

Each call runs the async implementation on the handle's I/O loop and waits for it; errors
raised there are re-raised here. Use ``tq.async_client()`` inside async code instead: a
blocking call would stall your event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from transferqueue.client import AsyncClient, as_format, check_format
from transferqueue.loop import LoopThread
from transferqueue.meta import BatchMeta
from transferqueue.schema import Column, FieldSpec

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Client"]


class Client:
    """Sync TransferQueue client. Get one from ``tq.client()``; safe to share across threads."""

    def __init__(self, aclient: AsyncClient, io: LoopThread) -> None:
        self._a = aclient
        self._io = io

    @property
    def async_client(self) -> AsyncClient:
        return self._a

    def put(
        self,
        data: Mapping[str, Any],
        *,
        meta: BatchMeta | None = None,
        partition: str = "default",
        group: np.ndarray | Sequence[int] | int | None = None,
        version: np.ndarray | Sequence[int] | int | None = None,
        length: np.ndarray | Sequence[int] | int | None = None,
        specs: Mapping[str, FieldSpec] | None = None,
        ack: bool = True,
        lease_s: float = 60.0,
        timeout_s: float | None = None,
    ) -> BatchMeta:
        """See :meth:`AsyncClient.put`."""
        return self._io.run(
            self._a.put(
                data,
                meta=meta,
                partition=partition,
                group=group,
                version=version,
                length=length,
                specs=specs,
                ack=ack,
                lease_s=lease_s,
                timeout_s=timeout_s,
            )
        )

    def get_meta(
        self,
        task: str,
        fields: Sequence[str] | None = None,
        batch_size: int = 1,
        *,
        partition: str = "default",
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        min_version: int | None = None,
        max_group: int | None = None,
        **sampler_options: Any,
    ) -> BatchMeta:
        """See :meth:`AsyncClient.get_meta`."""
        return self._io.run(
            self._a.get_meta(
                task,
                fields,
                batch_size,
                partition=partition,
                timeout_s=timeout_s,
                lease_s=lease_s,
                sampler=sampler,
                min_version=min_version,
                max_group=max_group,
                **sampler_options,
            )
        )

    @overload
    def get_data(
        self,
        meta: BatchMeta,
        fields: Sequence[str] | None = None,
        *,
        format: Literal["torch"] = "torch",
    ) -> dict[str, Column]: ...

    @overload
    def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, *, format: Literal["arrow"]
    ) -> pa.Table: ...

    def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, *, format: str = "torch"
    ) -> dict[str, Column] | pa.Table:
        """See :meth:`AsyncClient.get_data` (``format="arrow"``: a ``pyarrow.Table``)."""
        check_format(format)
        return as_format(self._io.run(self._a.get_data(meta, fields)), format)

    def ack(self, meta: BatchMeta) -> None:
        """See :meth:`AsyncClient.ack`."""
        self._io.run(self._a.ack(meta))

    def release(self, meta: BatchMeta) -> None:
        """See :meth:`AsyncClient.release`."""
        self._io.run(self._a.release(meta))

    def stream(
        self,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        partition: str = "default",
        timeout_s: float | None = None,
        lease_s: float = 60.0,
        sampler: str = "fifo",
        **sampler_options: Any,
    ) -> Iterator[tuple[BatchMeta, dict[str, Column]]]:
        """See :meth:`AsyncClient.stream`: batches until the task's stream ends, each acked
        when the loop body is done with it."""
        while True:
            meta = self.get_meta(
                task,
                fields,
                batch_size,
                partition=partition,
                timeout_s=timeout_s,
                lease_s=lease_s,
                sampler=sampler,
                **sampler_options,
            )
            if len(meta):
                cols = self.get_data(meta)
                yield meta, cols
                if not meta.acked:
                    self.ack(meta)
            if meta.is_end:
                return

    def declare_tasks(self, tasks: Sequence[str], *, partition: str = "default") -> None:
        """See :meth:`AsyncClient.declare_tasks`."""
        self._io.run(self._a.declare_tasks(tasks, partition=partition))

    def finish(self, partition: str = "default") -> None:
        """See :meth:`AsyncClient.finish`."""
        self._io.run(self._a.finish(partition))

    def clear(self, partition: str | None = None) -> None:
        """See :meth:`AsyncClient.clear`."""
        self._io.run(self._a.clear(partition))

    def stats(self) -> dict[str, Any]:
        """See :meth:`AsyncClient.stats`."""
        return self._io.run(self._a.stats())
