"""``ipc``: device-direct weights for generators on the trainer's node (CUDA IPC, no host copy).

The shape of vLLM's own ``ipc`` weight-transfer backend: the trainer hands each generator
*handles* of its CUDA tensors (:mod:`transferqueue.device.sharing`), a few hundred bytes per
tensor in the typed events of the control channel (:mod:`.control`, the ``ipc_*`` events of
:mod:`.messages`); the bytes never leave the GPU. Two ways:

| call                | the generator gets                         | trainer memory             |
|---------------------|--------------------------------------------|----------------------------|
| ``publish``         | the trainer's published tensors, mapped    | the published state, until |
|                     | (zero copy: ``get`` returns them)          | every generator let go     |
| ``publish_buckets`` | its own device copy, filled a bucket at a  | one bucket (FSDP: beyond   |
|                     | time (device-to-device from each bucket)   | its shard)                 |

``publish`` suits a trainer whose state fits twice on its GPU (the ``state_dict`` snapshot it
publishes is what generators read, until they load the next version); ``publish_buckets``
(through :func:`.base.publish_stream`) is how a sharded trainer publishes: each bucket is
exported, copied by every receiver into its own image of the version, acknowledged, and freed
before the next is gathered.

Memory at a receiver: ``publish``: none of its own (views of the trainer's memory, pinned by
the receiver until it releases them: torch's IPC reference counts free them after); buckets:
one device image per version it holds (the newest and the pinned ones, on its own GPU).

Newcomers (a restarted generator host): after ``publish`` the sender exports the newest state
to them at their JOIN (``ipc_share``). After ``publish_buckets`` it asks a receiver that holds
the newest version to export *its* image (``ipc_lend``); the holder's ``relay`` of it reaches
the newcomer through the sender (``ipc_image``), and the newcomer copies from it; with no such
holder, it gets the next version.

Acknowledgements are ``have`` / ``failed`` (of one bucket: with its ``bucket``).

Both processes must see the trainer's GPU (the same GPU, or ``CUDA_VISIBLE_DEVICES`` listing
it); otherwise opening a handle fails naming that, and the deployment picks ``shm`` or
``broadcast`` instead. ``sharer="file"`` runs the same protocol over shared files for host
tensors (machines without CUDA; the CPU tests of this transport).
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from asyncflow.transport import control
from asyncflow.transport import messages as m
from asyncflow.transport.base import (
    ReceiverFailedError,
    SyncClock,
    SyncTimes,
    TransportClosedError,
    check_state,
    check_version,
    register_transport,
)
from asyncflow.transport.control import ControlClient, ControlServer
from asyncflow.transport.shelf import VersionShelf
from asyncflow.transport.shm import _check_timing
from engines.weights_io import StateSpec, plan_specs, unpack_buffer
from transferqueue.device.sharing import Handle, TensorSharer, make_sharer

__all__ = ["IpcReceiver", "IpcSender", "IpcTransport"]

SHARERS = ("cuda", "file")
WHOLE = -1
"""The bucket of an acknowledgement of a whole version (``have`` without ``bucket``)."""


@register_transport("ipc")
@dataclass(frozen=True, kw_only=True)
class IpcTransport:
    """Config of the same-node device-direct transport (see the module doc)."""

    name: ClassVar[str] = "ipc"
    address: str = field(default_factory=control.unique_ipc_address)
    """The sender's control socket (ZeroMQ endpoint); unique per transport by default."""
    sharer: str = "cuda"
    """``cuda`` (CUDA IPC handles of device tensors) or ``file`` (host tensors through shared
    files: the same protocol without a GPU)."""
    timeout_s: float = 60.0
    """Bound of one publish's wait for acknowledgements (of each bucket, with buckets)."""
    heartbeat_s: float = 1.0
    dead_after_s: float = 10.0

    def __post_init__(self) -> None:
        _check_timing(self.timeout_s, self.heartbeat_s, self.dead_after_s)
        if self.sharer not in SHARERS:
            raise ValueError(f"sharer must be one of {SHARERS}, got {self.sharer!r}")

    def sender(self) -> IpcSender:
        return IpcSender(self)

    def receiver(self, member: str) -> IpcReceiver:
        return IpcReceiver(self, member)


def _unique(state: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[str, int]]]:
    """Each distinct tensor once (tied names share one) and ``(name, tensor index)`` for
    every name."""
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], int] = {}
    names: list[tuple[str, int]] = []
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.dtype)
        if not t.numel() or key not in seen:
            seen[key] = len(tensors)
            tensors.append(t.detach())
        names.append((name, seen[key]))
    return tensors, names


class _Pending:
    """The acknowledgements one step of a publish waits for (a version, or one bucket)."""

    def __init__(self, key: tuple[int, int], members: Iterable[str]) -> None:
        self.key = key
        self.acks: dict[str, str | None] = dict.fromkeys(members)

    def failures(self, timeout_s: float) -> dict[str, str]:
        late = f"no acknowledgement within timeout_s={timeout_s}"
        return {who: why or late for who, why in self.acks.items() if why != "ok"}


class IpcSender:
    """Exports each version's tensors to every receiver (see the module doc)."""

    def __init__(self, config: IpcTransport) -> None:
        self.config = config
        self._sharer: TensorSharer = make_sharer(config.sharer)
        self._cond = threading.Condition()
        self._publish_lock = threading.Lock()
        self._version = -1
        self._mapped: Mapping[str, torch.Tensor] | None = None  # publish: the newest state
        self._holders: list[str] = []  # publish_buckets: receivers holding the newest version
        self._pending: _Pending | None = None
        self._closed = False
        self.last_sync: SyncTimes | None = None
        """Times of the newest publish."""
        self._control = ControlServer(
            config.address,
            on_join=self._on_join,
            on_message=self._on_message,
            on_lost=self._on_lost,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name="ipc-weights-sender",
        )
        self._finalizer = weakref.finalize(self, self._control.close)
        self._control.start()

    # -- publish (the trainer's thread) ---------------------------------------------------

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Hand every receiver handles of ``state``'s tensors and wait (``timeout_s``) until
        each mapped them. ``state`` must be a snapshot (``state_dict()``'s copies), never
        live parameters: receivers read it until they load the next version."""
        clock = SyncClock()
        self._check_open()
        check_state(state)
        with self._publish_lock:
            with self._cond:
                check_version(version, self._version)
            tensors, names = _unique(state)
            clock.sending()

            def share(handles: list[Handle]) -> m.Event:
                return m.IpcShare(version=version, names=names, handles=handles)

            failures = self._round((version, WHOLE), share, tensors)
            with self._cond:
                self._version, self._mapped, self._holders = version, state, []
            self._sharer.collect()
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.last_sync = clock.done(version, nbytes)
        self._fail(version, failures)

    def publish_buckets(
        self,
        specs: Sequence[StateSpec],
        buckets: Iterable[Mapping[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Receivers copy each bucket into their own device image of ``version``; the sender
        holds one bucket at a time (see the module doc)."""
        clock = SyncClock()
        self._check_open()
        with self._publish_lock:
            with self._cond:
                check_version(version, self._version)
                targets = self._control.members()
            layout, offsets, nbytes = plan_specs(specs)
            begin = m.IpcBegin(
                version=version, layout=m.layout(layout), offsets=offsets, nbytes=nbytes
            )
            for member in targets:
                self._control.send(member, begin)
            index = {name: i for i, s in enumerate(specs) for name in s.names}
            failures: dict[str, str] = {}
            for b, bucket in enumerate(buckets):
                clock.sending()
                check_state(bucket)
                tensors, entries = _unique(bucket)
                unknown = [name for name, _ in entries if name not in index]
                if unknown:
                    raise ValueError(f"bucket {b} holds tensors the specs lack: {unknown[:3]}")
                slots = [(index[name], i) for name, i in entries]

                def copy(
                    handles: list[Handle], b: int = b, slots: list[tuple[int, int]] = slots
                ) -> m.Event:
                    return m.IpcBucket(version=version, bucket=b, slots=slots, handles=handles)

                live = [who for who in targets if who not in failures]
                failures.update(self._round((version, b), copy, tensors, live))
                del tensors, bucket  # the bucket may go: every receiver has copied it
            live = [who for who in targets if who not in failures]
            seal = m.IpcSeal(version=version)
            failures.update(self._round((version, WHOLE), lambda _: seal, [], live))
            with self._cond:
                self._version, self._mapped = version, None
                self._holders = [who for who in live if who not in failures]
            self._sharer.collect()
            self.last_sync = clock.done(version, nbytes)
        self._fail(version, failures)

    def _round(
        self,
        key: tuple[int, int],
        event: Callable[[list[Handle]], m.Event],
        tensors: list[torch.Tensor],
        targets: list[str] | None = None,
    ) -> dict[str, str]:
        """Send every target ``event(handles)`` with its own export of ``tensors`` (one
        handle per opener), wait for their acknowledgements of ``key``, retire the handles;
        the failed targets, with why."""
        with self._cond:
            members = self._control.members() if targets is None else targets
            pending = self._pending = _Pending(key, members)
        exports: list[Handle] = []
        try:
            for member in members:
                handles = [self._sharer.export(t) for t in tensors]
                exports += handles
                self._control.send(member, event(handles))
            deadline = time.monotonic() + self.config.timeout_s
            with self._cond:
                self._cond.wait_for(
                    lambda: all(v is not None for v in pending.acks.values()),
                    max(0.0, deadline - time.monotonic()),
                )
                self._pending = None
            return pending.failures(self.config.timeout_s)
        finally:
            for handle in exports:
                self._sharer.retire(handle)

    def _fail(self, version: int, failures: dict[str, str]) -> None:
        for member in failures:
            self._control.drop(member, f"version {version} failed")
        if failures:
            raise ReceiverFailedError(version, failures)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("the ipc weight sender is closed")
        self._control.check()

    def members(self) -> list[str]:
        return self._control.members()

    def close(self) -> None:
        """Close the control socket; idempotent (receivers keep what they mapped)."""
        self._closed = True
        self._mapped = None
        self._finalizer()

    # -- control callbacks (I/O thread) ---------------------------------------------------

    def _on_join(self, member: str, msg: m.Join) -> None:
        with self._cond:
            version, mapped = self._version, self._mapped
            holders = [h for h in self._holders if h != member]
        if mapped is not None:  # the newest published state, exported for this newcomer
            tensors, names = _unique(mapped)
            handles = [self._sharer.export(t) for t in tensors]
            share = m.IpcShare(version=version, names=names, handles=handles, retire=True)
            self._control.send(member, share)
        elif holders:  # a holder exports its image; its relay reaches the newcomer
            self._control.send(holders[0], m.IpcLend(version=version, to=member))

    def _on_message(self, member: str, msg: m.Have | m.Failed) -> None:
        key = (msg.version, WHOLE if msg.bucket is None else msg.bucket)
        have = isinstance(msg, m.Have)
        with self._cond:
            newcomer = have and key == (self._version, WHOLE)
            if newcomer and self._mapped is None and member not in self._holders:
                self._holders.append(member)  # a newcomer served by a holder
            pending = self._pending
            if pending is not None and pending.key == key and member in pending.acks:
                pending.acks[member] = "ok" if isinstance(msg, m.Have) else msg.reason
                self._cond.notify_all()

    def _on_lost(self, member: str, reason: str) -> None:
        with self._cond:
            if member in self._holders:
                self._holders.remove(member)
            pending = self._pending
            if pending is not None and pending.acks.get(member, "ok") is None:
                pending.acks[member] = f"lost: {reason}"
                self._cond.notify_all()


@dataclass
class _Incoming:
    """A version arriving a bucket at a time: its image, layout and each spec's offset."""

    version: int
    image: torch.Tensor
    layout: list[m.Entry]
    offsets: list[int]


class IpcReceiver:
    """Opens each version's handles as they arrive and keeps the tensors on its shelf."""

    def __init__(self, config: IpcTransport, member: str) -> None:
        self.member = member
        self._sharer: TensorSharer = make_sharer(config.sharer)
        if config.sharer == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._shelf = VersionShelf(member)
        self._incoming: _Incoming | None = None
        self.transfer_s: dict[int, float] = {}
        """Per version held: seconds from its first message to holding it here."""
        self._started: dict[int, float] = {}
        self._control = ControlClient(
            config.address,
            member,
            on_message=self._on_message,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name=f"ipc-weights-{member}",
        )
        self._finalizer = weakref.finalize(self, self._control.close)
        self._control.start()

    def newest(self) -> int:
        self._check()
        return self._shelf.newest()

    def wait_newer(self, version: int, timeout_s: float) -> int:
        self._check()
        return self._shelf.wait_newer(version, timeout_s)

    def watch(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """``watcher()`` at each newer version (:meth:`VersionShelf.watch`)."""
        return self._shelf.watch(watcher)

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        self._check()
        return self._shelf.get(version)

    def release(self, version: int) -> None:
        self._shelf.release(version)

    def close(self) -> None:
        self._finalizer()
        self._shelf.close()
        self._incoming = None

    def _check(self) -> None:
        if self._control.error is not None:
            self._shelf.fail(self._control.error)

    # -- the I/O thread ---------------------------------------------------------------------

    def _on_message(self, event: m.Event) -> None:
        if isinstance(event, m.Rejoin):  # a version arriving from that sender will not end
            self._incoming = None
            return
        if isinstance(event, m.IpcLend):
            with contextlib.suppress(Exception):  # else the newcomer gets the next version
                self._lend(event)
            return
        if not isinstance(event, m.IpcShare | m.IpcBegin | m.IpcBucket | m.IpcSeal | m.IpcImage):
            return
        version = event.version
        bucket = event.bucket if isinstance(event, m.IpcBucket) else None
        if isinstance(event, m.IpcShare | m.IpcBegin | m.IpcImage):
            self._started.setdefault(version, time.perf_counter())
        try:
            if isinstance(event, m.IpcShare):
                self._mapped(event)
            elif isinstance(event, m.IpcBegin):
                image = torch.empty(event.nbytes, dtype=torch.uint8, device=self.device)
                self._incoming = _Incoming(version, image, event.layout, event.offsets)
                return
            elif isinstance(event, m.IpcBucket):
                self._bucket(event)
            elif isinstance(event, m.IpcSeal):
                self._seal(version)
            else:
                self._image(event)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"[:4096]
            self._control.send(
                m.Failed(member=self.member, version=version, reason=why, bucket=bucket)
            )
            return
        finally:  # handles exported for this receiver alone: its to retire
            if isinstance(event, m.IpcShare) and event.retire:
                for handle in event.handles:
                    self._sharer.retire(handle)
            elif isinstance(event, m.IpcImage):
                self._sharer.retire(event.handle)
        self._control.send(m.Have(member=self.member, version=version, bucket=bucket))

    def _hold(self, version: int, state: Mapping[str, torch.Tensor], image: Any = None) -> None:
        if self._shelf.offer(version, types.MappingProxyType(dict(state)), image):
            self.transfer_s[version] = time.perf_counter() - self._started.pop(version, 0.0)
            for old in [v for v in self.transfer_s if v < version - 8]:
                del self.transfer_s[old]

    def _mapped(self, event: m.IpcShare) -> None:
        """``publish``: the sender's tensors, mapped."""
        tensors = [self._sharer.open(h) for h in event.handles]
        if event.version <= self._shelf.latest():
            # opened and dropped at once all the same: a CUDA handle's reference count is
            # given back when its opener frees it, and the sender's memory waits for that
            return
        self._hold(event.version, {name: tensors[i] for name, i in event.names})

    def _bucket(self, event: m.IpcBucket) -> None:
        incoming = self._incoming
        if incoming is None or incoming.version != event.version:
            raise RuntimeError(f"bucket of version {event.version} without its begin")
        tensors = [self._sharer.open(h) for h in event.handles]
        image = incoming.image
        for spec, i in event.slots:
            src = tensors[i]
            offset = incoming.offsets[spec]
            nbytes = src.numel() * src.element_size()
            if nbytes:
                dst = image[offset : offset + nbytes].view(src.dtype).view(src.shape)
                dst.copy_(src, non_blocking=True)
        _settle(image, *tensors)  # the copies are done before the handles go
        del tensors

    def _seal(self, version: int) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is None or incoming.version != version:
            raise RuntimeError(f"version {version} sealed that did not arrive whole")
        views = dict(unpack_buffer(incoming.image, incoming.layout, source="ipc image"))
        self._hold(version, views, (incoming.image, incoming.layout))

    def _lend(self, event: m.IpcLend) -> None:
        """A holder: export the newest image for a newcomer (relayed by the sender)."""
        held = self._shelf.extra(event.version)
        if not isinstance(held, tuple):
            raise RuntimeError(f"version {event.version} is not held here")
        image, layout = held
        handle = self._sharer.export(image)
        image_event = m.IpcImage(version=event.version, layout=layout, handle=handle)
        self._control.send(m.Relay(member=self.member, to=event.to, event=image_event))

    def _image(self, event: m.IpcImage) -> None:
        """A newcomer: copy a holder's image of the newest version into its own."""
        source = self._sharer.open(event.handle)
        if event.version <= self._shelf.latest():
            return  # (opened and dropped all the same, as in _mapped)
        image = torch.empty_like(source, device=self.device)
        image.copy_(source)
        _settle(image, source)
        del source
        views = dict(unpack_buffer(image, event.layout, source="ipc image"))
        self._hold(event.version, views, (image, event.layout))


def _settle(*tensors: torch.Tensor) -> None:
    """Wait for the work queued on every GPU these tensors live on (a copy between two GPUs
    runs on one device's stream, ordered against the other's)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
