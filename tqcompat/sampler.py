"""The peer's samplers: ``SequentialSampler`` mapped to ours, every other one run as given.

| peer sampler                 | here                                                         |
|------------------------------|--------------------------------------------------------------|
| ``SequentialSampler``        | our ``fifo`` sampler in the controller (arrival order)       |
| a user ``BaseSampler``       | run as given, in the process that calls ``get_meta``, over   |
|                              | the rows it pooled (:class:`Pool`)                           |
| ``GRPOGroupNSampler(n)``     | the same: runs of ``n`` consecutive indexes in the sorted    |
|                              | ready rows, the peer's scan (a run starts anywhere)          |
| ``SeqlenBalancedSampler``    | refused at ``init``: use our ``balanced`` sampler            |
| ``RankAwareSampler``         | our ``fifo`` sampler, the batch shared by claim (below)      |

**How a sampler runs as given.** The peer's controller keeps, per task, the rows ready and
not consumed, calls ``sample(ready_indexes, batch_size, **sampling_config)`` and marks the
returned ``consumed`` rows. Here the facade leases every ready row of the task into a pool
(our ``get_meta``, one lease per refill), calls the sampler over the pool, and acknowledges
the consumed rows (our ``ack`` of that sub-batch): rows sampled but not consumed stay in the
pool, to be sampled again (sampling with replacement). Two calls of ours per ``get_meta``.
The sampler's state lives in the process that calls ``get_meta``; two processes consuming
one task with a user sampler each pool their own rows (the peer's controller holds one).

**How ranks share a batch** (``RankAwareSampler``). The peer's controller caches, per
``(partition, task, dp_rank, batch_index)``, the rows the first rank sampled and hands the same
rows to every other rank of the group. Here the group agrees through our controller's atomic
``claim`` (:mod:`transferqueue.controller.claims`), under the name
``rank-aware/{task}/{dp_rank}/{batch_index}``: a rank first looks the name up (a later rank
gets the group's rows at once); a first rank takes a batch of ready rows (our ``get_meta``)
and claims it: if another rank of its group claimed first, it releases its batch (the rows go
back to the task) and returns the claimed rows. The rows are consumed by the rank that won;
the others read them without a lease.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

import transferqueue

__all__ = [
    "BaseSampler",
    "GRPOGroupNSampler",
    "Pool",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "get_seqlen_balanced_partitions",
    "resolve_sampler",
]


class BaseSampler(ABC):
    """The peer's sampler seam: ``sample(ready_indexes, batch_size, **sampling_config)``
    returns ``(sampled, consumed)`` global indexes. Subclass it as with the peer."""

    native: ClassVar[str | None] = None
    """Our sampler that serves this one in the controller (None: run as given)."""
    refused: ClassVar[str | None] = None
    """Why ``init`` refuses it, and what to use instead (None: it runs)."""
    shared: ClassVar[bool] = False
    """True: the ranks of a group share each batch through our ``claim`` (see the module)."""

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """``(sampled, consumed)`` global indexes out of ``ready_indexes``."""

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)


class SequentialSampler(BaseSampler):
    """Ready rows in arrival order, each consumed once per task: our ``fifo``."""

    native: ClassVar[str | None] = "fifo"

    def sample(
        self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        picked = list(ready_indexes[:batch_size])
        return picked, list(picked)


class GRPOGroupNSampler(BaseSampler):
    """Whole groups of ``n_samples_per_prompt`` rows: runs of ``n`` consecutive global
    indexes in the sorted ready rows, the peer's scan exactly (a run may start anywhere:
    ``[3, 4, 5]`` is a group for ``n=3``); ``batch_size`` counts rows (a multiple of ``n``),
    nothing until that many groups are ready. With ``dp_rank`` and ``batch_index`` given, a
    result is cached and handed again for the same pair (the peer's per-rank state)."""

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise ValueError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        states = self._states.get(partition_id, {}).get(task_name, {})
        dp_rank, batch_index = kwargs.get("dp_rank"), kwargs.get("batch_index")
        if batch_index in states.get(dp_rank, {}):
            cached: tuple[list[int], list[int]] = states[dp_rank][batch_index]
            return cached
        n = self.n_samples_per_prompt
        if batch_size % n:
            raise ValueError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        wanted = batch_size // n
        ready = sorted(ready_indexes)
        picked: list[int] = []
        i = 0
        while i <= len(ready) - n and len(picked) < wanted * n:
            run = ready[i : i + n]
            if run[-1] - run[0] == n - 1 and len(set(run)) == n:  # n consecutive indexes
                picked += run
                i += n
            else:
                i += 1
        if len(picked) < wanted * n:
            return [], []
        result = (picked, list(picked))
        if dp_rank is not None:
            states.setdefault(dp_rank, {}).setdefault(batch_index, result)
            self._states.setdefault(partition_id, {})[task_name] = states
        return result


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Length-balanced parts across ``dp_size`` ranks: refused (see the module)."""

    refused: ClassVar[str | None] = (
        "use transferqueue's 'balanced' sampler (dp_size=, rows put with length=)"
    )

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt)
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size


class RankAwareSampler(SequentialSampler):
    """Ranks of one data-parallel group (``sampling_config``'s ``dp_rank``) receive the same
    rows for a ``batch_index``: ready rows in arrival order, shared by claim (see the
    module). ``sample`` is the peer's, for a sampler run as given in one process."""

    shared: ClassVar[bool] = True

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int = 0,
        batch_index: int = 0,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:
            raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        # the peer's layout: partition -> task -> dp_rank -> batch_index -> rows
        group = self._states.setdefault(partition_id, {}).setdefault(task_name, {})
        group = group.setdefault(dp_rank, {})
        if batch_index not in group:
            picked = list(ready_indexes[:batch_size])
            if len(picked) < batch_size:
                return [], []
            group[batch_index] = picked
        return list(group[batch_index]), list(group[batch_index])


def get_seqlen_balanced_partitions(
    seqlen_list: list[int], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """The peer's helper: ``k_partitions`` lists of item positions, sorted, whose summed
    lengths are balanced: our ``BatchMeta.split`` of a batch whose rows are the items and
    whose ``lengths`` are theirs (longest first to the lightest part). Its parts always hold
    n//k or n//k+1 items, so ``equal_size=False`` gets equal counts too. As the peer: fewer
    items than parts, or ``equal_size`` with n not a multiple of k, is an
    ``AssertionError``."""
    n = len(seqlen_list)
    assert n >= k_partitions, f"number of items:[{n}] < k_partitions:[{k_partitions}]"
    if equal_size:
        assert n % k_partitions == 0, f"{n} items do not split into {k_partitions} equal parts"
    pos = np.arange(n, dtype=np.int64)  # the items as rows of a batch: index = position
    rows = transferqueue.BatchMeta(
        pos, np.zeros(n, np.int32), pos, pos, np.asarray(seqlen_list, dtype=np.int64), ""
    )
    return [part.indexes.tolist() for part in rows.split(k_partitions)]


_KNOWN = {
    c.__name__: c
    for c in (SequentialSampler, GRPOGroupNSampler, SeqlenBalancedSampler, RankAwareSampler)
}


def resolve_sampler(spec: Any) -> tuple[str, BaseSampler | None, bool]:
    """Our controller sampler's name, for a sampler run as given its instance, and whether
    the ranks of a group share batches by claim, for the peer's ``controller.sampler`` (a
    name, a class or an instance). A refused one is a ``NotImplementedError`` naming it and
    what to use instead."""
    if isinstance(spec, str):
        if spec not in _KNOWN:
            raise ValueError(f"Could not find sampler {spec} (known: {sorted(_KNOWN)})")
        spec = _KNOWN[spec]
    if isinstance(spec, type) and issubclass(spec, BaseSampler):
        cls: type[BaseSampler] = spec
        instance: BaseSampler | None = None
    elif isinstance(spec, BaseSampler):
        cls, instance = type(spec), spec
    else:
        raise ValueError(
            f"controller.sampler must be a sampler name, a BaseSampler subclass or instance, "
            f"got {spec!r}"
        )
    if cls.refused is not None:
        raise NotImplementedError(
            f"sampler {cls.__name__} is not served by the transfer_queue facade over "
            f"transferqueue: {cls.refused}"
        )
    if cls.native is not None and cls.sample in (SequentialSampler.sample, RankAwareSampler.sample):
        return cls.native, None, cls.shared
    return "fifo", instance if instance is not None else cls(), False


class Pool:
    """One task's rows leased into this process for a sampler run as given (see the
    module): chunks of our batches, one per refill, and where each pooled row sits."""

    def __init__(self) -> None:
        self._chunks: list[transferqueue.BatchMeta] = []
        self._where: dict[int, tuple[int, int]] = {}  # index -> (chunk, position)

    def __len__(self) -> int:
        return len(self._where)

    def indexes(self) -> list[int]:
        """The pooled rows, oldest first (the ready rows the sampler is shown)."""
        return sorted(self._where)

    def add(self, meta: transferqueue.BatchMeta) -> None:
        if len(meta) == 0:
            return
        self._chunks.append(meta)
        c = len(self._chunks) - 1
        for pos, index in enumerate(meta.indexes.tolist()):
            self._where[index] = (c, pos)

    def take(self, indexes: Sequence[int]) -> transferqueue.BatchMeta:
        """Our batch of the pooled rows ``indexes``, in that order, without a lease (for
        reads); an index not pooled is a ``ValueError`` naming it."""
        missing = [i for i in indexes if i not in self._where]
        if missing:
            raise ValueError(f"the sampler returned indexes {missing} that are not ready rows")
        parts = [self._chunks[c].select([p]) for c, p in (self._where[i] for i in indexes)]

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(p, name) for p in parts])

        first = self._chunks[0]
        return transferqueue.BatchMeta(
            cat("indexes"),
            cat("units"),
            cat("groups"),
            cat("versions"),
            cat("lengths"),
            partition=first.partition,
            fields=first.fields,
        )

    def consume(self, indexes: Sequence[int]) -> list[transferqueue.BatchMeta]:
        """Drop ``indexes`` from the pool; returns, per lease, the sub-batch to acknowledge."""
        by_chunk: dict[int, list[int]] = {}
        for i in indexes:
            if i in self._where:
                c, p = self._where.pop(i)
                by_chunk.setdefault(c, []).append(p)
        return [self._chunks[c].select(pos) for c, pos in by_chunk.items()]
