"""Which weight transport a ``deploy=ray`` run uses, from where its hosts landed.

Decided by the driver once every stage host has a node and a device, from what the hosts
report (:class:`Where`), by one pure function so that every branch is tested without a
cluster:

| hosts                                      | ``auto`` picks | because                       |
|--------------------------------------------|----------------|-------------------------------|
| several nodes                              | ``broadcast``  | the one that crosses nodes    |
|                                            | (NCCL when the | (a GPU-to-GPU collective;     |
|                                            | trainer and    | gloo through host buckets     |
|                                            | every generator| otherwise)                    |
|                                            | are on CUDA)   |                               |
| one node, trainer on CUDA, every generator | ``ipc``        | no host copy: handles of the  |
| on CUDA and seeing the trainer's GPU       |                | trainer's device tensors      |
| one node, otherwise                        | ``shm``        | one shared file per version   |

A named transport is used as named (``ipc`` on hosts that cannot open the trainer's GPU
fails at the first publish, naming the fix).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Where", "choose_transport"]


@dataclass(frozen=True)
class Where:
    """Where one stage host runs: its node, its engine's device, the GPUs it sees."""

    node: str
    device: str = "cpu"
    """``cpu`` or ``cuda:N`` (as the process numbers its GPUs)."""
    gpu: str | None = None
    """The UUID of ``device`` when it is a GPU."""
    gpus: tuple[str, ...] = field(default_factory=tuple)
    """UUIDs of every GPU the process sees."""

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def choose_transport(
    choice: str, trainer: Where, generators: list[Where]
) -> tuple[str, dict[str, Any]]:
    """``(transport name, options)`` for ``deploy.weight_transport=choice`` (see the table).
    The broadcast options name the backend; the deployment adds the address."""
    nodes = {trainer.node, *(g.node for g in generators)}
    if choice == "auto":
        if len(nodes) > 1:
            choice = "broadcast"
        elif trainer.gpu is not None and all(g.cuda and trainer.gpu in g.gpus for g in generators):
            choice = "ipc"
        else:
            choice = "shm"
    if choice != "broadcast":
        return choice, {}
    nccl = trainer.cuda and all(g.cuda for g in generators)
    # keep_newest holds a host copy at the sender (gloo only): a restarted generator is then
    # served even when it is the only one; over NCCL a holder serves it, or the next publish
    return "broadcast", {"backend": "nccl" if nccl else "gloo", "keep_newest": not nccl}
