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

from transferqueue.client import AsyncClient
from transferqueue.embedded import start
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
    TQError,
    TQTimeoutError,
    UnknownArenaError,
    UnknownFieldError,
    UnknownKeyError,
    UnknownLeaseError,
    UnknownRowError,
    UnknownTaskError,
)
from transferqueue.handle import TransferQueue
from transferqueue.keys import KeyListing
from transferqueue.liveness import Liveness
from transferqueue.meta import BatchMeta
from transferqueue.ragged import Ragged
from transferqueue.remote import connect
from transferqueue.retire import LostRows, Retired
from transferqueue.samplers import Sampler, register_sampler
from transferqueue.schema import FieldSpec
from transferqueue.service import LocalService, serve
from transferqueue.status import PartitionStatus
from transferqueue.sync_client import Client

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
    "TQError",
    "TQTimeoutError",
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
