"""TransferQueue: a distributed columnar store for streaming data between engines.

Producers ``put`` columns of rows; consumer tasks lease batches of rows whose fields are ready
(``get_meta``), read the columns they need (``get_data``) and acknowledge them (``ack``, or a
``put`` of their results). Each row reaches each task exactly once, even when consumers crash.

    import transferqueue
    tq = transferqueue.start(num_units=2)
    client = tq.client()
    client.put({"prompt": [torch.tensor([1, 2, 3])], "answer": ["7"]}, group=0)
    meta = client.get_meta(task="rollout", fields=["prompt"], batch_size=1)
    cols = client.get_data(meta)
"""

from typing import TYPE_CHECKING

from transferqueue.errors import (
    AuthError,
    CapacityError,
    CheckpointError,
    ClosedError,
    DeniedError,
    FinishedError,
    KeyLeasedError,
    LeaseExpiredError,
    PartitionExistsError,
    PeerGoneError,
    ProtocolError,
    RowsLostError,
    SchemaError,
    TooManyConnectionsError,
    TQError,
    TQTimeoutError,
    UnknownArenaError,
    UnknownFieldError,
    UnknownKeyError,
    UnknownLeaseError,
    UnknownRowError,
    UnknownTaskError,
)
from transferqueue.lazy import lazy_names

if TYPE_CHECKING:
    from transferqueue.client.async_client import AsyncClient
    from transferqueue.client.handle import TransferQueue
    from transferqueue.client.sync_client import Client
    from transferqueue.controller.samplers import Sampler, register_sampler
    from transferqueue.deploy.connect import connect
    from transferqueue.deploy.embedded import start
    from transferqueue.deploy.service import LocalService, serve
    from transferqueue.meta import BatchMeta
    from transferqueue.ragged import Ragged
    from transferqueue.schema import FieldSpec
    from transferqueue.shaped import Shaped
    from transferqueue.wire.liveness import Liveness
    from transferqueue.wire.replies import KeyListing, LostRows, PartitionStatus, Retired

_LAZY = {
    "AsyncClient": "transferqueue.client.async_client",
    "TransferQueue": "transferqueue.client.handle",
    "Client": "transferqueue.client.sync_client",
    "Sampler": "transferqueue.controller.samplers",
    "register_sampler": "transferqueue.controller.samplers",
    "connect": "transferqueue.deploy.connect",
    "start": "transferqueue.deploy.embedded",
    "LocalService": "transferqueue.deploy.service",
    "serve": "transferqueue.deploy.service",
    "BatchMeta": "transferqueue.meta",
    "Ragged": "transferqueue.ragged",
    "Shaped": "transferqueue.shaped",
    "FieldSpec": "transferqueue.schema",
    "Liveness": "transferqueue.wire.liveness",
    "KeyListing": "transferqueue.wire.replies",
    "LostRows": "transferqueue.wire.replies",
    "PartitionStatus": "transferqueue.wire.replies",
    "Retired": "transferqueue.wire.replies",
}
"""Public names imported on first use (PEP 562): a process that needs one part of the package
(a controller, a unit, a helper such as :mod:`transferqueue.aio`) does not pay for the client's
imports (torch among them), which is seconds of CPU per Ray actor on a small machine."""


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "AsyncClient",
    "AuthError",
    "BatchMeta",
    "CapacityError",
    "CheckpointError",
    "Client",
    "ClosedError",
    "DeniedError",
    "FieldSpec",
    "FinishedError",
    "KeyLeasedError",
    "KeyListing",
    "LeaseExpiredError",
    "Liveness",
    "LocalService",
    "LostRows",
    "PartitionExistsError",
    "PartitionStatus",
    "PeerGoneError",
    "ProtocolError",
    "Ragged",
    "Retired",
    "RowsLostError",
    "Sampler",
    "SchemaError",
    "Shaped",
    "TQError",
    "TQTimeoutError",
    "TooManyConnectionsError",
    "TransferQueue",
    "UnknownArenaError",
    "UnknownFieldError",
    "UnknownKeyError",
    "UnknownLeaseError",
    "UnknownRowError",
    "UnknownTaskError",
    "connect",
    "register_sampler",
    "serve",
    "start",
]
