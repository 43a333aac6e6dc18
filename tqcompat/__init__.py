"""A ``transfer_queue``-compatible facade (TransferQueue 0.1.11's API) over ``transferqueue``.

Code written for ``import transfer_queue as tq`` runs on this store once the name is switched,
by an explicit opt-in (:mod:`tqcompat.alias`)::

    import tqcompat; tqcompat.install()
    import transfer_queue as tq
    tq.init()
    client = tq.get_client()

or ``python -m tqcompat script.py``. Every call translates onto ``transferqueue``'s public API
in one or two calls; where the semantics differ, the module that translates says so in its
table, and docs/transferqueue/compat.md has them all. This package imports ``transferqueue``;
nothing in ``transferqueue`` imports it.
"""

from tqcompat.alias import install, installed, uninstall
from tqcompat.client import AsyncTransferQueueClient, TransferQueueClient
from tqcompat.dataloader import StreamingDataLoader, StreamingDataset
from tqcompat.interface import (
    async_kv_batch_get,
    async_kv_batch_get_by_meta,
    async_kv_batch_put,
    async_kv_clear,
    async_kv_list,
    async_kv_put,
    close,
    get_client,
    get_metrics_endpoint,
    init,
    kv_batch_get,
    kv_batch_get_by_meta,
    kv_batch_put,
    kv_clear,
    kv_list,
    kv_put,
    load_checkpoint,
    save_checkpoint,
)
from tqcompat.metadata import BatchMeta, KVBatchMeta
from tqcompat.sampler import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)
from transferqueue import UnknownKeyError as StorageKeyNotFoundError

__version__ = "0.1.11"
"""The peer's API version this facade follows."""
__tq_compat__ = True

__all__ = [
    "AsyncTransferQueueClient",
    "BaseSampler",
    "BatchMeta",
    "GRPOGroupNSampler",
    "KVBatchMeta",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
    "SequentialSampler",
    "StorageKeyNotFoundError",
    "StreamingDataLoader",
    "StreamingDataset",
    "TransferQueueClient",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_batch_put",
    "async_kv_clear",
    "async_kv_list",
    "async_kv_put",
    "close",
    "get_client",
    "get_metrics_endpoint",
    "init",
    "install",
    "installed",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_batch_put",
    "kv_clear",
    "kv_list",
    "kv_put",
    "load_checkpoint",
    "save_checkpoint",
    "uninstall",
]
