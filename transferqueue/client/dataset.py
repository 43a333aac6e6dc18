"""``StreamingDataset``: a task's micro-batches as a PyTorch ``IterableDataset``, rank-aware.

A training loop with data parallelism (DP) and model parallelism (MP: tensor / pipeline /
context parallel ranks that must see the same input) iterates one dataset per rank::

    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from transferqueue.client.dataset import StreamingDataset, TorchGroup

    ds = StreamingDataset(
        tq.client(), task="train", fields=["input_ids", "advantages"], batch_size=4,
        partition="train", dp_rank=dp_rank, dp_size=dp_size, mp_rank=mp_rank, mp_size=mp_size,
        group=TorchGroup(),                 # every rank of the job (DP x MP) takes part
    )
    for cols in DataLoader(ds, batch_size=None, num_workers=0):   # already batched
        loss = model(cols["input_ids"].to_padded()[0], ...)        # [batch_size, T]
        loss.backward(); opt.step()         # the batch is acknowledged when the next is asked

How the ranks share the work (the decision, and why):

1. The *leader* (``dp_rank == 0 and mp_rank == 0``) leases one global batch of
   ``batch_size * dp_size`` rows with the ``balanced`` sampler (``dp_size`` parts of equal row
   count whose ``length`` headers are balanced: long-tail sequences do not pile up on one
   rank). Any other sampler works too: then ``meta.split`` balances the lengths itself.
2. The batch's :class:`BatchMeta` (metadata only, a few hundred bytes) is broadcast over
   ``group`` to every rank. DP rank ``r`` reads part ``r`` of it (``meta.split()[r]``) from
   the storage units itself; the MP ranks of one DP rank read the same part: the same
   batch on every rank of an MP group, with no change to the controller (which hands each
   row to a task once) and no payload through the leader.
3. When any rank asks for its next batch (or calls :meth:`ack` with ``ack="manual"``), the
   ranks meet at a barrier, so every rank has finished the batch; then the leader
   acknowledges the whole lease. A rank that dies mid-step never reaches the barrier: the
   lease runs out (``lease_s``) and the rows go to the next consumer, so each row is trained
   exactly once even then.

Why not let each rank lease its own batches? It needs no broadcast, but ranks then take
different numbers of batches (one rank can drain the queue while another waits, e.g. under
gradient accumulation), and DDP's collectives hang on the rank with fewer steps; nor would MP
ranks see the same batch. With a shared global batch every rank takes the same number of
steps. At the end of a stream the last global batch may hold fewer rows than ranks: the ranks
left without rows still get a batch, with 0 rows, so that their collectives stay aligned.

``group`` is anything with ``broadcast`` and ``barrier`` (:class:`RankGroup`):
:class:`TorchGroup` (``torch.distributed``, the normal case) or :class:`ThreadGroup` (ranks
as threads of one process). A single rank needs none. Use ``num_workers=0`` with a
DataLoader: the ranks' collectives must run in the rank's own process, and reads are already
asynchronous and zero-copy.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch.utils.data

from transferqueue.client.sync_client import Client
from transferqueue.meta import BatchMeta

__all__ = ["RankGroup", "StreamingDataset", "ThreadGroup", "TorchGroup"]


class RankGroup(Protocol):
    """The ranks that iterate one dataset together (all DP x MP ranks of a job).

    Both methods are collective: every rank calls them, in the same order."""

    def broadcast(self, obj: Any) -> Any:
        """Return the leader's ``obj`` on every rank (the others pass None). Called once per
        batch, by :class:`StreamingDataset` on every rank."""
        ...

    def barrier(self) -> None:
        """Return once every rank has called it. Called before a batch is acknowledged."""
        ...


class TorchGroup:
    """A :class:`RankGroup` over ``torch.distributed`` (gloo, NCCL, ...): ``src`` is the
    global rank of the leader; ``group`` the process group (None: the default world)."""

    def __init__(self, group: Any = None, src: int = 0) -> None:
        self.group = group
        self.src = src

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)


class ThreadGroup:
    """A :class:`RankGroup` of ``size`` threads in one process (rank 0 is the leader).
    ``timeout_s`` bounds each wait; a rank that never arrives breaks the group."""

    def __init__(self, size: int, timeout_s: float = 600.0) -> None:
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._box: Any = None

    def broadcast(self, obj: Any) -> Any:
        if obj is not None:
            self._box = obj
        self._barrier.wait()  # the leader's object is in the box
        got = self._box
        self._barrier.wait()  # everyone has it: the box may be refilled
        return got

    def barrier(self) -> None:
        self._barrier.wait()


class StreamingDataset(torch.utils.data.IterableDataset[Any]):
    """Micro-batches of ``task`` for one rank: a dict of columns (``with_meta``: a
    ``(BatchMeta, columns)`` pair) per step, until the partition's stream ends.

    ``batch_size`` is this rank's micro-batch (rows); the leader leases ``batch_size *
    dp_size`` per step. ``timeout_s`` bounds each wait of the leader for a batch (None: wait
    until the batch is full or the stream ends; an empty wait yields nothing and waits
    again). ``lease_s`` must exceed a training step: a lease that runs out gives its rows to
    another consumer. ``ack="next"`` acknowledges a batch when the next is asked for (or the
    loop ends); ``ack="manual"``: call :meth:`ack` on every rank (after the optimizer step).
    ``device`` (``"cuda:0"``): each rank's columns land on its device through pinned memory
    (``get_data(device=...)``).
    """

    def __init__(
        self,
        client: Client,
        task: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        partition: str = "default",
        dp_rank: int = 0,
        dp_size: int = 1,
        mp_rank: int = 0,
        mp_size: int = 1,
        group: RankGroup | None = None,
        sampler: str | None = None,
        sampler_options: Mapping[str, Any] | None = None,
        lease_s: float = 600.0,
        timeout_s: float | None = None,
        ack: Literal["next", "manual"] = "next",
        format: Literal["torch", "arrow"] = "torch",
        with_meta: bool = False,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        if device is not None and format != "torch":
            raise ValueError("device= lands tensors on a device: use format='torch'")
        for name, rank, size in (("dp", dp_rank, dp_size), ("mp", mp_rank, mp_size)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{name}_rank={rank} must be in [0, {name}_size={size})")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if group is None and dp_size * mp_size > 1:
            raise ValueError(
                f"dp_size={dp_size} x mp_size={mp_size} ranks need a group= to share batches: "
                "TorchGroup() under torch.distributed, ThreadGroup(n) for threads"
            )
        if ack not in ("next", "manual"):
            raise ValueError(f"ack must be 'next' or 'manual', got {ack!r}")
        self.client = client
        self.task = task
        self.fields = list(fields)
        self.batch_size = batch_size
        self.partition = partition
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.mp_rank, self.mp_size = mp_rank, mp_size
        self.group = group
        self.sampler = sampler or ("balanced" if dp_size > 1 else "fifo")
        options = dict(sampler_options or {})
        if self.sampler == "balanced":
            options.setdefault("dp_size", dp_size)
        self.sampler_options = options
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.ack_mode = ack
        self.format = format
        self.with_meta = with_meta
        self.device = device
        self._pending: BatchMeta | None = None  # the global batch not yet acknowledged

    @property
    def is_leader(self) -> bool:
        return self.dp_rank == 0 and self.mp_rank == 0

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            raise RuntimeError(
                "StreamingDataset runs its ranks' collectives in the iterating process: use "
                "DataLoader(..., num_workers=0) (reads are asynchronous already)"
            )
        while True:
            if self.ack_mode == "next":
                self.ack()
            elif self._pending is not None:
                raise RuntimeError(
                    'ack="manual": call ack() on every rank before asking for the next batch'
                )
            meta = self._next_global()
            if meta is None:
                continue  # the leader's wait ran out empty: ask again
            if len(meta) == 0:  # the end, and nothing left
                return
            part = self._part(meta)
            if self.device is not None:
                cols = self.client.get_data(part, self.fields, device=self.device)
            else:
                cols = self.client.get_data(part, self.fields, format=self.format)
            self._pending = meta
            yield (part, cols) if self.with_meta else cols
            if meta.is_end:
                if self.ack_mode == "next":
                    self.ack()
                return

    def ack(self) -> None:
        """Acknowledge the last batch, once every rank is done with it (a collective: call
        it on every rank). A no-op when nothing is pending."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if self.group is not None:
            self.group.barrier()
        if self.is_leader and pending.lease_id is not None and not pending.acked:
            self.client.ack(pending)

    def _next_global(self) -> BatchMeta | None:
        """The step's global batch on every rank (None: an empty wait; ask again)."""
        meta = None
        if self.is_leader:
            meta = self.client.get_meta(
                self.task,
                self.fields,
                self.batch_size * self.dp_size,
                partition=self.partition,
                timeout_s=self.timeout_s,
                lease_s=self.lease_s,
                sampler=self.sampler,
                **self.sampler_options,
            )
        if self.group is not None:
            meta = self.group.broadcast(meta)
        assert meta is not None
        if len(meta) == 0 and not meta.is_end:
            return None
        return meta

    def _part(self, meta: BatchMeta) -> BatchMeta:
        """This DP rank's share of the global batch (all of it with one DP rank)."""
        if self.dp_size == 1:
            return meta
        return meta.split(self.dp_size)[self.dp_rank]
