"""``inprocess``: the trainer's state dict handed to generators in memory (one process).

The path of the single-process workflow: no bytes are copied beyond the trainer's own
``state_dict()`` (which :class:`~engines.protocols.TrainingEngine` defines as detached copies,
safe to keep across later steps). That is the one exception to the sender rule "do not rely
on ``state`` after publish returns": this sender keeps references to the published tensors,
so the trainer must publish a snapshot (``state_dict()``), never its live parameters.

Sender and receivers meet in a hub, a module-level object named by the transport config;
the config is picklable like the others, but a copy in another process finds no hub and
refuses (use ``shm`` or ``broadcast`` across processes).
"""

from __future__ import annotations

import os
import threading
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from asyncflow.transport.base import (
    SyncClock,
    SyncTimes,
    TransportClosedError,
    check_state,
    check_version,
    register_transport,
)
from asyncflow.transport.shelf import VersionShelf

__all__ = ["InProcessTransport"]

_HUBS: dict[str, _Hub] = {}
_HUBS_LOCK = threading.Lock()


class _Hub:
    """Newest version and the open ends of one in-process transport."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = -1
        self.state: Mapping[str, torch.Tensor] | None = None
        self.receivers: dict[str, InProcessReceiver] = {}
        self.senders = 0


def _hub(name: str) -> _Hub:
    with _HUBS_LOCK:
        return _HUBS.setdefault(name, _Hub())


def _forget_if_unused(name: str, hub: _Hub) -> None:
    with _HUBS_LOCK, hub.lock:
        if not hub.senders and not hub.receivers and _HUBS.get(name) is hub:
            del _HUBS[name]


@register_transport("inprocess")
@dataclass(frozen=True, kw_only=True)
class InProcessTransport:
    """Config of an in-process transport (sender and receivers in one process)."""

    name: ClassVar[str] = "inprocess"
    hub: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Names the hub where sender and receivers meet (unique per transport by default)."""
    pid: int = field(default_factory=os.getpid)
    """The process the transport works in (the one that made the config)."""

    def _check_process(self) -> None:
        if os.getpid() != self.pid:
            raise TransportClosedError(
                f"the inprocess weight transport works only in the process that made it "
                f"(pid {self.pid}), not in pid {os.getpid()}; use 'shm' (one host) or "
                "'broadcast' (several hosts) across processes"
            )

    def sender(self) -> InProcessSender:
        self._check_process()
        return InProcessSender(self.hub)

    def receiver(self, member: str) -> InProcessReceiver:
        self._check_process()
        return InProcessReceiver(self.hub, member)


class InProcessSender:
    """Hands each published state (references, no copy) to every receiver's shelf."""

    def __init__(self, hub_name: str) -> None:
        self._name = hub_name
        self._hub = _hub(hub_name)
        with self._hub.lock:
            self._hub.senders += 1
        self._closed = False
        self.last_sync: SyncTimes | None = None
        """Times of the newest publish (no bytes move: references are handed over)."""

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``state`` the newest version at once; every receiver can get it on return."""
        clock = SyncClock()
        if self._closed:
            raise TransportClosedError("the inprocess weight sender is closed")
        check_state(state)
        hub = self._hub
        with hub.lock:
            check_version(version, hub.version)
            # A read-only copy of the dict (not of the tensors): the caller may reuse its dict.
            frozen = types.MappingProxyType(dict(state))
            hub.version, hub.state = version, frozen
            receivers = list(hub.receivers.values())
        clock.sending()
        for receiver in receivers:
            receiver._shelf.offer(version, frozen)
        nbytes = sum(
            t.numel() * t.element_size() for t in {id(t): t for t in state.values()}.values()
        )
        self.last_sync = clock.done(version, nbytes)

    def members(self) -> list[str]:
        with self._hub.lock:
            return list(self._hub.receivers)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._hub.lock:
            self._hub.senders -= 1
        _forget_if_unused(self._name, self._hub)


class InProcessReceiver:
    """A shelf fed by the hub; a late receiver starts with the hub's newest version."""

    lookup_only = True
    """``get`` of a version :meth:`newest` has is a lookup (no copy, no wait): the follower
    calls it on its event loop instead of a worker thread."""

    def __init__(self, hub_name: str, member: str) -> None:
        self.member = member
        self._name = hub_name
        self._hub = _hub(hub_name)
        self._shelf = VersionShelf(member)
        with self._hub.lock:
            if member in self._hub.receivers:
                raise ValueError(f"receiver member {member!r} is already open on this transport")
            self._hub.receivers[member] = self
            if self._hub.state is not None:
                self._shelf.offer(self._hub.version, self._hub.state)

    def newest(self) -> int:
        return self._shelf.newest()

    def wait_newer(self, version: int, timeout_s: float) -> int:
        return self._shelf.wait_newer(version, timeout_s)

    def watch(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """``watcher()`` at each newer version (:meth:`VersionShelf.watch`)."""
        return self._shelf.watch(watcher)

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        return self._shelf.get(version)

    def release(self, version: int) -> None:
        self._shelf.release(version)

    def close(self) -> None:
        with self._hub.lock:
            if self._hub.receivers.get(self.member) is self:
                del self._hub.receivers[self.member]
        self._shelf.close()
        _forget_if_unused(self._name, self._hub)
