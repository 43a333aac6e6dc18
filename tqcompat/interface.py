"""The peer's module-level API: ``init``/``close``/``get_client``, the KV calls and their
async twins, checkpoints.

``init(conf)`` reads the peer's config keys and starts our store in this process
(``transferqueue.start``):

| peer key                                   | here                                          |
|--------------------------------------------|-----------------------------------------------|
| ``controller.sampler``                     | our sampler (see :mod:`tqcompat.sampler`)     |
| ``controller.polling_mode``                | ``get_meta`` returns empty instead of waiting |
| ``backend.storage_backend: SimpleStorage`` | our storage units                             |
| ``backend.SimpleStorage.num_data_storage_units`` | ``num_units``                           |
| ``backend.SimpleStorage.total_storage_size`` | ``capacity_rows`` (rows held at once)       |
| other backends (Mooncake, Yuanrong, ...)   | refused: ``NotImplementedError`` at ``init``  |
| ``metrics.enabled``                        | ignored: ``get_metrics_endpoint()`` is None   |
| ``asyncflow.leases`` / ``asyncflow.lease_s`` | ours only: lease rows at ``get_meta``       |

Without Ray the store runs in this process (``transferqueue.start``). With Ray initialized
the store is our Ray deployment, found by every worker's ``init()`` under the peer's actor
name (:mod:`tqcompat.on_ray`).

KV calls (one or two of ours each): ``kv_put``/``kv_batch_put`` -> ``kv_batch_put`` then
``set_custom_meta`` for the tags; ``kv_batch_get`` -> ``kv_batch_get``; ``kv_list`` ->
``kv_list`` then ``get_custom_meta``; ``kv_clear`` -> ``kv_delete``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import transferqueue
from tqcompat.client import AsyncTransferQueueClient, Options, TransferQueueClient
from tqcompat.metadata import KVBatchMeta
from tqcompat.on_ray import find_or_start, ray_if_initialized
from tqcompat.sampler import resolve_sampler
from tqcompat.tensors import from_columns, to_columns

__all__ = [
    "REFUSED_BACKENDS",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "client_for",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
]

REFUSED_BACKENDS = {
    "MooncakeStore": "Mooncake's RDMA store",
    "Yuanrong": "Ascend's Yuanrong data system",
    "RayStore": "Ray's object store (Ray RDT)",
    "NIXL": "NIXL transfers",
}
"""Backends of the peer this store does not have: ``init`` names them and says what to use."""

_DEFAULTS: dict[str, Any] = {
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"num_data_storage_units": 2, "total_storage_size": None},
    },
    "metrics": {"enabled": False, "port": 0},
    "asyncflow": {"leases": False, "lease_s": 60.0, "address": None},
}

_client: TransferQueueClient | None = None
_close: Callable[[], None] | None = None
_pid = 0  # the process that made _client (a forked DataLoader worker must not use it)


def _plain(conf: Any) -> dict[str, Any]:
    if conf is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        pass
    else:
        if isinstance(conf, DictConfig):
            out = OmegaConf.to_container(conf, resolve=True)
            return {str(k): v for k, v in out.items()} if isinstance(out, dict) else {}
    if not isinstance(conf, Mapping):
        raise TypeError(f"init(conf) takes a dict or an OmegaConf DictConfig, got {conf!r}")
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in conf.items()}


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, a new dict at every level (an ``init`` that writes its
    store's address into the result never writes it into ``_DEFAULTS``, where a later store
    embedded in this process would find it)."""
    out = {k: _merge(v, {}) if isinstance(v, dict) else v for k, v in base.items()}
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _options(conf: dict[str, Any]) -> Options:
    backend = conf["backend"]
    name = backend.get("storage_backend", "SimpleStorage")
    if name != "SimpleStorage":
        what = REFUSED_BACKENDS.get(name, "a backend this store does not know")
        raise NotImplementedError(
            f"backend.storage_backend={name!r} ({what}) is not available over transferqueue: "
            "use backend.storage_backend='SimpleStorage' (our storage units, shared memory on "
            "one host, ZeroMQ across hosts)"
        )
    sampler, user_sampler, shared = resolve_sampler(conf["controller"].get("sampler"))
    ours = conf.get("asyncflow", {})
    return Options(
        polling_mode=bool(conf["controller"].get("polling_mode", False)),
        timeout_s=float(os.environ.get("TQ_CONTROLLER_GET_METADATA_TIMEOUT", 1)),
        leases=bool(ours.get("leases", False)),
        lease_s=float(ours.get("lease_s", 60.0)),
        sampler=sampler,
        user_sampler=user_sampler,
        shared=shared,
    )


def init(conf: Any = None) -> Any:
    """Start the store (first call; on Ray: first call on the cluster) and return the merged
    config; later calls reuse it and ignore ``conf``, as the peer's do. Refused backends and
    samplers raise ``NotImplementedError`` before anything starts."""
    global _client, _close, _pid
    if _client is not None and _pid == os.getpid():
        return conf
    merged = _merge(_DEFAULTS, _plain(conf))
    options = _options(merged)
    simple = merged["backend"].get("SimpleStorage", {})
    units = int(simple.get("num_data_storage_units") or 2)
    rows = int(simple["total_storage_size"]) if simple.get("total_storage_size") else None
    ray = ray_if_initialized()
    if ray is None:
        handle = transferqueue.start(num_units=units, capacity_rows=rows)
        _close = handle.close
    else:
        on_ray = find_or_start(ray, merged, units, rows)
        handle, _close = on_ray.handle, on_ray.close
        if on_ray.directory is None:  # joined: the first init's settings hold
            merged = _merge(_DEFAULTS, on_ray.config)
            options = _options(merged)
        merged["asyncflow"]["address"] = handle.address
    _client, _pid = TransferQueueClient(handle, options), os.getpid()
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return merged
    return OmegaConf.create(merged, flags={"allow_objects": True})


def close() -> None:
    """Close the store ``init`` started (its rows are gone), or this worker's connection to
    it; idempotent."""
    global _client, _close
    client, closer, _client, _close = _client, _close, None, None
    if client is not None:
        client.close()
    if closer is not None:
        closer()


def get_client() -> TransferQueueClient:
    """The process's client (``init`` first)."""
    if _client is None or _pid != os.getpid():
        raise RuntimeError("TransferQueue is not initialized: call transfer_queue.init() first")
    return _client


def client_for(config: Any) -> TransferQueueClient:
    """A client for code handed the config ``init`` returned (the streaming dataset): this
    process's own if it called ``init``, else one connected to the address in the config (a
    DataLoader worker process; needs the store to be a service: Ray or ``transferqueue
    serve``, not embedded in another process)."""
    if _client is not None and _pid == os.getpid():
        return _client
    conf = _merge(_DEFAULTS, _plain(config))
    return TransferQueueClient(transferqueue.connect(reachable_address(conf)), _options(conf))


def reachable_address(config: Any) -> str:
    """The store's address other processes connect to, from the config ``init`` returned;
    ``RuntimeError`` naming the fix when the store is embedded in the process that called
    ``init`` (no address to reach it by)."""
    address = _merge(_DEFAULTS, _plain(config))["asyncflow"].get("address")
    if not address:
        raise RuntimeError(
            "this process has no TransferQueue client and the config names no address: the "
            "store is embedded in the process that called init() (without Ray), so other "
            "processes (DataLoader workers: num_workers > 0) cannot reach it; use "
            "num_workers=0, or ray.init() before tq.init()"
        )
    return str(address)


def get_metrics_endpoint() -> str | None:
    """None: this store reports through ``client.stats()``, not Prometheus."""
    return None


def _async() -> AsyncTransferQueueClient:
    return get_client()


def _fields(select_fields: Sequence[str] | str | None) -> list[str] | None:
    if select_fields is None:
        return None
    return [select_fields] if isinstance(select_fields, str) else list(select_fields)


# -- the KV calls: async first, each blocking twin runs it on the client's loop ---------------
async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Write one row per key (new keys get rows; existing ones get the fields written) and
    set their tags, in one put of ours; tags without fields make keys that hold only tags
    (their fields come later), as the peer's."""
    a = _async().native
    if tags is not None and len(tags) != len(keys):
        raise ValueError(f"kv_batch_put: {len(keys)} keys but {len(tags)} tags; one per key")
    if fields is None and tags is None:
        raise ValueError("kv_batch_put needs fields=, tags= or both")
    cols: dict[str, Any] = {}
    if fields is not None:
        if data_parser is not None:
            fields = data_parser(fields)
        cols, rows = to_columns(fields)
        if rows != len(keys):
            raise ValueError(f"kv_batch_put: {len(keys)} keys but {rows} rows of fields")
    meta = await _async().write_columns(
        lambda c: a.kv_batch_put(keys, c, partition=partition_id, tags=tags), cols, partition_id
    )
    if cols:
        _async().learn_schema(partition_id, cols)
    # the peer returns every field the keys hold (this put's and earlier ones')
    names = list((await a.kv_meta(keys, partition=partition_id)).fields)
    out_tags = tags if tags is not None else await a.get_custom_meta(meta.indexes)
    return KVBatchMeta(list(keys), list(out_tags), partition_id, names)


async def async_kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """One key's row (a one-row TensorDict, or ``{field: value}`` of one row) and tag."""
    if fields is not None and isinstance(fields, Mapping) and not hasattr(fields, "batch_size"):
        td = from_columns({k: _one(v) for k, v in fields.items()}, 1)
        fields = td
    return await async_kv_batch_put(
        [key], partition_id, fields, None if tag is None else [tag], data_parser
    )


def _one(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.unsqueeze(0)
    return [value]


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """The keys' rows as a TensorDict (``select_fields``; None: the fields all have)."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    try:
        cols = await _async().native.kv_batch_get(
            keys, _fields(select_fields), partition=partition_id
        )
    except transferqueue.UnknownKeyError as e:
        raise KeysNotFoundError(f"keys or partition were not found: {e}") from e
    return from_columns(cols, len(keys))


async def async_kv_batch_get_by_meta(
    meta: KVBatchMeta, select_fields: list[str] | str | None = None
) -> Any:
    """``kv_batch_get`` of a ``KVBatchMeta``'s keys (its fields unless told others)."""
    if meta.partition_id is None:
        raise ValueError("kv_batch_get_by_meta needs a KVBatchMeta with a partition_id")
    fields = _fields(select_fields) if select_fields is not None else meta.fields
    if select_fields is not None and (
        meta.fields is None or any(f not in meta.fields for f in fields or ())
    ):
        raise ValueError(
            f"Some fields assigned in select_fields not found in the metadata. Assigned: "
            f"{fields}; Fields in KVBatchMeta: {meta.fields}"
        )
    return await async_kv_batch_get(meta.keys, meta.partition_id, fields)


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """``{partition: {key: tag}}`` of one partition, or of every partition with keys."""
    a = _async().native
    if partition_id is None:
        parts = (await a.stats())["controller"]["partitions"]
        names = [p for p, info in parts.items() if info.get("keys")]
    else:
        names = [partition_id]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        listing = await a.kv_list(name, tags=True)
        if partition_id is not None and not len(listing):
            continue  # the peer lists no partition without keys
        out[name] = dict(zip(listing.keys, listing.tags or [], strict=True))
    return out


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Delete the keys and free their rows."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    await _async().native.kv_delete(keys, partition=partition_id)


def kv_put(
    key: str,
    partition_id: str,
    fields: Any = None,
    tag: dict[str, Any] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Blocking :func:`async_kv_put`."""
    return get_client().run(async_kv_put(key, partition_id, fields, tag, data_parser))


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: Any = None,
    tags: list[dict[str, Any]] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Blocking :func:`async_kv_batch_put`."""
    return get_client().run(async_kv_batch_put(keys, partition_id, fields, tags, data_parser))


def kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> Any:
    """Blocking :func:`async_kv_batch_get`."""
    return get_client().run(async_kv_batch_get(keys, partition_id, select_fields))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> Any:
    """Blocking :func:`async_kv_batch_get_by_meta`."""
    return get_client().run(async_kv_batch_get_by_meta(meta, select_fields))


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, Any]]:
    """Blocking :func:`async_kv_list`."""
    return get_client().run(async_kv_list(partition_id))


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Blocking :func:`async_kv_clear`."""
    return get_client().run(async_kv_clear(keys, partition_id))


class KeysNotFoundError(transferqueue.UnknownKeyError, ValueError):
    """``kv_batch_get`` of keys the partition does not hold: our ``UnknownKeyError`` (the
    facade's ``StorageKeyNotFoundError``) and the peer's ``ValueError`` at once."""


# -- checkpoints -----------------------------------------------------------------------------
def save_checkpoint(
    checkpoint_dir: str | Path,
    *,
    include_storage: bool = True,
    metadata: dict[str, Any] | None = None,
) -> None:
    """Save every partition (rows and consumption state) to the new or empty directory
    ``checkpoint_dir`` (our ``save``). ``include_storage=False`` is refused: our save is a
    consistent snapshot of rows and state together."""
    if not include_storage:
        raise NotImplementedError(
            "save_checkpoint(include_storage=False) is not supported: the checkpoint holds "
            "rows and consumption state together"
        )
    get_client().native_sync.save(checkpoint_dir)
    if metadata:
        import json

        Path(checkpoint_dir, "tq_compat_metadata.json").write_text(json.dumps(metadata))


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Load a checkpoint saved by :func:`save_checkpoint` into the running store (our
    ``load``: a partition the store already has is refused)."""
    if not Path(checkpoint_dir).is_dir():  # the peer's type for a folder that is not there
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")
    get_client().native_sync.load(checkpoint_dir)
