"""Weights through Ray's object store: the transport that works on any cluster with no setup.

The trainer ``ray.put`` s the state dict once per version; the coordinator actor holds the
newest version's reference (so the object lives while a generator may still fetch it, and is
freed once a newer version replaces it); a generator host fetches it with ``ray.get``
(from its node's object store, pulled once per node). Slow next to shared memory or a
collective broadcast (0.15-0.27 GB/s on the reference machine) but it needs no port, no
rendezvous and survives any membership change: a restarted generator fetches the newest
version like any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncflow.transport.base import SyncClock, SyncTimes

__all__ = ["ObjectStoreWeights"]


@dataclass(frozen=True)
class ObjectStoreWeights:
    """Factory of both ends (picklable: it travels to every stage host)."""

    coordinator: str
    """The coordinator actor's name (it keeps the newest version's reference)."""
    timeout_s: float = 300.0
    name: str = "ray"

    def sender(self) -> _Sender:
        import ray

        return _Sender(ray.get_actor(self.coordinator), self.timeout_s)

    def receiver(self, member: str) -> _Receiver:
        import ray

        return _Receiver(ray.get_actor(self.coordinator), member, self.timeout_s)


class _Sender:
    def __init__(self, coordinator: Any, timeout_s: float) -> None:
        self._coord = coordinator
        self._timeout_s = timeout_s
        self._version = -1
        self.last_sync: SyncTimes | None = None
        """Times of the newest publish."""

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Put ``state`` in the object store; returns once the coordinator holds it."""
        import ray

        clock = SyncClock()
        if version <= self._version:
            raise ValueError(f"published version {version} is not newer than {self._version}")
        clock.sending()
        host = {k: v.detach().cpu() for k, v in state.items()}
        ref = ray.put(host)
        ray.get(self._coord.put_weights.remote(version, [ref]), timeout=self._timeout_s)
        self._version = version
        # the bytes reach a generator when it fetches them: the transfer counted here is the
        # put into the object store
        self.last_sync = clock.done(
            version, sum(t.numel() * t.element_size() for t in host.values())
        )

    def members(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


class _Receiver:
    def __init__(self, coordinator: Any, member: str, timeout_s: float) -> None:
        self._coord = coordinator
        self.member = member
        self._timeout_s = timeout_s
        self._newest = -1
        self._refs: list[Any] = []
        self._held: dict[int, Mapping[str, torch.Tensor]] = {}

    def newest(self) -> int:
        return self._newest

    def wait_newer(self, version: int, timeout_s: float) -> int:
        import ray

        newest, refs = ray.get(
            self._coord.weights_after.remote(version, timeout_s), timeout=timeout_s + 30.0
        )
        if newest > self._newest:
            self._newest, self._refs = int(newest), list(refs)
        return self._newest

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        import ray

        if version != self._newest:
            self.wait_newer(version - 1, 0.0)
        if version != self._newest:
            raise KeyError(f"weights version {version} is gone; newest: {self._newest}")
        try:
            state: Mapping[str, torch.Tensor] = ray.get(self._refs[0], timeout=self._timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"weights version {version} did not arrive from Ray's object store within "
                f"{self._timeout_s:g} s (ObjectStoreWeights.timeout_s): the node holding it "
                "may be unreachable or the object store full"
            ) from e
        self._held[version] = state
        return state

    def release(self, version: int) -> None:
        self._held.pop(version, None)

    def close(self) -> None:
        self._held.clear()
        self._refs = []
