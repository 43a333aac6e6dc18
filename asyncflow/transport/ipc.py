"""``ipc``: device-direct weights for generators on the trainer's node (CUDA IPC, no host copy).

The shape of vLLM's own ``ipc`` weight-transfer backend: the trainer hands each generator
*handles* of its CUDA tensors (:mod:`transferqueue.device.sharing`), a few hundred bytes per
tensor over the control channel (:mod:`.control`); the bytes never leave the GPU. Two ways:

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
to them at their JOIN. After ``publish_buckets`` it asks a receiver that holds the newest
version to export *its* image, and the newcomer copies from it; with no such holder, it gets
the next version.

Both processes must see the trainer's GPU (the same GPU, or ``CUDA_VISIBLE_DEVICES`` listing
it); otherwise opening a handle fails naming that, and the deployment picks ``shm`` or
``broadcast`` instead. ``sharer="file"`` runs the same protocol over shared files for host
tensors (machines without CUDA; the CPU tests of this transport).
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from asyncflow.transport import control
from asyncflow.transport.base import (
    ReceiverFailedError,
    SyncClock,
    SyncTimes,
    TransportClosedError,
    check_state,
    check_version,
    register_transport,
)
from asyncflow.transport.control import ControlClient, ControlServer, Message
from asyncflow.transport.shelf import VersionShelf
from asyncflow.transport.shm import _check_timing
from engines.weights_io import StateSpec, plan_specs, unpack_buffer
from transferqueue.device.sharing import Handle, TensorSharer, make_sharer

__all__ = ["IpcReceiver", "IpcSender", "IpcTransport"]

SHARERS = ("cuda", "file")


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


def _unique(state: Mapping[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[list[Any]]]:
    """Each distinct tensor once (tied names share one) and the layout that names them:
    ``[name, tensor index]`` entries."""
    tensors: list[torch.Tensor] = []
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], int] = {}
    layout: list[list[Any]] = []
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape), t.dtype)
        if not t.numel() or key not in seen:
            seen[key] = len(tensors)
            tensors.append(t.detach())
        layout.append([name, seen[key]])
    return tensors, layout


class _Pending:
    """The acknowledgements one step of a publish waits for (a version, or one bucket)."""

    def __init__(self, key: tuple[int, int], members: Iterable[str]) -> None:
        self.key = key
        self.acks: dict[str, str | None] = dict.fromkeys(members)

    def failures(self, timeout_s: float) -> dict[str, str]:
        late = f"no acknowledgement within timeout_s={timeout_s}"
        return {m: why or late for m, why in self.acks.items() if why != "ok"}


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
        self._exports: list[Handle] = []  # handles not yet retired
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
            tensors, layout = _unique(state)
            clock.sending()
            failures = self._round(
                (version, -1),
                lambda _: {"kind": control.TICKET, "version": version},
                tensors,
                layout,
            )
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
            begin = {
                "kind": control.BEGIN,
                "version": version,
                "layout": layout,
                "offsets": offsets,
                "nbytes": nbytes,
            }
            for member in targets:
                self._control.send(member, begin)
            index = {name: i for i, s in enumerate(specs) for name in s.names}
            failures: dict[str, str] = {}
            for b, bucket in enumerate(buckets):
                clock.sending()
                check_state(bucket)
                tensors, entries = _unique(bucket)
                slots = [[index[name], i] for name, i in entries if name in index]
                unknown = [name for name, _ in entries if name not in index]
                if unknown:
                    raise ValueError(f"bucket {b} holds tensors the specs lack: {unknown[:3]}")

                def message(_: str, b: int = b) -> Message:
                    return {"kind": control.BUCKET, "version": version, "bucket": b}

                live = [m for m in targets if m not in failures]
                failures.update(self._round((version, b), message, tensors, slots, live))
                del tensors, bucket  # the bucket may go: every receiver has copied it
            live = [m for m in targets if m not in failures]
            commit = lambda _: {"kind": control.COMMIT, "version": version}  # noqa: E731
            failures.update(self._round((version, -1), commit, [], [], live))
            with self._cond:
                self._version, self._mapped = version, None
                self._holders = [m for m in live if m not in failures]
            self._sharer.collect()
            self.last_sync = clock.done(version, nbytes)
        self._fail(version, failures)

    def _round(
        self,
        key: tuple[int, int],
        message: Any,
        tensors: list[torch.Tensor],
        layout: list[list[Any]],
        targets: list[str] | None = None,
    ) -> dict[str, str]:
        """Send every target ``message(member)`` with its own export of ``tensors`` (one
        handle per opener) and ``layout``, wait for their acknowledgements of ``key``, retire
        the handles; the failed targets, with why."""
        with self._cond:
            members = self._control.members() if targets is None else targets
            pending = self._pending = _Pending(key, members)
        exports: list[Handle] = []
        try:
            for member in members:
                handles = [self._sharer.export(t) for t in tensors]
                exports += handles
                self._control.send(
                    member, {**message(member), "layout": layout, "handles": handles}
                )
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

    def _on_join(self, member: str, msg: Message) -> None:
        with self._cond:
            version, mapped, holders = self._version, self._mapped, list(self._holders)
        self._control.send(member, {"kind": control.WELCOME, "ticket": None})
        if mapped is not None:  # the newest published state, exported for this newcomer
            tensors, layout = _unique(mapped)
            handles = [self._sharer.export(t) for t in tensors]
            ticket = {"kind": control.TICKET, "version": version, "layout": layout}
            self._control.send(member, {**ticket, "handles": handles, "retire": True})
        elif holders:  # a holder exports its image; its answer is relayed (_on_message)
            self._control.send(
                holders[0], {"kind": control.SERVE, "version": version, "to": member}
            )

    def _on_message(self, member: str, msg: Message) -> None:
        kind = msg["kind"]
        if kind == control.IMAGE:  # a holder's export for a newcomer: relay it
            self._control.send(str(msg["to"]), msg)
            return
        if kind not in (control.HAVE, control.FAILED):
            return
        key = (int(msg.get("version", -1)), int(msg.get("bucket", -1)))
        with self._cond:
            newcomer = kind == control.HAVE and key == (self._version, -1)
            if newcomer and self._mapped is None and member not in self._holders:
                self._holders.append(member)  # a newcomer served by a holder
            pending = self._pending
            if pending is not None and pending.key == key and member in pending.acks:
                ok = kind == control.HAVE
                pending.acks[member] = "ok" if ok else str(msg.get("reason"))
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
    layout: list[list[Any]]
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

    def _on_message(self, msg: Message) -> None:
        kind = msg["kind"]
        if kind not in (
            control.TICKET, control.BEGIN, control.BUCKET, control.COMMIT,
            control.SERVE, control.IMAGE,
        ):  # fmt: skip
            return
        version = int(msg["version"])
        reply: Message = {"kind": control.HAVE, "version": version}
        if kind == control.BUCKET:
            reply["bucket"] = int(msg["bucket"])
        if kind in (control.TICKET, control.BEGIN, control.IMAGE):
            self._started.setdefault(version, time.perf_counter())
        try:
            if kind == control.TICKET:
                self._mapped(msg)
            elif kind == control.BEGIN:
                image = torch.empty(int(msg["nbytes"]), dtype=torch.uint8, device=self.device)
                self._incoming = _Incoming(version, image, msg["layout"], msg["offsets"])
                return
            elif kind == control.BUCKET:
                self._bucket(msg)
            elif kind == control.COMMIT:
                self._commit(version)
            elif kind == control.SERVE:
                self._serve(msg)
                return
            else:
                self._image(msg)
        except Exception as e:
            if kind == control.SERVE:
                return  # the newcomer gets the next version
            why = f"{type(e).__name__}: {e}"
            self._control.send({**reply, "kind": control.FAILED, "reason": why})
            return
        finally:
            if msg.get("retire"):  # handles exported for this receiver alone: its to retire
                for handle in msg.get("handles", ()):
                    self._sharer.retire(handle)
        self._control.send(reply)

    def _hold(self, version: int, state: Mapping[str, torch.Tensor], image: Any = None) -> None:
        if self._shelf.offer(version, types.MappingProxyType(dict(state)), image):
            self.transfer_s[version] = time.perf_counter() - self._started.pop(version, 0.0)
            for old in [v for v in self.transfer_s if v < version - 8]:
                del self.transfer_s[old]

    def _mapped(self, msg: Message) -> None:
        """``publish``: the sender's tensors, mapped."""
        version = int(msg["version"])
        tensors = [self._sharer.open(h) for h in msg["handles"]]
        if version <= self._shelf.latest():
            # opened and dropped at once all the same: a CUDA handle's reference count is
            # given back when its opener frees it, and the sender's memory waits for that
            return
        self._hold(version, {name: tensors[i] for name, i in msg["layout"]})

    def _bucket(self, msg: Message) -> None:
        incoming = self._incoming
        if incoming is None or incoming.version != int(msg["version"]):
            raise RuntimeError(f"bucket of version {msg['version']} without its begin")
        tensors = [self._sharer.open(h) for h in msg["handles"]]
        image = incoming.image
        for spec, i in msg["layout"]:
            src = tensors[int(i)]
            offset = int(incoming.offsets[int(spec)])
            nbytes = src.numel() * src.element_size()
            if nbytes:
                dst = image[offset : offset + nbytes].view(src.dtype).view(src.shape)
                dst.copy_(src, non_blocking=True)
        _settle(image, *tensors)  # the copies are done before the handles go
        del tensors

    def _commit(self, version: int) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is None or incoming.version != version:
            raise RuntimeError(f"commit of version {version} that did not arrive whole")
        views = dict(unpack_buffer(incoming.image, incoming.layout, source="ipc image"))
        self._hold(version, views, (incoming.image, incoming.layout))

    def _serve(self, msg: Message) -> None:
        """A holder: export the newest image for a newcomer (relayed by the sender)."""
        version = int(msg["version"])
        held = self._shelf.extra(version)
        if not isinstance(held, tuple):
            raise RuntimeError(f"version {version} is not held here")
        image, layout = held
        handle = self._sharer.export(image)
        image_msg = {"kind": control.IMAGE, "version": version, "to": msg["to"]}
        self._control.send({**image_msg, "layout": layout, "handles": [handle], "retire": True})

    def _image(self, msg: Message) -> None:
        """A newcomer: copy a holder's image of the newest version into its own."""
        version = int(msg["version"])
        if version <= self._shelf.latest():
            return
        source = self._sharer.open(msg["handles"][0])
        image = torch.empty_like(source, device=self.device)
        image.copy_(source)
        _settle(image, source)
        del source
        views = dict(unpack_buffer(image, msg["layout"], source="ipc image"))
        self._hold(version, views, (image, msg["layout"]))


def _settle(*tensors: torch.Tensor) -> None:
    """Wait for the work queued on every GPU these tensors live on (a copy between two GPUs
    runs on one device's stream, ordered against the other's)."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)
