"""The peer's ``BatchMeta`` and ``KVBatchMeta``, over our :class:`transferqueue.BatchMeta`.

A facade ``BatchMeta`` is the peer's columnar metadata (``global_indexes``, ``partition_ids``,
``field_schema``, ``production_status``, ``extra_info``, ``custom_meta``) plus, where it came
from our store, the native batch it names (``native``: row placement and, with leases, the
lease). Row operations (``select_samples``, ``reorder``, ``chunk``, ``concat``) apply to both,
so a chunk of a fetched batch is still readable with ``get_data``. A ``BatchMeta`` built by
hand (the metadata tutorial) has no native batch: it is metadata only.

| peer                     | here                                                         |
|--------------------------|--------------------------------------------------------------|
| ``production_status``    | int8 per row, 1 = every field written (``is_ready``)         |
| ``custom_meta``          | list of dicts, one per row; stored by ``set_custom_meta``    |
| ``union(other)``         | same rows, fields merged (other's schema wins); an empty     |
|                          | side gives a copy of the other                               |
| ``concat(batches)``      | rows appended; one partition, no lease (a read-only handle); |
|                          | ``extra_info`` merged, a key with two values a ``ValueError``|

Errors are the peer's exception types with its messages' words (its tests match them).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

import transferqueue

__all__ = ["BatchMeta", "KVBatchMeta"]

Native = transferqueue.BatchMeta


def _same(a: Any, b: Any) -> bool:
    """Two ``extra_info`` values are equal (tensors and arrays by content, as the peer)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # a value without a truth value (an array-like) is not equal
        return False


def _merge_extra(infos: Sequence[dict[str, Any] | None], who: str) -> dict[str, Any]:
    """The chunks' ``extra_info`` in one dict: the union of keys, a key with two different
    values a ``ValueError`` naming it (the peer's rule for ``concat``)."""
    out: dict[str, Any] = {}
    for i, info in enumerate(infos):
        for key, value in (info or {}).items():
            if key in out and not _same(out[key], value):
                raise ValueError(
                    f"{who}.concat: extra_info key '{key}' has conflicting values across "
                    f"chunks and cannot be merged: chunk[0]={out[key]!r}, chunk[{i}]={value!r}"
                )
            out.setdefault(key, value)
    return out


def _take(native: Native | None, positions: Sequence[int]) -> Native | None:
    return None if native is None else native.select(list(positions))


def _concat_native(parts: Sequence[Native | None]) -> Native | None:
    if not parts or any(p is None for p in parts):
        return None
    natives = [p for p in parts if p is not None]
    if len({n.partition for n in natives}) != 1:
        return None

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(n, name) for n in natives])

    return Native(
        cat("indexes"),
        cat("units"),
        cat("groups"),
        cat("versions"),
        cat("lengths"),
        partition=natives[0].partition,
        fields=natives[0].fields,
    )


class _SampleView:
    """Read-only view of one row (``batch.samples[i]``)."""

    __slots__ = ("_batch", "_i")

    def __init__(self, batch: BatchMeta, i: int) -> None:
        self._batch, self._i = batch, i

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._i]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._i]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._i])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._i])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        out: dict[str, MappingProxyType[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            row = {k: v for k, v in meta.items() if k != "per_sample_shapes"}
            if meta.get("per_sample_shapes") is not None:
                row["shape"] = meta["per_sample_shapes"][self._i]
            out[name] = MappingProxyType(row)
        return MappingProxyType(out)

    def __repr__(self) -> str:
        return (
            f"_SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
            f"production_status={self.production_status}, "
            f"fields={list(self._batch.field_schema)})"
        )


class _Samples:
    __slots__ = ("_batch",)

    def __init__(self, batch: BatchMeta) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return len(self._batch)

    def __getitem__(self, i: int) -> _SampleView:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for a batch of {len(self)}")
        return _SampleView(self._batch, i % len(self))

    def __iter__(self) -> Any:
        return (_SampleView(self._batch, i) for i in range(len(self)))


class BatchMeta:
    """The peer's batch metadata (see the module). Made by ``get_meta`` and ``put``, or by
    hand: ``BatchMeta(global_indexes=[...], partition_ids=[...], field_schema={...})``."""

    def __init__(
        self,
        global_indexes: Sequence[int],
        partition_ids: Sequence[str],
        field_schema: dict[str, dict[str, Any]] | None = None,
        production_status: np.ndarray | Sequence[int] | None = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: Sequence[dict[str, Any]] | None = None,
        *,
        native: Native | None = None,
        custom_meta_loader: Callable[[], Sequence[dict[str, Any]]] | None = None,
    ) -> None:
        """``custom_meta_loader``: where ``custom_meta`` is not given, reads it from the store
        on first use (a batch of the blocking ``get_meta``: most batches never read it)."""
        self.global_indexes = [int(i) for i in global_indexes]
        self.partition_ids = list(partition_ids)
        n = len(self.global_indexes)
        if len(self.partition_ids) != n:
            raise ValueError(
                f"Length mismatch: global_indexes has {n}, partition_ids has "
                f"{len(self.partition_ids)}"
            )
        self.field_schema = {k: dict(v) for k, v in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None and len(shapes) != n:
                raise ValueError(
                    f"Field '{name}' per_sample_shapes length {len(shapes)} != batch_size {n}"
                )
        status = np.zeros(n, np.int8) if production_status is None else production_status
        self.production_status = np.array(status, dtype=np.int8, copy=True)
        if self.production_status.shape != (n,):
            raise ValueError(f"production_status length {self.production_status.size} != {n}")
        self.extra_info: dict[str, Any] = dict(extra_info or {})
        self._load: Callable[[], Sequence[dict[str, Any]]] | None = None
        self._custom: list[dict[str, Any]] | None = None
        if custom_meta_loader is not None and not custom_meta and n:
            self._load = custom_meta_loader
        else:
            self.custom_meta = [dict(d) for d in custom_meta or ()] or [{} for _ in range(n)]
        if native is not None and len(native) != n:
            raise ValueError(f"native batch has {len(native)} rows, expected {n}")
        self.native = native

    @classmethod
    def of_native(
        cls,
        native: Native,
        field_schema: dict[str, dict[str, Any]],
        custom_meta_loader: Callable[[], Sequence[dict[str, Any]]] | None = None,
    ) -> BatchMeta:
        """The batch of our rows ``native`` (what ``get_meta`` hands out), every row ready:
        the same object ``__init__`` makes, without its checks and copies, which hold by
        construction here (one partition, one index per row, no per-row shapes).
        ``field_schema`` is taken as it is: the caller passes dicts of its own. Called once
        per ``get_meta``, whose cost is mostly this and the round trip."""
        n = len(native)
        self = cls.__new__(cls)
        self.global_indexes = native.indexes.tolist()
        self.partition_ids = [native.partition] * n
        self.field_schema = field_schema
        self.production_status = np.ones(n, np.int8)
        self.extra_info = {}
        if custom_meta_loader is not None and n:
            self._load, self._custom = custom_meta_loader, None
        else:
            self._load, self._custom = None, [{} for _ in range(n)]
        self.native = native
        return self

    @property
    def custom_meta(self) -> list[dict[str, Any]]:
        """One dict per row (read from the store on first use where the batch was made with
        a loader: a row freed since is the store's ``UnknownRowError``)."""
        if self._custom is None:
            load, self._load = self._load, None
            self.custom_meta = [dict(d) for d in load()] if load is not None else []
        assert self._custom is not None
        return self._custom

    @custom_meta.setter
    def custom_meta(self, value: list[dict[str, Any]]) -> None:
        if len(value) != self.size:
            raise ValueError(f"custom_meta length {len(value)} != batch_size {self.size}")
        self._custom, self._load = value, None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a DataLoader worker's batch on its way to the main process) with its
        ``custom_meta`` read: a loader does not travel."""
        state = dict(self.__dict__)
        state["_custom"], state["_load"] = self.custom_meta, None
        return state

    @property
    def custom_meta_loaded(self) -> bool:
        """False while ``custom_meta`` is still only in the store (never read or changed
        here: writing it back would change nothing)."""
        return self._custom is not None

    # -- shape -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.global_indexes)

    def __len__(self) -> int:
        return self.size

    @property
    def field_names(self) -> list[str]:
        return sorted(self.field_schema)

    @property
    def samples(self) -> _Samples:
        return _Samples(self)

    @property
    def is_ready(self) -> bool:
        return self.size > 0 and bool(np.all(self.production_status == 1))

    def get_dtypes(self, field_name: str) -> list[Any]:
        return [self._schema(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        meta = self._schema(field_name)
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    def _schema(self, field_name: str) -> dict[str, Any]:
        if field_name not in self.field_schema:
            raise KeyError(f"Field '{field_name}' not found in field_schema")
        return self.field_schema[field_name]

    # -- batch- and row-level extras ---------------------------------------------------------
    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[dict[str, Any]]) -> None:
        if len(custom_meta) != self.size:
            raise ValueError(
                f"custom_meta length {len(custom_meta)} != batch_size {self.size}; one per row"
            )
        for row, new in zip(self.custom_meta, custom_meta, strict=True):
            row.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # -- fields ------------------------------------------------------------------------------
    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> BatchMeta:
        """Add the TensorDict's fields to the schema (all rows ready unless told not)."""
        from tqcompat.tensors import schema_of, to_columns

        cols, rows = to_columns(tensor_dict)
        if rows != self.size:
            raise ValueError(f"add_fields: the TensorDict has {rows} rows, the batch {self.size}")
        self.field_schema.update(schema_of(cols))
        if set_all_ready:
            self.production_status[:] = 1
        return self

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        missing = [f for f in field_names if f not in self.field_schema]
        if missing:
            raise KeyError(f"fields {missing} not in this batch's fields {self.field_names}")
        out = self._rows(range(self.size))
        out.field_schema = {k: dict(self.field_schema[k]) for k in field_names}
        return out

    # -- rows --------------------------------------------------------------------------------
    def _rows(self, positions: Sequence[int]) -> BatchMeta:
        pos = list(positions)
        schema = {}
        for name, meta in self.field_schema.items():
            meta = dict(meta)
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][p] for p in pos]
            schema[name] = meta

        def custom() -> list[dict[str, Any]]:
            return [copy.deepcopy(self.custom_meta[p]) for p in pos]

        lazy = not self.custom_meta_loaded
        return BatchMeta(
            [self.global_indexes[p] for p in pos],
            [self.partition_ids[p] for p in pos],
            schema,
            self.production_status[pos],
            copy.deepcopy(self.extra_info),
            None if lazy else custom(),
            native=_take(self.native, pos),
            custom_meta_loader=custom if lazy else None,  # (a part reads the whole on use)
        )

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        bad = [i for i in sample_indices if not 0 <= i < self.size]
        if bad:
            raise IndexError(f"select_samples: positions {bad} out of range 0..{self.size - 1}")
        return self._rows(sample_indices)

    def copy(self) -> BatchMeta:
        return self._rows(range(self.size))

    def __getitem__(self, item: int | slice) -> BatchMeta:
        if isinstance(item, int):
            return self.select_samples([item % self.size if item < 0 else item])
        return self._rows(range(self.size)[item])

    def reorder(self, indices: Sequence[int]) -> None:
        """Reorder the rows in place (``indices``: a permutation of positions)."""
        if len(indices) != self.size:
            raise ValueError(f"Indices length {len(indices)} mismatch batch size {self.size}")
        if len(set(indices)) != self.size:
            raise ValueError(f"Indices contain duplicates: {list(indices)}")
        if any(not 0 <= i < self.size for i in indices):
            raise ValueError(f"Reorder indices must be in range [0, {self.size}), got {indices}")
        other = self._rows(indices)
        for slot in vars(other):
            setattr(self, slot, getattr(other, slot))

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` consecutive parts, the first ones one row longer where it does not
        divide (the peer's split)."""
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(self._rows(range(start, stop)))
            start = stop
        return out

    def chunk_by_partition(self) -> list[BatchMeta]:
        order: dict[str, list[int]] = {}
        for i, p in enumerate(self.partition_ids):
            order.setdefault(p, []).append(i)
        return [self._rows(pos) for pos in order.values()]

    def union(self, other: BatchMeta) -> BatchMeta:
        """The same rows with both batches' fields (``other``'s schema wins on a clash); a
        copy of the other side where one is empty."""
        if not other or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        for name in ("global_indexes", "partition_ids"):
            if getattr(self, name) != getattr(other, name):
                raise ValueError(
                    f"BatchMeta.union: {name} do not match (the same rows in the same order): "
                    f"{getattr(self, name)} vs {getattr(other, name)}"
                )
        out = self.copy()
        out.field_schema.update({k: dict(v) for k, v in other.field_schema.items()})
        out.production_status = np.minimum(self.production_status, other.production_status)
        out.extra_info.update(other.extra_info)
        for row, extra in zip(out.custom_meta, other.custom_meta, strict=True):
            row.update(extra)
        return out

    @classmethod
    def concat(cls, data: Sequence[BatchMeta], validate: bool = True) -> BatchMeta:
        """Rows of every batch, in order (same fields in each when ``validate``)."""
        parts = [d for d in data if d.size]
        if not parts:
            return cls.empty()
        for i, p in enumerate(parts if validate else ()):
            if p.field_names != parts[0].field_names:
                raise ValueError(
                    f"BatchMeta.concat: field_names mismatch at chunk[{i}]: expected "
                    f"{parts[0].field_names}, got {p.field_names}"
                )
            for name in p.field_names:
                want, got = (
                    parts[0].field_schema[name].get("dtype"),
                    p.field_schema[name].get("dtype"),
                )
                if got != want:
                    raise ValueError(
                        f"Field '{name}' dtype mismatch in concat: chunk[0]={want}, "
                        f"chunk[{i}]={got}"
                    )
        schema = {k: dict(v) for k, v in parts[0].field_schema.items()}
        for name, meta in schema.items():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [
                    s for p in parts for s in p.field_schema[name].get("per_sample_shapes") or []
                ]
        extra = _merge_extra([p.extra_info for p in parts], "BatchMeta")
        return cls(
            [i for p in parts for i in p.global_indexes],
            [i for p in parts for i in p.partition_ids],
            schema,
            np.concatenate([p.production_status for p in parts]),
            extra,
            [copy.deepcopy(c) for p in parts for c in p.custom_meta],
            native=_concat_native([p.native for p in parts]),
        )

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        return cls([], [], extra_info=extra_info)

    def __str__(self) -> str:
        return (
            f"BatchMeta(size={self.size}, field_names={self.field_names}, "
            f"is_ready={self.is_ready}, global_indexes={self.global_indexes}, "
            f"extra_info={self.extra_info})"
        )

    __repr__ = __str__


@dataclasses.dataclass
class KVBatchMeta:
    """The peer's key-value batch handle: keys, their tags, partition and fields."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(
                f"keys and tags must have same length, but got {len(self.keys)} and "
                f"{len(self.tags)}"
            )
        if len(self.keys) != len(set(self.keys)):
            raise ValueError("Got duplicated keys.")
        if self.fields is not None and len(self.fields) != len(set(self.fields)):
            raise ValueError("Got duplicated fields.")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return (
            f"KVBatchMeta(size={self.size}, field_names={self.fields}, "
            f"extra_info={self.extra_info})"
        )

    def _rows(self, pos: Sequence[int]) -> KVBatchMeta:
        return KVBatchMeta(
            [self.keys[p] for p in pos],
            [self.tags[p] for p in pos],
            self.partition_id,
            self.fields,
            self.extra_info,
        )

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        if len(set(keys_to_select)) != len(keys_to_select):
            raise ValueError(f"Contain duplicate keys: {list(keys_to_select)}")
        where = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in where]
        if missing:
            raise RuntimeError(f"Keys {missing} not found in current batch.")
        return self._rows([where[k] for k in keys_to_select])

    def reorder(self, indexes: Sequence[int]) -> None:
        if len(indexes) != self.size:
            raise ValueError(
                f"Attempted to reorder with indexes length {len(indexes)} that does not match "
                f"the batch size {self.size}."
            )
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"Contain duplicate indexes: {list(indexes)}")
        other = self._rows(indexes)
        self.keys, self.tags = other.keys, other.tags

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            stop = start + base + (1 if i < extra else 0)
            out.append(self._rows(range(start, stop)))
            start = stop
        return out

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta]) -> KVBatchMeta:
        data = [d for d in data if d and d.size]
        if not data:
            return cls()
        for d in data:
            if d.fields is not None and set(d.fields) != set(data[0].fields or ()):
                raise ValueError(
                    f"Field names do not match for concatenation: {data[0].fields} vs {d.fields}"
                )
            if d.partition_id != data[0].partition_id:
                raise ValueError(
                    f"Partition do not match for concatenation: {data[0].partition_id!r} vs "
                    f"{d.partition_id!r}"
                )
        extra = _merge_extra([d.extra_info for d in data], "KVBatchMeta")
        return cls(
            [k for d in data for k in d.keys],
            [t for d in data for t in d.tags],
            data[0].partition_id,
            data[0].fields,
            extra or None,
        )
