"""Weight transports: how the trainer's weights reach every generator host.

``make_transport(name, **options)`` gives a small picklable config; the trainer's rank 0 calls
``.sender()`` and publishes ``(state, version)``; each generator host calls
``.receiver(member)`` and loads ``get(version)`` at its own micro-batch boundary.

| name        | processes                  | how the bytes move                                   |
|-------------|----------------------------|------------------------------------------------------|
| `inprocess` | one                        | references to the trainer's ``state_dict()`` copy    |
| `shm`       | one host                   | one shared-memory file per version, mapped zero-copy |
| `broadcast` | any hosts                  | torch.distributed (gloo; NCCL for CUDA), bucketed    |
"""

from asyncflow.transport.base import (
    ReceiverFailedError,
    StateError,
    TransportClosedError,
    TransportError,
    TransportTimeoutError,
    VersionError,
    WeightReceiver,
    WeightSender,
    WeightTransport,
    make_transport,
    register_transport,
    transport_names,
)
from asyncflow.transport.broadcast import BroadcastTransport
from asyncflow.transport.inprocess import InProcessTransport
from asyncflow.transport.shm import ShmTransport

__all__ = [
    "BroadcastTransport",
    "InProcessTransport",
    "ReceiverFailedError",
    "ShmTransport",
    "StateError",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "VersionError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
    "make_transport",
    "register_transport",
    "transport_names",
]
