"""The peer's ``AsyncTransferQueueClient`` / ``TransferQueueClient``, over our client.

Each call lands on our public client in one or two calls:

| peer call                                  | ours                                          |
|--------------------------------------------|-----------------------------------------------|
| ``get_meta(fields, B, partition, task)``   | ``get_meta(task, fields, B, timeout_s=...,    |
|                                            | consume=True)`` (at-most-once, the default)   |
| ``put(td, partition_id=p)``                | ``put(columns, partition=p)``                 |
| ``put(td, metadata=m)``                    | ``put(columns, meta=m.native)`` (acks a lease)|
| ``get_data(m)``                            | ``get_data(m.native, m.field_names)``         |
| ``set_custom_meta(m)``                     | ``set_custom_meta(indexes, metas)``           |
| ``clear_partition(p)``                     | ``clear(p)``                                  |
| ``clear_samples(m)``                       | ``retire_groups(m.native.groups)`` (own group)|
| ``get_meta(..., mode="force_fetch")``      | ``status(p, fields=..., meta=True)`` (no wait,|
|                                            | no lease, every live row)                     |
| ``get_meta(..., mode="insert")``           | ``put({}, partition=p, tags=[{}] * n)``: new  |
|                                            | rows holding no field yet (``put(td,          |
|                                            | metadata=m)`` writes them)                    |
| ``get_consumption_status(task, p)``        | ``status(p, task=task)``                      |
| ``get_production_status(fields, p)``       | ``status(p, fields=fields)``                  |
| ``reset_consumption(p, task)``             | ``reset_consumption(task, p)`` (per task)     |
| ``get_partition_list()``                   | ``stats()`` (its partitions)                  |

``get_meta`` waits as the peer's controller does: up to ``timeout_s`` (the peer's
``TQ_CONTROLLER_GET_METADATA_TIMEOUT``, 1 s) for ``batch_size`` ready rows, then a
``TimeoutError``; with ``polling_mode`` it does not wait and returns an empty ``BatchMeta``.
A short batch goes back to the task (``release``) either way, as the peer never hands out one.
With ``leases=True`` (see :mod:`tqcompat.interface`) rows are leased, not consumed, at
``get_meta``: ``put(..., metadata=m)`` or ``ack(m)`` consumes them, and a batch whose consumer
dies comes back after ``lease_s``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import numpy as np
import torch

import transferqueue
from tqcompat.metadata import BatchMeta
from tqcompat.sampler import BaseSampler, Pool
from tqcompat.tensors import from_columns, schema_from_spec, schema_of, to_columns

__all__ = ["AsyncTransferQueueClient", "Options", "TransferQueueClient"]

_POOL_BATCH = 4096  # rows leased into a sampler's pool per call of ours
_POOL_LEASE_S = 86400.0  # pooled rows stay leased to this process (our longest lease)

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(kw_only=True)
class Options:
    """How the facade consumes (set by ``init``; see :mod:`tqcompat.interface`)."""

    polling_mode: bool = False
    """The peer's ``controller.polling_mode``: an empty batch instead of waiting."""
    timeout_s: float = 1.0
    """How long a non-polling ``get_meta`` waits for ``batch_size`` ready rows."""
    leases: bool = False
    """False: rows are consumed at ``get_meta`` (the peer). True: leased until acked."""
    lease_s: float = 60.0
    """With ``leases``: how long a batch may stay unacknowledged before it comes back."""
    sampler: str = "fifo"
    """Our sampler serving ``get_meta`` (see :mod:`tqcompat.sampler`)."""
    user_sampler: BaseSampler | None = None
    """A peer sampler run as given over a pool of leased rows (see :mod:`tqcompat.sampler`)."""
    shared: bool = False
    """The ranks of a ``dp_rank`` share each batch by claim (``RankAwareSampler``)."""


def _claim_name(task: str, sampling_config: dict[str, Any]) -> str:
    """The name the ranks of one group claim a batch under (see :mod:`tqcompat.sampler`)."""
    try:
        dp_rank, batch_index = int(sampling_config["dp_rank"]), int(sampling_config["batch_index"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "RankAwareSampler: get_meta needs sampling_config={'dp_rank': int, 'batch_index': "
            f"int}} (StreamingDataset passes both), got {sampling_config!r}"
        ) from None
    if dp_rank < 0:
        raise ValueError(f"dp_rank {dp_rank} must be greater than or equal to 0")
    return f"rank-aware/{task}/{dp_rank}/{batch_index}"


def _check_get_meta(
    data_fields: Any, batch_size: Any, mode: str, task_name: str | None
) -> tuple[list[str], str]:
    fields = _check_fields(data_fields)
    if mode not in ("fetch", "force_fetch", "insert"):
        raise ValueError(f"Invalid mode: {mode!r} (expected 'fetch', 'force_fetch' or 'insert')")
    if mode == "insert":
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        return fields, ""
    if mode == "force_fetch":
        return fields, ""  # (no task, no batch size: every live row, see _force_fetch)
    if task_name is None:
        raise ValueError("get_meta(mode='fetch') needs task_name=")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return fields, task_name


def _check_names(values: Any, kind: type, what: str, kind_name: str) -> list[Any]:
    """``values`` as a non-empty list of ``kind`` (one value: a list of it), the peer's
    ``ValueError`` (empty) and ``TypeError`` (wrong kind) otherwise."""
    if isinstance(values, kind) and not isinstance(values, bool):
        return [values]
    if not isinstance(values, list):
        raise TypeError(f"Only {kind_name} or list of {kind_name} are allowed as `{what}`.")
    if not values:
        raise ValueError(f"Received an empty list as `{what}`.")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise TypeError(f"Not all elements in `{what}` are {kind_name}.")
    return list(values)


def _check_fields(data_fields: Any) -> list[str]:
    if isinstance(data_fields, str):
        data_fields = [data_fields]
    if (type(data_fields) not in (list, tuple) and not isinstance(data_fields, Sequence)) or (
        not data_fields
    ):
        raise ValueError(f"data_fields must be a non-empty list of names, got {data_fields!r}")
    if not all(isinstance(f, str) and f for f in data_fields):
        raise ValueError(f"data_fields must hold non-empty strings, got {data_fields!r}")
    return list(data_fields)


class AsyncTransferQueueClient:
    """The peer's asyncio client: ``async_get_meta``, ``async_put``, ``async_get_data``...
    Get the process's client from ``tq.get_client()`` (a :class:`TransferQueueClient`, which
    has both the ``async_*`` calls and their blocking twins)."""

    def __init__(self, handle: transferqueue.TransferQueue, options: Options) -> None:
        self._handle = handle
        self._a = handle.async_client()
        self.options = options
        # the peer's schema entry per (partition, field): our specs are per partition
        self._schemas: dict[tuple[str, str], dict[str, Any]] = {}
        self._pools: dict[tuple[str, str, tuple[str, ...]], Pool] = {}

    @property
    def native(self) -> transferqueue.AsyncClient:
        """Our async client under the facade, for calls the peer does not have."""
        return self._a

    def _known_schema(
        self, partition: str, fields: Sequence[str], specs: Mapping[str, str] | None = None
    ) -> Any:
        """The peer's schema of ``fields`` of ``partition`` from what this client learnt
        (``specs``: our field specs of the partition, learnt first); None while one of them is
        unknown here."""
        for name, spec in (specs or {}).items():
            self._schemas[(partition, name)] = schema_from_spec(spec)
        if specs is None and any((partition, f) not in self._schemas for f in fields):
            return None  # (ask the partition's specs once, then they are known)
        return {
            f: dict(self._schemas[(partition, f)])
            for f in fields
            if (partition, f) in self._schemas
        }

    async def _schema(self, partition: str, fields: Sequence[str]) -> dict[str, dict[str, Any]]:
        got = self._known_schema(partition, fields)
        if got is None:
            specs = await self._a.specs(partition)
            got = self._known_schema(partition, fields, {n: s.describe() for n, s in specs.items()})
        return got

    def learn_schema(self, partition: str, cols: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The peer's schema of columns just written to ``partition``, remembered (a cleared
        partition takes new specs: what was written last is what it holds)."""
        schema = schema_of(dict(cols))
        for name, entry in schema.items():
            self._schemas[(partition, name)] = {
                k: v for k, v in entry.items() if k != "per_sample_shapes"
            }
        return schema

    async def write_columns(
        self,
        write: Callable[[dict[str, Any]], Awaitable[T]],
        cols: dict[str, Any],
        partition: str,
    ) -> T:
        """Run ``write(cols)`` (a put of ours); where a dense column's dtype differs from its
        field's (the peer keeps a dtype per row, we one per field), cast it to the field's
        dtype when the cast is exact, and write again; where its rows' shape differs (same
        dtype and number of axes: the peer keeps a shape per row), write it as a ``Shaped``
        column, which widens the partition's field to rows of any shape. An inexact cast
        keeps our ``SchemaError``. A put refused because another client cleared the partition
        since this one learnt its specs is written again once the specs are read afresh."""
        try:
            return await write(cols)
        except transferqueue.UnknownFieldError:
            await self._a.specs(partition)  # (reads them again: the cleared partition has none)
            return await write(cols)
        except transferqueue.SchemaError:
            specs = {n: s.describe() for n, s in (await self._a.specs(partition)).items()}
            cast = dict(cols)
            for name, col in cols.items():
                known = schema_from_spec(specs[name]) if name in specs else None
                if (
                    known is None
                    or not isinstance(col, torch.Tensor)
                    or known["dtype"] is None
                    or known["is_nested"]
                ):
                    continue
                if col.dtype == known["dtype"]:
                    if col.shape[1:] != known["shape"] and col.dim() == len(known["shape"]) + 1:
                        cast[name] = transferqueue.Shaped.from_dense(col)
                    continue
                as_known = col.to(known["dtype"])
                if torch.equal(as_known.to(col.dtype), col):
                    cast[name] = as_known
            if all(cast[n] is cols[n] for n in cols):
                raise
            return await write(cast)

    async def _wrap(self, native: transferqueue.BatchMeta, fields: Sequence[str]) -> BatchMeta:
        n = len(native)
        custom = await self._a.get_custom_meta(native.indexes) if n else []
        return BatchMeta(
            native.indexes.tolist(),
            [native.partition] * n,
            await self._schema(native.partition, fields),
            np.ones(n, np.int8),
            custom_meta=custom,
            native=native,
        )

    # -- consumers ---------------------------------------------------------------------------
    async def async_get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """``batch_size`` rows of ``partition_id`` whose ``data_fields`` are all written, not
        yet consumed by ``task_name`` (see the module for the wait and the semantics)."""
        fields, task = _check_get_meta(data_fields, batch_size, mode, task_name)
        if mode == "force_fetch":
            return await self._force_fetch(fields, partition_id)
        if mode == "insert":
            return await self._insert(fields, partition_id, batch_size)
        if self.options.user_sampler is not None:
            return await self._get_meta_sampled(
                fields, batch_size, partition_id, task, sampling_config or {}
            )
        plan = self._get_meta_plan(fields, batch_size, partition_id, task, sampling_config)
        try:
            step = next(plan)
            while True:
                name, args, kwargs = step
                step = plan.send(await getattr(self._a, name)(*args, **kwargs))
        except StopIteration as done:
            native = done.value
        if isinstance(native, int):
            return self._short(task, fields, partition_id, batch_size, native)
        return await self._wrap(native, fields)

    def _get_meta_plan(
        self,
        fields: list[str],
        batch_size: int,
        partition: str,
        task: str,
        sampling_config: dict[str, Any] | None,
    ) -> Generator[tuple[str, tuple[Any, ...], dict[str, Any]], Any, transferqueue.BatchMeta | int]:
        """``get_meta`` as the calls of ours it makes, yielded as ``(name, args, kwargs)`` and
        sent back their results: the async client awaits them, the blocking one calls our
        blocking client (its consumer calls go without an event loop). Returns our batch, or
        how many rows were ready when too few were (given back)."""
        o = self.options
        claim = None
        if o.shared:
            claim = _claim_name(task, sampling_config or {})
            claimed = yield "claim", (claim,), {"partition": partition}
            if len(claimed):  # (a rank of the group took this batch first)
                return claimed
        native = yield (
            "get_meta",
            (task, fields, batch_size),
            {
                "partition": partition,
                "timeout_s": 0.0 if o.polling_mode else o.timeout_s,
                "lease_s": o.lease_s,
                # (takes no options: sampling_config is for samplers run as given)
                "sampler": o.sampler,
                # at most once, in one round trip (a batch to claim is acked once it won)
                "consume": not o.leases and claim is None,
            },
        )
        if len(native) < batch_size:
            if len(native):
                yield "release", (native,), {}
            return len(native)
        if claim is not None:
            claimed = yield "claim", (claim, native.indexes), {"partition": partition}
            if not np.array_equal(claimed.indexes, native.indexes):
                yield "release", (native,), {}  # (lost the race: the group's batch is claimed)
                return claimed
        if not o.leases and not native.acked:
            yield "ack", (native,), {}
        return native

    async def _insert(self, fields: list[str], partition: str, batch_size: int) -> BatchMeta:
        """The peer's ``get_meta(mode="insert")``: ``batch_size`` new rows of ``partition``
        that hold no field yet (our put of tags only), none ready; ``put(data, metadata=m)``
        (of the batch or of rows selected from it) writes their fields."""
        native = await self._a.put({}, partition=partition, tags=[{}] * batch_size)
        n = len(native)
        schema = await self._schema(partition, fields)  # (the fields written there before)
        return BatchMeta(
            native.indexes.tolist(), [partition] * n, schema, np.zeros(n, np.int8), native=native
        )

    async def _force_fetch(self, fields: list[str], partition: str) -> BatchMeta:
        """The peer's ``get_meta(mode="force_fetch")``: every live row of ``partition`` in
        index order, at once (no wait, no sampler, ``batch_size`` and ``task_name`` unused),
        consumed or not, ready or not; no task's consumption changes. ``production_status``
        says per row whether all ``fields`` are written (a field nobody wrote: 0 for every
        row); ``get_data`` of such a batch needs its rows ready (select them first)."""
        schema = await self._schema(partition, fields)
        known = [f for f in fields if f in schema]
        st = await self._a.status(partition, fields=known, meta=True)
        native = st.meta
        assert native is not None  # (asked with meta=True)
        n = len(st)
        ready = np.ones(n, dtype=bool) if len(known) == len(fields) else np.zeros(n, dtype=bool)
        for f in known:
            ready &= st.ready[f]
        custom = await self._a.get_custom_meta(native.indexes) if n else []
        return BatchMeta(
            native.indexes.tolist(),
            [native.partition] * n,
            schema,
            ready.astype(np.int8),
            custom_meta=custom,
            native=native,
        )

    def _short(
        self, task: str, fields: list[str], partition: str, wanted: int, ready: int
    ) -> BatchMeta:
        if self.options.polling_mode:
            return BatchMeta.empty()
        raise TimeoutError(
            f"Timeout while waiting for sufficient data for task {task}. Required: "
            f"{wanted}, Available: {ready} (fields {fields} in partition {partition!r}, "
            f"waited {self.options.timeout_s} s: raise TQ_CONTROLLER_GET_METADATA_TIMEOUT "
            "or use polling_mode)"
        )

    async def _refill(self, pool: Pool, task: str, fields: list[str], partition: str) -> None:
        """Lease every row ready for ``task`` into ``pool`` (our ``get_meta``, no wait)."""
        while True:
            got = await self._a.get_meta(
                task,
                fields,
                _POOL_BATCH,
                partition=partition,
                timeout_s=0.0,
                lease_s=_POOL_LEASE_S,
            )
            pool.add(got)
            if len(got) < _POOL_BATCH:
                return

    async def _get_meta_sampled(
        self,
        fields: list[str],
        batch_size: int,
        partition: str,
        task: str,
        sampling_config: dict[str, Any],
    ) -> BatchMeta:
        """``get_meta`` with a sampler run as given (see :mod:`tqcompat.sampler`)."""
        sampler = self.options.user_sampler
        assert sampler is not None
        pool = self._pools.setdefault((partition, task, tuple(fields)), Pool())
        await self._refill(pool, task, fields, partition)
        if len(pool) < batch_size and not self.options.polling_mode:
            more = await self._a.get_meta(
                task,
                fields,
                batch_size - len(pool),
                partition=partition,
                timeout_s=self.options.timeout_s,
                lease_s=_POOL_LEASE_S,
            )
            pool.add(more)
        if len(pool) < batch_size:
            return self._short(task, fields, partition, batch_size, len(pool))
        sampled, consumed = sampler.sample(
            pool.indexes(),
            batch_size,
            task_name=task,
            partition_id=partition,
            **sampling_config,
        )
        sampled = [int(i) for i in sampled]
        if not sampled:
            return self._short(task, fields, partition, batch_size, len(pool))
        native = pool.take(sampled)
        for part in pool.consume([int(i) for i in consumed]):
            await self._a.ack(part)
        return await self._wrap(native, fields)

    async def async_ack(self, metadata: BatchMeta) -> None:
        """With leases: consume the batch's rows (a ``put`` with it does too). Not a peer
        call: the peer consumes at ``get_meta``."""
        if metadata.native is not None and metadata.native.lease_id is not None:
            await self._a.ack(metadata.native)

    async def async_get_data(self, metadata: BatchMeta) -> Any:
        """The batch's rows as a TensorDict of its ``field_names``, in the batch's order."""
        if metadata.size == 0:
            return from_columns({}, 0)
        if metadata.native is None:
            raise ValueError(
                "get_data needs a BatchMeta from get_meta or put (this one was built by hand "
                "and names no stored rows)"
            )
        cols = await self._a.get_data(metadata.native, metadata.field_names or None)
        return from_columns(cols, metadata.size)

    # -- producers ---------------------------------------------------------------------------
    async def async_put(
        self,
        data: Any,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write a TensorDict: new rows of ``partition_id``, or (``metadata``) new fields of
        the batch's rows. Returns the rows' ``BatchMeta`` with the new fields."""
        if data_parser is not None:
            data = data_parser(data)
        cols, rows = to_columns(data)
        if metadata is None:
            if partition_id is None:
                raise ValueError("put needs metadata= or partition_id=")
            native = await self.write_columns(
                lambda c: self._a.put(c, partition=partition_id), cols, partition_id
            )
            schema = self.learn_schema(partition_id, cols)
            return BatchMeta(
                native.indexes.tolist(),
                [partition_id] * rows,
                schema,
                np.ones(rows, np.int8),
                native=native,
            )
        if metadata.native is None:
            raise ValueError("put(metadata=...) needs a BatchMeta from get_meta or put")
        if metadata.size != rows:
            raise ValueError(f"put: the TensorDict has {rows} rows, the metadata {metadata.size}")
        leased = metadata.native.lease_id is not None and not metadata.native.acked
        native = metadata.native
        await self.write_columns(
            lambda c: self._a.put(c, meta=native, ack=leased), cols, native.partition
        )
        schema = self.learn_schema(native.partition, cols)
        if metadata.custom_meta_loaded and any(metadata.custom_meta):
            await self._a.set_custom_meta(metadata.native.indexes, metadata.custom_meta)
        out = metadata.copy()
        out.field_schema.update(schema)
        out.production_status[:] = 1
        return out

    async def async_set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store the batch's per-row ``custom_meta`` (readable from any client)."""
        if metadata.custom_meta_loaded:  # (else the store holds them as they are)
            await self._a.set_custom_meta(metadata.global_indexes, metadata.custom_meta)

    # -- partitions --------------------------------------------------------------------------
    async def async_clear_partition(self, partition_id: str) -> None:
        await self._a.clear(partition_id)
        for key in [k for k in self._schemas if k[0] == partition_id]:
            del self._schemas[key]  # (a cleared partition forgets its specs)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        """Free the batch's rows (our ``retire_groups``: a row put through the facade is a
        group of its own). Rows that share a group with others (put by ``transferqueue``
        code with ``group=``) are refused, since retiring would free their group-mates."""
        native = metadata.native
        if native is None or len(native) == 0:
            return
        if not np.array_equal(native.groups, native.indexes):
            raise ValueError(
                "clear_samples: these rows belong to groups of several rows (written with "
                "group= by transferqueue code); free them with transferqueue's retire_groups"
            )
        await self._a.retire_groups(native.groups, native.partition)

    # -- keys --------------------------------------------------------------------------------
    async def async_kv_retrieve_meta(
        self, keys: list[str] | str, partition_id: str, create: bool = False
    ) -> BatchMeta:
        """The rows of ``keys`` (our ``kv_meta``), with the fields every row has. An unknown
        key is our ``UnknownKeyError`` (the peer's ``StorageKeyNotFoundError``);
        ``create=True`` (the peer's internal step of ``kv_batch_put``) is refused."""
        names = _check_names(keys, str, "keys", "string")
        if create:
            raise NotImplementedError(
                "kv_retrieve_meta(create=True) is not served by the transfer_queue facade: "
                "kv_batch_put creates the rows of new keys with their data"
            )
        native = await self._a.kv_meta(names, partition=partition_id)
        return await self._wrap(native, list(native.fields))

    async def async_kv_retrieve_keys(
        self, global_indexes: list[int] | int, partition_id: str
    ) -> list[str]:
        """The keys of rows, by global index (our ``kv_list`` of the partition); a row without
        a key is a ``RuntimeError`` naming it, as the peer's."""
        wanted = _check_names(global_indexes, int, "global_indexes", "int")
        listing = await self._a.kv_list(partition_id)
        key_of = dict(zip(listing.indexes.tolist(), listing.keys, strict=True))
        missing = [i for i in wanted if i not in key_of]
        if missing:
            raise RuntimeError(
                f"Some global_indexes have no corresponding keys! {missing[:10]} of partition "
                f"{partition_id!r} have none (put them with kv_put / kv_batch_put)"
            )
        return [key_of[i] for i in wanted]

    async def async_get_partition_list(self) -> list[str]:
        """Partitions holding rows (a cleared one is gone, as with the peer)."""
        parts = (await self._a.stats())["controller"]["partitions"]
        return [name for name, info in parts.items() if info.get("rows_live")]

    async def async_get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(global_indexes, consumed)``: every live row of the partition and whether
        ``task_name`` consumed it (1) or not (0)."""
        try:
            st = await self._a.status(partition_id, task=task_name)
        except transferqueue.UnknownTaskError:  # a task that never asked: nothing consumed
            st = await self._a.status(partition_id)
            return torch.from_numpy(st.indexes.copy()), torch.zeros(len(st), dtype=torch.int8)
        done = st.state_names()
        flags = torch.tensor([s == "done" for s in done], dtype=torch.int8)
        return torch.from_numpy(st.indexes.copy()), flags

    async def async_get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(global_indexes, produced)``: every live row and whether all ``data_fields``
        are written (1) or not (0); ``(None, None)`` for a partition or a field the store does
        not know (never written, or cleared), as the peer."""
        try:
            st = await self._a.status(partition_id, fields=_check_fields(data_fields))
        except transferqueue.UnknownFieldError:
            return None, None
        except ValueError:  # (our BadRequestError: an unknown partition is one)
            if partition_id in (await self._a.stats())["controller"]["partitions"]:
                raise
            return None, None
        ready = np.logical_and.reduce([st.ready[f] for f in data_fields]) if len(st) else []
        return torch.from_numpy(st.indexes.copy()), torch.as_tensor(ready, dtype=torch.int8)

    async def async_check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        _, flags = await self.async_get_consumption_status(task_name, partition_id)
        return flags is not None and flags.numel() > 0 and bool(flags.all())

    async def async_check_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> bool:
        _, flags = await self.async_get_production_status(data_fields, partition_id)
        return flags is not None and flags.numel() > 0 and bool(flags.all())

    async def async_reset_consumption(
        self, partition_id: str, task_name: str | None = None
    ) -> bool:
        """Hand the partition's rows to ``task_name`` (every task: None) once more."""
        if task_name is None:
            parts = (await self._a.stats())["controller"]["partitions"]
            tasks = list(parts.get(partition_id, {}).get("tasks", {}))
        else:
            tasks = [task_name]
        for task in tasks:
            await self._a.reset_consumption(task, partition_id)
        return True

    def close(self) -> None:
        """Nothing to do: the store belongs to ``tq.init``/``tq.close``."""


def _blocking(
    fn: Callable[..., Coroutine[Any, Any, T]],
) -> Callable[..., T]:
    @functools.wraps(fn)
    def call(self: TransferQueueClient, *args: Any, **kwargs: Any) -> T:
        return self._handle.run(fn(self, *args, **kwargs))

    call.__name__ = call.__qualname__ = fn.__name__.removeprefix("async_")
    return call


class TransferQueueClient(AsyncTransferQueueClient):
    """The peer's blocking client: each ``async_x`` call also as ``x``. ``get_meta`` makes
    the calls of our blocking client (its consumer calls go on the calling thread, without
    an event loop); the others run their ``async_x`` on our handle's I/O loop (safe from any
    thread but that loop's). A batch's ``custom_meta`` is read from the store when first
    used (the peer reads it in ``get_meta``: most batches never use it)."""

    def __init__(self, handle: transferqueue.TransferQueue, options: Options) -> None:
        super().__init__(handle, options)
        self._sync = handle.client()

    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int,
        partition_id: str,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
    ) -> BatchMeta:
        """The blocking ``async_get_meta``."""
        fields, task = _check_get_meta(data_fields, batch_size, mode, task_name)
        if mode == "force_fetch":
            return self.run(self._force_fetch(fields, partition_id))
        if mode == "insert":
            return self.run(self._insert(fields, partition_id, batch_size))
        if self.options.user_sampler is not None:
            return self.run(
                self._get_meta_sampled(
                    fields, batch_size, partition_id, task, sampling_config or {}
                )
            )
        sync = self._sync
        plan = self._get_meta_plan(fields, batch_size, partition_id, task, sampling_config)
        try:
            step = next(plan)
            while True:
                name, args, kwargs = step
                step = plan.send(getattr(sync, name)(*args, **kwargs))
        except StopIteration as done:
            native = done.value
        if isinstance(native, int):
            return self._short(task, fields, partition_id, batch_size, native)
        schema = self._known_schema(partition_id, fields)
        if schema is None:
            specs = sync.specs(partition_id)
            schema = self._known_schema(
                partition_id, fields, {n: s.describe() for n, s in specs.items()}
            )
        indexes = native.indexes
        return BatchMeta.of_native(native, schema, lambda: sync.get_custom_meta(indexes))

    get_data = _blocking(AsyncTransferQueueClient.async_get_data)
    put = _blocking(AsyncTransferQueueClient.async_put)
    ack = _blocking(AsyncTransferQueueClient.async_ack)
    set_custom_meta = _blocking(AsyncTransferQueueClient.async_set_custom_meta)
    clear_partition = _blocking(AsyncTransferQueueClient.async_clear_partition)
    kv_retrieve_meta = _blocking(AsyncTransferQueueClient.async_kv_retrieve_meta)
    kv_retrieve_keys = _blocking(AsyncTransferQueueClient.async_kv_retrieve_keys)
    clear_samples = _blocking(AsyncTransferQueueClient.async_clear_samples)
    get_partition_list = _blocking(AsyncTransferQueueClient.async_get_partition_list)
    get_consumption_status = _blocking(AsyncTransferQueueClient.async_get_consumption_status)
    get_production_status = _blocking(AsyncTransferQueueClient.async_get_production_status)
    check_consumption_status = _blocking(AsyncTransferQueueClient.async_check_consumption_status)
    check_production_status = _blocking(AsyncTransferQueueClient.async_check_production_status)
    reset_consumption = _blocking(AsyncTransferQueueClient.async_reset_consumption)

    @property
    def native_sync(self) -> transferqueue.Client:
        """Our blocking client under the facade (``save``/``load`` and other calls)."""
        return self._handle.client()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of the facade (the module-level KV calls) on our handle's loop."""
        return self._handle.run(coro)
