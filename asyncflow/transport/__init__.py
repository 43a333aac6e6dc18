"""Weight transports: how the trainer's weights reach every generator host.

``make_transport(name, **options)`` gives a small picklable config; the trainer's rank 0 calls
``.sender()`` and publishes ``(state, version)``; each generator host calls
``.receiver(member)`` and loads ``get(version)`` at its own micro-batch boundary.

| name        | processes                  | how the bytes move                                   |
|-------------|----------------------------|------------------------------------------------------|
| `inprocess` | one                        | references to the trainer's ``state_dict()`` copy    |
| `shm`       | one host                   | one shared-memory file per version, mapped zero-copy |
| `broadcast` | any hosts                  | torch.distributed (gloo; NCCL for CUDA), bucketed    |
| `ipc`       | one node, GPUs seen by all | CUDA IPC handles of the trainer's device tensors     |
"""

from asyncflow.transport.base import (
    BucketSender,
    ReceiverFailedError,
    StateError,
    SyncTimes,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
    VersionError,
    WeightReceiver,
    WeightSender,
    WeightTransport,
    make_transport,
    publish_stream,
    register_transport,
    sync_metrics,
    transport_names,
)
from asyncflow.transport.broadcast import BroadcastTransport
from asyncflow.transport.inprocess import InProcessTransport
from asyncflow.transport.ipc import IpcTransport
from asyncflow.transport.shm import ShmTransport

__all__ = [
    "BroadcastTransport",
    "BucketSender",
    "InProcessTransport",
    "IpcTransport",
    "ReceiverFailedError",
    "ShmTransport",
    "StateError",
    "SyncTimes",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "VersionError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
    "make_transport",
    "publish_stream",
    "register_transport",
    "sync_metrics",
    "transport_names",
]
