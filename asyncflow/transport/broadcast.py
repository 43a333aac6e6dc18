"""``broadcast``: torch.distributed from the trainer's rank 0 to every generator host.

Topology: one *link* (a two-rank process group, :mod:`.links`) per receiver, not one group of
everyone. Why: gloo's broadcast is one-to-all anyway (the root sends the whole payload to each
peer in turn: 4.0 GB/s to one peer, 1.9 to two on the reference machine), so pair links cost
the sender the same bytes, and they make membership trivial: a receiver that dies breaks only
its own link (its pending sends fail at once: the kernel closes its sockets), and one that
joins builds only its own link; nobody else stops or rebuilds anything, and no collective can
hang on a member that is gone. With NCCL a group broadcast would cut the sender's traffic to
about one copy, at the price of rebuilding every member's communicator on each membership
change; with the few generator hosts per trainer of an RL job, pair links are kept there too.

Per publish the sender sends a header (version, layout, ranges: :class:`.messages.Publish`)
over the control channel (:mod:`.control`), then streams the ranges on every link at once and
waits for each receiver's acknowledgement. Memory at the sender: ``bucket_bytes`` in all (two
buckets of half that, one packed while the other is on the wire), plus a flat copy of any
non-contiguous tensor; large contiguous tensors go out from the trainer's own memory. The
sender keeps no copy of the weights once ``publish`` returns.

Memory at each receiver: one staged host copy of the newest version (generators load at their
own micro-batch boundary, so the bytes must wait for them somewhere), plus a second while a
newer version arrives, plus any version the caller pinned with ``get``. That staged copy is
also what a *newcomer* (a restarted generator host) is served from: the sender asks a receiver
that holds the newest version to send it over a temporary link, so a late receiver gets the
newest version with no republish and no copy at the sender. With no such holder (the only
receiver restarted), the newcomer gets the next published version, unless the sender keeps
its own copy (``keep_newest=True``: one packed host image of the newest version at the
sender, which then also streams from it; the choice for a single generator host, whose
restart would otherwise wait for a step that needs its samples).

Every wait is bounded by ``timeout_s``; a receiver whose link fails is dropped and told to join
again, which it does by itself.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from asyncflow.transport import control, links
from asyncflow.transport.base import (
    ReceiverFailedError,
    SyncClock,
    SyncTimes,
    TransportClosedError,
    check_state,
    check_version,
    register_transport,
)
from asyncflow.transport.broadcast_receiver import BroadcastReceiver
from asyncflow.transport.control import ControlServer
from asyncflow.transport.messages import (
    Commit,
    Failed,
    Fetch,
    Have,
    Image,
    Join,
    Link,
    Publish,
    Serve,
    layout,
)
from asyncflow.transport.shm import _check_timing
from engines.weights_io import plan_state

__all__ = ["BroadcastSender", "BroadcastTransport"]

BACKENDS = ("gloo", "nccl")
_SELF = "\x00sender"  # fetch_from of a newcomer the sender serves itself (keep_newest)
log = logging.getLogger(__name__)


@register_transport("broadcast")
@dataclass(frozen=True, kw_only=True)
class BroadcastTransport:
    """Config of the torch.distributed transport (see the module doc)."""

    name: ClassVar[str] = "broadcast"
    address: str = field(default_factory=control.free_tcp_address)
    """``tcp://HOST:PORT`` of the sender's control socket; HOST must reach the trainer's rank-0
    host from every generator host (the default, a free loopback port, suits one machine)."""
    backend: str = "gloo"
    """``gloo`` (host memory; CUDA tensors are copied to host buckets) or ``nccl`` (CUDA at
    both ends; receivers copy each range to their host image). The NCCL path follows the
    gloo one but has not run here yet (no GPU was available); gloo is the tested default."""
    bucket_bytes: int = 256 << 20
    """The sender's staging memory in all (two buckets of half); ranges are at most half."""
    keep_newest: bool = False
    """Keep a packed host copy of the newest version at the sender (one model's bytes), so a
    newcomer is served even when no receiver holds the newest version."""
    timeout_s: float = 60.0
    """Bound of one publish, of building a link, and of one catch-up of a newcomer; set it
    above the model's bytes over the slowest link's bandwidth."""
    heartbeat_s: float = 1.0
    dead_after_s: float = 10.0

    def __post_init__(self) -> None:
        _check_timing(self.timeout_s, self.heartbeat_s, self.dead_after_s)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.address.startswith("tcp://") or ":" not in self.address[6:]:
            raise ValueError(f"address must be tcp://HOST:PORT, got {self.address!r}")
        if self.keep_newest and self.backend != "gloo":
            raise ValueError(
                "keep_newest keeps the sender's copy in host memory, which only backend='gloo' "
                f"sends; got backend={self.backend!r}"
            )
        if self.bucket_bytes < 128:
            raise ValueError(f"bucket_bytes must be >= 128, got {self.bucket_bytes}")

    @property
    def host(self) -> str:
        return self.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")

    @property
    def chunk_bytes(self) -> int:
        return max(64, self.bucket_bytes // 2 // 64 * 64)

    def sender(self) -> BroadcastSender:
        return BroadcastSender(self)

    def receiver(self, member: str) -> BroadcastReceiver:
        return BroadcastReceiver(self, member)


class _Member:
    """The sender's view of one receiver."""

    def __init__(self, name: str, link_id: int) -> None:
        self.name = name
        self.link_id = link_id
        self.group: Any = None  # the link, once built
        self.have = -1  # newest version it acknowledged
        self.fetch_until = 0.0  # monotonic deadline of its catch-up in flight (0: none)
        self.fetch_from = ""  # the holder serving it
        self.serving = False  # it serves a newcomer now
        self.retry_at = 0.0


class _Shared:
    """What the sender and its finalizer share (never the sender itself)."""

    def __init__(self) -> None:
        self.members: dict[str, _Member] = {}
        self.control: ControlServer | None = None

    def stop(self) -> None:
        if self.control is not None:
            self.control.close()
        for member in list(self.members.values()):
            links.abort(member.group)
        self.members.clear()


class BroadcastSender:
    """Streams each version over every receiver's link; serves newcomers through holders."""

    def __init__(self, config: BroadcastTransport) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._publish_lock = threading.Lock()
        self._shared = _Shared()
        self._members = self._shared.members
        self._version = -1
        self._header: Image | None = None  # layout and ranges of the newest version
        self._image: torch.Tensor | None = None  # keep_newest: the newest version, packed
        self._self_serving = False  # keep_newest: the sender serves a newcomer now
        self._publishing = False
        self._acks: dict[str, str | None] = {}
        self._ack_version = -1
        self._ids = itertools.count(1)
        self._buckets: list[torch.Tensor] = []
        self._closed = False
        self.last_sync: SyncTimes | None = None
        """Times of the newest publish."""
        self._device = "cuda" if config.backend == "nccl" else "cpu"
        self._store = links.open_store("", 0, master=True, timeout_s=config.timeout_s)
        self._finalizer = weakref.finalize(self, self._shared.stop)
        self._shared.control = self._control = ControlServer(
            config.address,
            on_join=self._on_join,
            on_message=self._on_message,
            on_lost=self._on_lost,
            on_tick=self._on_tick,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name="broadcast-weights-sender",
        )
        self._control.start()

    # -- publish (the trainer's thread) ---------------------------------------------------

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Stream ``state`` to every receiver with a link and wait for each to acknowledge
        (``timeout_s``); failed receivers are dropped and named in ReceiverFailedError."""
        clock = SyncClock()
        if self._closed:
            raise TransportClosedError("the broadcast weight sender is closed")
        self._control.check()
        check_state(state)
        with self._publish_lock:
            with self._cond:
                check_version(version, self._version)
            plan = plan_state(state)
            ranges = links.plan_ranges(
                plan, chunk_bytes=self.config.chunk_bytes, device=self._device
            )
            image = self._pack(plan, ranges) if self.config.keep_newest else None
            if image is not None:  # stream from the copy, which no one changes
                ranges = [
                    links.Range(r.start, r.end, direct=image[r.start : r.end]) for r in ranges
                ]
            header = Image(
                nbytes=plan.nbytes,
                layout=layout(plan.layout),
                ranges=[(r.start, r.end) for r in ranges],
            )
            deadline = time.monotonic() + self.config.timeout_s
            with self._cond:
                self._publishing = True
                # catch-ups in flight keep their receivers busy: let them end first
                self._cond.wait_for(
                    lambda: not any(m.fetch_until for m in self._members.values()),
                    max(0.0, deadline - time.monotonic()),
                )
                targets = {
                    n: m
                    for n, m in self._members.items()
                    if m.group is not None and not m.fetch_until
                }
                self._acks = dict.fromkeys(targets)
                self._ack_version = version
            failures: dict[str, str] = {}
            clock.sending()
            try:
                for name, member in targets.items():
                    publish = Publish(version=version, link=member.link_id, image=header)
                    self._control.send(name, publish)
                failures = self._stream(version, ranges, targets, deadline) if targets else {}
                with self._cond:
                    for name, why in failures.items():
                        self._acks[name] = why
                    self._cond.wait_for(
                        lambda: all(v is not None for v in self._acks.values()),
                        max(0.0, deadline - time.monotonic()),
                    )
                    late = f"no acknowledgement within timeout_s={self.config.timeout_s}"
                    failures = {n: why or late for n, why in self._acks.items() if why != "ok"}
                    self._version, self._header, self._image = version, header, image
            except BaseException:
                failures = dict.fromkeys(targets, "the sender failed mid-publish")
                raise
            finally:
                with self._cond:
                    self._publishing, self._acks, self._ack_version = False, {}, -1
                for name, why in failures.items():
                    self._drop(name, targets[name].link_id, why)
                self._catch_up()
            self.last_sync = clock.done(version, plan.nbytes)
        if failures:
            raise ReceiverFailedError(version, failures)

    def _stream(
        self, version: int, ranges: list[links.Range], targets: dict[str, _Member], deadline: float
    ) -> dict[str, str]:
        """Send every range on every live link, then commit the version on the links that
        sent all of it; the links that failed, with why.

        Ranges go out in lockstep (range i on every link, then i + 1), so each packed range
        is copied once for all links and two buckets suffice. A link whose receiver is
        declared lost meanwhile (heartbeats, process exit) is abandoned at once and the others
        go on. An abandoned send may still be draining: it can deliver bytes the trainer or
        the next bucket has since overwritten, which is why a receiver keeps a version only
        after this sender's COMMIT, sent only on links whose every send completed.
        """
        failures: dict[str, str] = {}
        live = dict(targets)
        waiters = {n: links.LinkWaiter(n, self._cond, deadline) for n in live}
        try:
            buckets = self._reserve(max((r.nbytes for r in ranges if r.direct is None), default=0))
            payload = ranges[0].pack(buckets[0]) if ranges else None
            for i in range(len(ranges)):
                for name, member in list(live.items()):
                    try:
                        waiters[name].add(i, member.group.send([payload], 1, i))
                    except Exception as e:
                        failures[name] = f"sending range {i}: {e}"
                        del live[name]
                if i + 1 < len(ranges):  # pack the next range while this one is on the wire
                    payload = ranges[i + 1].pack(buckets[(i + 1) % 2])
                with self._cond:
                    while True:
                        for name in list(live):
                            why = (
                                waiters[name].error
                                or self._gone(name, live[name])
                                or self._refused(name)
                            )
                            if (
                                why is None
                                and waiters[name].done < i
                                and time.monotonic() > deadline
                            ):
                                why = f"range {i} not sent within timeout_s={self.config.timeout_s}"
                            if why is not None:
                                failures[name] = why
                                del live[name]
                        if all(waiters[n].done >= i for n in live):
                            break
                        self._cond.wait(max(0.001, min(1.0, deadline - time.monotonic())))
                if not live:
                    break
        finally:
            for waiter in waiters.values():
                waiter.stop()
        for name, member in live.items():
            self._control.send(name, Commit(version=version, link=member.link_id))
        return failures

    def _gone(self, name: str, member: _Member) -> str | None:
        """Why ``member`` is no longer a member (lost, replaced), or None; under the lock."""
        if self._members.get(name) is member:
            return None
        return self._acks.get(name) or "dropped during the publish"

    def _refused(self, name: str) -> str | None:
        """Why ``name`` reported the publish under way failed on its side (it then posts no
        receive, so its sends would wait out the deadline), or None; under the lock."""
        why = self._acks.get(name)
        return None if why in (None, "ok") else f"the receiver failed: {why}"

    def _reserve(self, nbytes: int) -> list[torch.Tensor]:
        """The two staging buckets, at least ``nbytes`` each (kept across publishes)."""
        if not self._buckets or self._buckets[0].numel() < nbytes:
            self._buckets = []  # free the old ones first
            device = torch.device(self._device) if self._device == "cpu" else torch.device("cuda")
            self._buckets = [
                torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)
            ]
        return self._buckets

    def _pack(self, plan: Any, ranges: list[links.Range]) -> torch.Tensor:
        """The whole image in host memory (``keep_newest``), packed range by range."""
        image = links.host_image(plan.nbytes)
        bucket = torch.empty(max((r.nbytes for r in ranges), default=0), dtype=torch.uint8)
        for r in ranges:
            image[r.start : r.end] = r.pack(bucket) if r.direct is None else r.direct
        return image

    def members(self) -> list[str]:
        """The receivers with a link (the ones a publish streams to)."""
        with self._cond:
            return [n for n, m in self._members.items() if m.group is not None]

    def close(self) -> None:
        """Close the control socket and abort every link; idempotent."""
        self._closed = True
        self._finalizer()
        self._buckets = []

    # -- membership (control I/O thread, link builder threads) ---------------------------

    def _on_join(self, member: str, msg: Join) -> None:
        link_id = next(self._ids)
        with self._cond:
            old = self._members.pop(member, None)
            self._members[member] = _Member(member, link_id)
            self._cond.notify_all()
        if old is not None:
            links.abort(old.group)
        prefix = f"link/{link_id}"
        self._control.send(
            member,
            Link(
                link=link_id,
                prefix=prefix,
                store_port=self._store.port,
                backend=self.config.backend,
                timeout_s=self.config.timeout_s,
            ),
        )
        threading.Thread(
            target=self._build_link,
            args=(member, link_id, prefix),
            name=f"link-{member}",
            daemon=True,
        ).start()

    def _build_link(self, member: str, link_id: int, prefix: str) -> None:
        try:
            # A store client of its own: one client's blocking waits are serialized, so builders
            # sharing one would queue behind a newcomer that never connects.
            store = links.open_store(
                "127.0.0.1", self._store.port, master=False, timeout_s=self.config.timeout_s
            )
            group = links.pair_group(
                store, prefix, 0, backend=self.config.backend, timeout_s=self.config.timeout_s
            )
        except Exception as e:
            self._drop(member, link_id, f"building its link: {e}")
            return
        with self._cond:
            current = self._members.get(member)
            if current is None or current.link_id != link_id or self._closed:
                links.abort(group)  # replaced or dropped meanwhile
                return
            current.group = group
        self._catch_up()

    def _on_message(self, member: str, msg: Have | Failed) -> None:
        version, failed = msg.version, isinstance(msg, Failed)
        with self._cond:
            m = self._members.get(member)
            if m is None or msg.link not in (None, m.link_id):
                return  # about a link that was replaced
            if not failed:
                m.have = max(m.have, version)
            if version == self._ack_version and self._acks.get(member, "ok") is None:
                self._acks[member] = msg.reason if isinstance(msg, Failed) else "ok"
            if m.fetch_until and (failed or version >= self._version):
                self._end_fetch(m, failed=failed)
            self._cond.notify_all()
        self._catch_up()

    def _on_lost(self, member: str, reason: str) -> None:
        with self._cond:
            m = self._members.get(member)
            link_id = m.link_id if m is not None else -1
        self._drop(member, link_id, f"lost: {reason}", tell=False)

    def _on_tick(self) -> None:
        now = time.monotonic()
        with self._cond:
            for m in self._members.values():
                if m.fetch_until and now > m.fetch_until:
                    self._end_fetch(m, failed=True)
                    self._cond.notify_all()
        self._catch_up()

    def _drop(self, member: str, link_id: int, reason: str, *, tell: bool = True) -> None:
        """Forget ``member``'s link ``link_id`` (if still its link) and ask it to join again."""
        with self._cond:
            m = self._members.get(member)
            if m is None or m.link_id != link_id:
                return
            del self._members[member]
            if self._acks.get(member, "ok") is None:
                self._acks[member] = reason
            for other in self._members.values():
                if other.fetch_from == member:  # it was serving them: they retry elsewhere
                    self._end_fetch(other, failed=True)
            if m.fetch_until:
                self._end_fetch(m, failed=True)
            self._cond.notify_all()
        links.abort(m.group)
        if tell:
            self._control.drop(member, reason)

    # -- newcomers ------------------------------------------------------------------------

    def _end_fetch(self, m: _Member, *, failed: bool) -> None:
        holder = self._members.get(m.fetch_from)
        if holder is not None:
            holder.serving = False
        if m.fetch_from == _SELF:
            self._self_serving = False
        m.fetch_until, m.fetch_from = 0.0, ""
        if failed:
            m.retry_at = time.monotonic() + self.config.heartbeat_s

    def _catch_up(self) -> None:
        """Hand the newest version to linked members that lack it, each from a holder."""
        now = time.monotonic()
        sends: list[tuple[str, Serve | Fetch]] = []
        with self._cond:
            if self._publishing or self._closed or self._header is None:
                return
            version, header = self._version, self._header
            for m in self._members.values():
                if m.group is None or m.have >= version or m.fetch_until or now < m.retry_at:
                    continue
                holder = next(
                    (
                        h
                        for h in self._members.values()
                        if h.group is not None and h.have == version and not h.serving
                    ),
                    None,
                )
                prefix = f"serve/{next(self._ids)}"
                if holder is not None:
                    holder.serving = True
                    serve_it = Serve(
                        version=version, prefix=prefix, ranges=header.ranges, to=m.name
                    )
                    sends.append((holder.name, serve_it))
                elif self._image is not None and not self._self_serving:
                    self._self_serving = True
                    serve = (self._image, header.ranges, prefix)
                    threading.Thread(target=self._serve, args=serve, daemon=True).start()
                else:
                    break  # it gets the next publish (or a holder that frees up)
                m.fetch_until = now + self.config.timeout_s
                m.fetch_from = holder.name if holder is not None else _SELF
                fetch = Fetch(version=version, link=m.link_id, prefix=prefix, image=header)
                sends.append((m.name, fetch))
        for member, msg in sends:
            self._control.send(member, msg)

    def _serve(self, image: torch.Tensor, ranges: list[tuple[int, int]], prefix: str) -> None:
        """``keep_newest``: send the newest image to a newcomer over a temporary link (its
        FETCH reports how it went)."""
        timeout_s = self.config.timeout_s
        try:
            store = links.open_store(
                "127.0.0.1", self._store.port, master=False, timeout_s=timeout_s
            )
            group = links.pair_group(store, prefix, 0, backend="gloo", timeout_s=timeout_s)
            links.send_ranges(group, image, ranges, timeout_s)
            done = torch.zeros(1, dtype=torch.uint8)
            group.recv([done], 1, len(ranges)).wait(links.seconds(timeout_s))
        except Exception as e:
            log.warning("serving %s from the sender failed: %s", prefix, e)
