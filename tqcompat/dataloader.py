"""The peer's ``StreamingDataset`` / ``StreamingDataLoader``: a PyTorch iterable over a task's
batches, each split into micro-batches, yielded as ``(TensorDict, BatchMeta)``.

Each iteration step is the facade's ``get_meta`` (with ``sampling_config`` = ``dp_rank``,
``task_name``, ``batch_index``, ``partition_id``, as the peer passes them) then ``get_data``:
rows are consumed at ``get_meta`` as everywhere in the facade. An empty batch (``polling_mode``)
or a ``TimeoutError`` (not enough rows yet) waits ``TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_
INTERVAL`` seconds (1) and asks again. ``should_check_consumption_status=True`` ends the
iteration once the task has consumed every row of the partition.

DataLoader workers (``num_workers > 0``) are other processes: they connect to the store by the
address in the config ``init`` returned, so the store must be a service (``ray.init()``
before ``tq.init()``); with the store embedded in the main process, use ``num_workers=0``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tqcompat.interface import client_for, reachable_address
from tqcompat.metadata import BatchMeta

__all__ = ["StreamingDataLoader", "StreamingDataset", "chunk_batch_fn", "default_fetch_batch_fn"]


def default_fetch_batch_fn(
    tq_client: Any,
    data_fields: list[str],
    batch_size: int,
    partition_id: str,
    task_name: str,
    sampling_config: dict[str, Any],
    batch_index: int,
) -> tuple[Any, BatchMeta]:
    """One batch: ``(TensorDict, meta)``, or ``(None, empty meta)`` when none is ready."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    try:
        meta = tq_client.get_meta(
            data_fields=data_fields,
            batch_size=batch_size,
            partition_id=partition_id,
            task_name=task_name,
            sampling_config=config,
        )
    except TimeoutError:
        return None, BatchMeta.empty()
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: Any, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[Any]:
    """Split a batch into micro-batches of ``micro_batch_size`` rows (the last one shorter)."""
    if not isinstance(micro_batch_size, int) or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size}")
    total = int(td.batch_size[0])
    if micro_batch_size > total:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}) exceeds total batch size ({total})"
        )
    # torch slices no strided nested tensor along its batch axis: such a field is split into
    # its rows once, and each micro-batch gets a nested tensor of its rows (the same layout)
    strided = {
        k: v.unbind(0)
        for k, v in td.items()
        if isinstance(v, torch.Tensor) and v.is_nested and v.layout == torch.strided
    }
    rest = td.exclude(*strided) if strided else td
    out = []
    for start in range(0, total, micro_batch_size):
        stop = min(start + micro_batch_size, total)
        part = rest[start:stop]
        for k, rows in strided.items():
            part[k] = torch.nested.as_nested_tensor(list(rows[start:stop]), layout=torch.strided)
        out.append((part, batch_meta[start:stop]))
    return out


class StreamingDataset(torch.utils.data.IterableDataset[Any]):
    """The peer's streaming dataset over the facade (see the module)."""

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: Callable[..., tuple[Any, BatchMeta]] | None = None,
        process_batch_fn: Callable[..., list[Any]] | None = None,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(data_fields) < 1:
            raise ValueError(f"data_fields must name at least one field, got {data_fields}")
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        super().__init__()
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = list(data_fields)
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn = process_batch_fn or chunk_batch_fn
        self.sampling_config = {"dp_rank": dp_rank, "task_name": task_name}
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0
        self._sleep_s = float(os.environ.get("TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_INTERVAL", 1))

    def _done(self, client: Any) -> bool:
        return bool(
            self.should_check_consumption_status
            and self.batch_index >= len(self.buffer)
            and client.check_consumption_status(self.task_name, self.partition_id)
        )

    def __iter__(self) -> Iterator[Any]:
        client = client_for(self.config)
        while not self._done(client):
            if self.batch_index < len(self.buffer):
                data, meta = self.buffer[self.batch_index]
                self.batch_index += 1
                yield from self.process_batch_fn(data, meta, micro_batch_size=self.micro_batch_size)
                continue
            data, meta = self.fetch_batch_fn(
                tq_client=client,
                data_fields=self.data_fields,
                batch_size=self.batch_size,
                partition_id=self.partition_id,
                task_name=self.task_name,
                sampling_config=self.sampling_config,
                batch_index=self.batch_index,
            )
            if data is not None:
                self.buffer.append((data, meta))
            else:
                time.sleep(self._sleep_s)

    def reset(self) -> None:
        """Replay the batches fetched so far from the start."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Switch to ``partition_id`` (e.g. from train to val), dropping the buffer."""
        self.buffer, self.batch_index, self.partition_id = [], 0, partition_id


def _identity(data: Any) -> Any:
    return data


class StreamingDataLoader(torch.utils.data.DataLoader[Any]):
    """A DataLoader over a :class:`StreamingDataset` yielding ``(TensorDict, BatchMeta)``
    (the dataset batches; ``batch_size`` here is None)."""

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ) -> None:
        if num_workers > 0:
            # Refused here, before any worker is forked from a process whose threads may hold
            # locks the child would wait on forever.
            reachable_address(dataset.config)
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=collate_fn or _identity,
            pin_memory=pin_memory,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )
