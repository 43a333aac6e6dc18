"""The controller requests of a consumer's calls (``get_meta``, ``ack``, ``release``), built
from the call's arguments in one place for both ways a call is sent: through the handle's
event loop (:class:`~transferqueue.client.async_client.AsyncClient`) and straight from a
sync client's thread (:mod:`transferqueue.client.direct`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transferqueue.client.put import lease_s_of, timeout_of
from transferqueue.meta import BatchMeta
from transferqueue.wire import messages as m

__all__ = ["ack_request", "get_meta_request", "release_request"]


def get_meta_request(
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
    consume: bool = False,
    **sampler_options: Any,
) -> m.GetMeta:
    """The request of ``get_meta`` (same arguments; see ``AsyncClient.get_meta``)."""
    return m.GetMeta(
        task=task,
        partition=partition,
        fields=None if fields is None else list(fields),
        batch_size=batch_size,
        lease_s=lease_s_of(lease_s),
        sampler=sampler,
        sampler_options=sampler_options,
        min_version=min_version,
        max_group=max_group,
        timeout_s=timeout_of(timeout_s),
        consume=consume,
    )


def ack_request(meta: BatchMeta) -> m.Ack | None:
    """The request of ``ack(meta)``; None: acked already (acks are idempotent)."""
    if meta.lease_id is None:
        raise ValueError("this BatchMeta holds no lease (it came from put, or was empty)")
    if meta.acked:
        return None
    return m.Ack(lease_id=meta.lease_id, indexes=meta.indexes)


def release_request(meta: BatchMeta) -> m.Release | None:
    """The request of ``release(meta)``; None: nothing to give back."""
    if meta.lease_id is None or meta.acked:
        return None
    return m.Release(lease_id=meta.lease_id, indexes=meta.indexes)
