"""Under Ray, the facade's store is our Ray deployment, found by every worker by name.

The peer's ``init()`` on a Ray cluster starts its controller as the named actor
``TransferQueueController`` (namespace ``transfer_queue``); a later ``init()`` in any worker
finds it and only makes a client. Here the first ``init()`` starts our servers as Ray actors
(:func:`transferqueue.deploy.ray.start_on_ray`) and a small actor under the peer's name that
holds the merged config and the servers' address (``get_config()``, as the peer's has);
``init()`` in a worker reads it and connects (:func:`transferqueue.connect`). Data goes between
the workers and our storage actors over ZeroMQ, never through the driver.

Called by :func:`tqcompat.interface.init` when ``ray.is_initialized()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import transferqueue

__all__ = ["ACTOR_NAME", "NAMESPACE", "Directory", "RayStore", "ray_if_initialized"]

ACTOR_NAME = "TransferQueueController"
NAMESPACE = "transfer_queue"


class Directory:
    """The named actor's state: the config ``init`` merged and the servers' address. A plain
    class; ``ray.remote`` is applied at deployment. Of the peer controller's own calls it
    answers the two that code outside the peer uses to clean up (the peer's end-to-end tests
    call them between tests): ``list_partitions`` and ``clear_partition``, through a client
    of its own, made on first use."""

    def __init__(self, config: dict[str, Any], address: str) -> None:
        self._config = dict(config)
        self._address = address
        self._handle: transferqueue.TransferQueue | None = None

    def _client(self) -> transferqueue.Client:
        if self._handle is None:
            self._handle = transferqueue.connect(self._address)
        return self._handle.client()

    def list_partitions(self) -> list[str]:
        """The partitions holding rows (the facade's ``get_partition_list``)."""
        parts = self._client().stats()["controller"]["partitions"]
        return [name for name, info in parts.items() if info.get("rows_live")]

    def clear_partition(self, partition_id: str) -> None:
        """Drop the partition's rows (our ``clear``)."""
        self._client().clear(partition_id)

    def get_config(self) -> dict[str, Any]:
        """The merged config, as the peer's controller returns it."""
        return self._config

    def address(self) -> str:
        return self._address


@dataclass
class RayStore:
    """What ``init`` made or found on Ray: the handle, the config, and whether this process
    started the servers (then ``close`` stops them)."""

    handle: transferqueue.TransferQueue
    config: dict[str, Any]
    directory: Any = None  # the actor, when this process started it

    def close(self) -> None:
        self.handle.close()
        if self.directory is not None:
            import ray

            if ray.is_initialized():  # (else Ray ended it with this driver)
                ray.kill(self.directory)


def ray_if_initialized() -> Any:
    """The ``ray`` module when this process is connected to a Ray cluster, else None."""
    try:
        import ray
    except ImportError:
        return None
    return ray if ray.is_initialized() else None


def find_or_start(ray: Any, config: dict[str, Any], units: int, rows: int | None) -> RayStore:
    """Connect to the store a first ``init`` on this cluster started, or start it."""
    try:
        existing = ray.get_actor(ACTOR_NAME, namespace=NAMESPACE)
    except ValueError:
        existing = None
    if existing is not None:
        address = ray.get(existing.address.remote(), timeout=60)
        found = ray.get(existing.get_config.remote(), timeout=60)
        return RayStore(transferqueue.connect(address), found)
    from transferqueue.deploy.ray import start_on_ray

    handle = start_on_ray(num_units=units, capacity_rows=rows)
    if handle.address is None:
        handle.close()
        raise RuntimeError("the Ray deployment gave no address to share with other workers")
    # (the address goes into the config the actor hands out: a worker's DataLoader workers
    # connect by it)
    config = {**config, "asyncflow": {**config.get("asyncflow", {}), "address": handle.address}}
    actor_cls: Any = ray.remote(num_cpus=0)(Directory)
    try:
        directory = actor_cls.options(name=ACTOR_NAME, namespace=NAMESPACE).remote(
            config, handle.address
        )
        ray.get(directory.address.remote(), timeout=120)
    except BaseException:
        handle.close()
        raise
    return RayStore(handle, config, directory)
