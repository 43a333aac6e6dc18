"""``shm``: one shared-memory file per version, mapped zero-copy by every receiver on the host.

The sender packs each published version ONCE (:func:`engines.weights_io.pack_state`: one
sequential write into ``/dev/shm``, about 3 GB/s, bf16 and tied weights kept) and sends a
*ticket* (version, path, layout: :class:`.messages.Ticket`) over the control channel
(:mod:`.control`) to every receiver; each maps the file (``torch.from_file``: no copy, the
pages are shared) and acknowledges. ``publish`` returns when every current receiver has mapped
the version.

Lifetime of the memory: the sender unlinks a version's *name* as soon as a newer version is
published (after the receivers acknowledged the newer one); the pages live on while a
receiver still maps the old version (pinned by ``get``) and go back to the kernel with the
last mapping. So at most the newest version and the ones pinned are in memory, whatever the
number of receivers. A receiver that dies loses its mappings with its process; the sender
unlinks its newest file on ``close`` (and at interpreter exit). A sender killed outright
leaves its newest file behind: the next sender on the host removes files whose creating
process is gone (:func:`sweep_orphans`).

A version that arrives a bucket at a time (a sharded trainer, :func:`.base.publish_stream`)
is written into its file bucket by bucket (:class:`engines.weights_io.PackWriter`): the
sender holds one tensor of it at a time, never the whole state.

A receiver that joins late is sent the newest ticket as soon as it joins. The control
address defaults to a Linux abstract socket (no file, gone with the process); it is part of
the picklable config, so processes started by anyone (``multiprocessing``, Ray actors) find
the sender with no other wiring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

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
from engines.weights_io import PackedState, PackWriter, StateSpec, pack_state, unpack_state

__all__ = ["ShmReceiver", "ShmSender", "ShmTransport", "sweep_orphans"]

log = logging.getLogger(__name__)
_FILE = re.compile(r"asyncflow-weights-(\d+)-[0-9a-f]+\.bin")


def _check_timing(timeout_s: float, heartbeat_s: float, dead_after_s: float) -> None:
    for name, value in (("timeout_s", timeout_s), ("heartbeat_s", heartbeat_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not dead_after_s > 2 * heartbeat_s:
        raise ValueError(
            f"dead_after_s must exceed two heartbeats ({2 * heartbeat_s} s), got {dead_after_s!r}"
        )


@register_transport("shm")
@dataclass(frozen=True, kw_only=True)
class ShmTransport:
    """Config of the same-host shared-memory transport."""

    name: ClassVar[str] = "shm"
    address: str = field(default_factory=control.unique_ipc_address)
    """The sender's control socket (ZeroMQ endpoint); unique per transport by default."""
    directory: str | None = None
    """Where version files go; None: ``/dev/shm`` when it has room, else the temp folder."""
    timeout_s: float = 60.0
    """Bound of one publish (packing excluded): receivers that have not acknowledged by then
    are reported failed."""
    heartbeat_s: float = 1.0
    """How often receivers and sender tell each other they are alive."""
    dead_after_s: float = 10.0
    """A receiver silent this long is dropped (one on this host is dropped as soon as its
    process exits)."""

    def __post_init__(self) -> None:
        _check_timing(self.timeout_s, self.heartbeat_s, self.dead_after_s)
        control.check_address(self.address)

    def sender(self) -> ShmSender:
        return ShmSender(self)

    def receiver(self, member: str) -> ShmReceiver:
        return ShmReceiver(self, member)


def sweep_orphans(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove this user's version files whose creating process has exited; the removed paths.

    Looks in ``directory``, or in ``/dev/shm`` and the temp folder. Files are named
    ``asyncflow-weights-<pid>-<hex>.bin`` by their creator; process ids are those of this
    host's pid namespace (a folder shared by containers with separate namespaces should not
    be swept).
    """
    folders = (
        [Path(directory)]
        if directory is not None
        else [Path("/dev/shm"), Path(tempfile.gettempdir())]
    )
    removed: list[str] = []
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in folder.glob("asyncflow-weights-*.bin"):
            match = _FILE.fullmatch(path.name)
            with contextlib.suppress(OSError):
                if (
                    match
                    and path.stat().st_uid == os.getuid()
                    and not control.pid_alive(int(match[1]))
                ):
                    path.unlink()
                    removed.append(str(path))
    return removed


class _Files:
    """The sender's version files (shared with its finalizer, which unlinks them)."""

    def __init__(self) -> None:
        self.packed: list[PackedState] = []

    def unlink_all(self) -> None:
        for packed in self.packed:
            packed.unlink()
        self.packed.clear()


def _stop(server: ControlServer, files: _Files) -> None:
    server.close()
    files.unlink_all()


class ShmSender:
    """Packs each version once and hands its ticket to every receiver (see the module doc)."""

    def __init__(self, config: ShmTransport) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._version = -1
        self._ticket: m.Ticket | None = None
        # the publish waiting for acknowledgements: member -> None (pending) or a failure
        self._pending: dict[str, str | None] = {}
        self._pending_version = -1
        self._files = _Files()
        self._closed = False
        self.last_sync: SyncTimes | None = None
        """Times of the newest publish."""
        for path in sweep_orphans(config.directory):
            log.info("removed an orphaned weights file %s", path)
        self._control = ControlServer(
            config.address,
            on_join=self._on_join,
            on_message=self._on_message,
            on_lost=self._on_lost,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name="shm-weights-sender",
        )
        self._finalizer = weakref.finalize(self, _stop, self._control, self._files)
        self._control.start()

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Pack ``state`` into a fresh file and wait (``timeout_s``) until every current
        receiver mapped it; then unlink the previous version's name."""
        clock = SyncClock()
        self._check_open()
        check_state(state)
        with self._cond:
            check_version(version, self._version)
        clock.sending()  # the bytes start moving into the shared file
        self._deliver(pack_state(state, directory=self.config.directory), version, clock)

    def publish_buckets(
        self,
        specs: Sequence[StateSpec],
        buckets: Iterable[Mapping[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Write each bucket into a fresh file as it comes, then hand the file out as
        :meth:`publish` does (see the module doc)."""
        clock = SyncClock()
        self._check_open()
        with self._cond:
            check_version(version, self._version)
        writer = PackWriter(specs, directory=self.config.directory)
        try:
            for bucket in buckets:
                clock.sending()
                check_state(bucket)
                writer.write(bucket)
            packed = writer.finish()
        except BaseException:
            writer.abort()
            raise
        self._deliver(packed, version, clock)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError("the shm weight sender is closed")
        self._control.check()

    def _deliver(self, packed: PackedState, version: int, clock: SyncClock) -> None:
        """Send ``packed``'s ticket to every receiver and wait for their acknowledgements."""
        self._files.packed.append(packed)
        ticket = m.Ticket(version=version, path=packed.path, layout=m.layout(packed.layout))
        with self._cond:
            self._version, self._ticket = version, ticket
            targets = self._control.members()
            self._pending = dict.fromkeys(targets)
            self._pending_version = version
        for member in targets:
            self._control.send(member, ticket)
        deadline = time.monotonic() + self.config.timeout_s
        with self._cond:
            self._cond.wait_for(
                lambda: all(v is not None for v in self._pending.values()),
                max(0.0, deadline - time.monotonic()),
            )
            failures = {
                m: why or f"no acknowledgement within timeout_s={self.config.timeout_s}"
                for m, why in self._pending.items()
                if why != "ok"
            }
            self._pending, self._pending_version = {}, -1
        for old in self._files.packed[:-1]:
            old.unlink()  # receivers that map it keep its pages until they let go
        del self._files.packed[:-1]
        for member in failures:
            self._control.drop(member, f"version {version} failed")
        self.last_sync = clock.done(version, packed.nbytes)
        if failures:
            raise ReceiverFailedError(version, failures)

    def members(self) -> list[str]:
        return self._control.members()

    def close(self) -> None:
        """Close the control socket and unlink the files; idempotent."""
        self._closed = True
        self._finalizer()

    # -- control callbacks (I/O thread) ---------------------------------------------------

    def _on_join(self, member: str, msg: m.Join) -> None:
        with self._cond:
            ticket = self._ticket
        if ticket is not None:
            self._control.send(member, ticket)

    def _on_message(self, member: str, msg: m.Have | m.Failed) -> None:
        with self._cond:
            if msg.version == self._pending_version and member in self._pending:
                self._pending[member] = "ok" if isinstance(msg, m.Have) else msg.reason
                self._cond.notify_all()

    def _on_lost(self, member: str, reason: str) -> None:
        with self._cond:
            if self._pending.get(member, "ok") is None:
                self._pending[member] = f"lost: {reason}"
                self._cond.notify_all()


class ShmReceiver:
    """Maps each ticket's file as it arrives (so a superseded name may be unlinked at once)
    and keeps the mapped views on its shelf."""

    lookup_only = True
    """``get`` of a version :meth:`newest` has is a lookup of views mapped when its ticket
    came (no copy, no wait): the follower calls it on its event loop, not a worker thread."""

    def __init__(self, config: ShmTransport, member: str) -> None:
        self.member = member
        self._shelf = VersionShelf(member)
        self._control = ControlClient(
            config.address,
            member,
            on_message=self._on_message,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name=f"shm-weights-{member}",
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

    def _check(self) -> None:
        if self._control.error is not None:
            self._shelf.fail(self._control.error)

    def _on_message(self, event: m.Event) -> None:
        if not isinstance(event, m.Ticket):
            return  # (a rejoin: nothing to reset, the newest ticket comes with the join)
        version = event.version
        if version > self._shelf.latest():
            try:
                views = dict(unpack_state(event.path, event.layout))
            except (OSError, ValueError) as e:  # unlinked meanwhile (superseded) or corrupt
                self._control.send(
                    m.Failed(member=self.member, version=version, reason=str(e)[:4096])
                )
                return
            self._shelf.offer(version, types.MappingProxyType(views))
        self._control.send(m.Have(member=self.member, version=version))
