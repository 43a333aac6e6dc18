"""The generator host's end of ``broadcast`` (see :mod:`.broadcast` for the design).

Threads: the control loop thread (:mod:`.control`: its polls, which are also its heartbeats,
never wait on a transfer, so a long transfer does not make the sender think this receiver
died), one short-lived thread per
link the sender asks for (built at once, while the sender's side waits), and one *worker* that
runs the transfers in order:

| job     | what the worker does                                                      |
|---------|---------------------------------------------------------------------------|
| publish | receive a version's ranges on the link into a fresh host image; keep it   |
|         | once the sender commits it, then acknowledge                              |
| fetch   | (newcomer) receive the newest version from a holder over a temporary link |
| serve   | (holder) send a held version to a newcomer over a temporary link          |

Each received image stays whole in host memory (``unpack_buffer`` gives zero-copy views for
``get``) and is what this receiver serves newcomers from while it is the newest. A gloo
transfer cannot be interrupted: one on a link the sender abandoned ends at its own bound
(``timeout_s``); jobs that expired behind it meanwhile are skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from asyncflow.transport import links
from asyncflow.transport.control import ControlClient
from asyncflow.transport.messages import (
    Commit,
    Event,
    Failed,
    Fetch,
    Have,
    Link,
    Publish,
    Rejoin,
    Serve,
)
from asyncflow.transport.shelf import VersionShelf
from engines.weights_io import unpack_buffer

__all__ = ["BroadcastReceiver", "ReceiverConfig"]

log = logging.getLogger(__name__)

Job = Publish | Fetch | Serve


class ReceiverConfig(Protocol):
    """What a receiver reads of its transport's config (:class:`.broadcast.BroadcastTransport`,
    which builds receivers: this module does not import it)."""

    @property
    def address(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def heartbeat_s(self) -> float: ...
    @property
    def dead_after_s(self) -> float: ...


class _State:
    """What the worker, the I/O thread and the finalizer share (never the receiver)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.link: tuple[int, Any] | None = None  # (link id, group)
        self.commits: set[tuple[int, int]] = set()  # (link id, version) the sender committed
        self.latest_link = 0  # the newest link the sender asked for (older builds are stale)
        self.failed_links: set[int] = set()  # links whose build failed on this side
        self.store_port = -1  # the sender's store, as its newest link message said
        self.closed = False
        # (job, monotonic time the sender gives up on it), None: stop
        self.jobs: queue.SimpleQueue[tuple[Job, float] | None] = queue.SimpleQueue()
        self.control: ControlClient | None = None
        self.worker: threading.Thread | None = None

    def reset_link(self, link_id: int | None = None) -> None:
        """Forget the link (only if it is ``link_id``, when given)."""
        with self.lock:
            link = self.link
            if link is None or (link_id is not None and link[0] != link_id):
                return
            self.link = None
            self.commits.clear()
            self.lock.notify_all()
        links.abort(link[1])

    def stop(self) -> None:
        with self.lock:
            self.closed = True
        if self.control is not None:
            self.control.close()
        self.jobs.put(None)
        self.reset_link()
        # A transfer in progress cannot be interrupted (gloo); the worker ends with it, within
        # timeout_s, as a daemon thread.
        if self.worker is not None and self.worker is not threading.current_thread():
            self.worker.join(timeout=5)


class BroadcastReceiver:
    """Receives versions over its link; keeps the newest staged in host memory."""

    def __init__(self, config: ReceiverConfig, member: str) -> None:
        self.config = config
        self.member = member
        self._shelf = VersionShelf(member)
        self._state = _State()
        self._store: Any = None
        self._store_port = -1
        self._bucket: torch.Tensor | None = None  # NCCL: device memory a range lands in first
        self._finalizer = weakref.finalize(self, self._state.stop)
        worker = threading.Thread(
            target=_work,
            args=(weakref.ref(self), self._state.jobs),
            name=f"broadcast-{member}",
            daemon=True,
        )
        self._state.worker = worker
        worker.start()
        self._state.control = self._control = ControlClient(
            config.address,
            member,
            on_message=self._on_message,
            heartbeat_s=config.heartbeat_s,
            dead_after_s=config.dead_after_s,
            name=f"broadcast-weights-{member}",
        )
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
        """Leave (the sender drops this receiver at once), abort the links, free the images."""
        self._finalizer()
        self._shelf.close()

    def _check(self) -> None:
        if self._control.error is not None:
            self._shelf.fail(self._control.error)

    # -- control loop thread --------------------------------------------------------------

    def _on_message(self, event: Event) -> None:
        if isinstance(event, Rejoin):
            # The sender dropped our link (or restarted): stop using it; a version received on
            # it but not committed is thrown away.
            self._state.reset_link()
        elif isinstance(event, Commit):
            with self._state.lock:
                self._state.commits.add((event.link, event.version))
                self._state.lock.notify_all()
        elif isinstance(event, Link):
            # Built in a thread of its own, at once: the sender's side is waiting now, and a
            # worker still busy with a transfer on a dead link must not make them miss.
            with self._state.lock:
                self._state.latest_link = event.link
                self._state.store_port = event.store_port
            threading.Thread(
                target=self._link, args=(event,), name=f"link-{self.member}", daemon=True
            ).start()
        elif isinstance(event, Publish | Serve | Fetch):
            # The sender gives up on a job timeout_s after sending it; so does the worker (a
            # job that waited behind a stuck transfer must not then wait for a peer that left).
            self._state.jobs.put((event, time.monotonic() + self.config.timeout_s))

    # -- worker ---------------------------------------------------------------------------

    def _run_job(self, job: Job, expires: float) -> None:
        """Run one job of the worker; a failure is reported to the sender, never raised."""
        try:
            if expires - time.monotonic() < 0.5:
                raise RuntimeError("it expired waiting behind another transfer")
            if isinstance(job, Publish):
                self._publish(job, expires)
            elif isinstance(job, Fetch):
                self._fetch(job, expires)
            else:
                self._serve(job, expires)
        except Exception as e:
            kind = type(job).__name__.lower()
            log.warning("receiver %r: %s job failed: %s", self.member, kind, e)
            if isinstance(job, Publish | Fetch):
                reason = f"{type(e).__name__}: {e}"[:4096]
                self._control.send(
                    Failed(member=self.member, version=job.version, reason=reason, link=job.link)
                )

    def _store_for(self, port: int) -> Any:
        """The worker's client of the sender's store (one per thread: a client's blocking
        waits are serialized)."""
        if self._store is None or port != self._store_port:
            self._store = links.open_store(
                self.config.host, port, master=False, timeout_s=self.config.timeout_s
            )
            self._store_port = port
        return self._store

    def _link(self, event: Link) -> None:
        link_id = event.link
        try:
            store = links.open_store(
                self.config.host,
                event.store_port,
                master=False,
                timeout_s=self.config.timeout_s,
            )
            group = links.pair_group(
                store,
                event.prefix,
                1,
                backend=self.config.backend,
                timeout_s=self.config.timeout_s,
            )
        except Exception as e:  # the sender's side fails too, drops us, and we join again
            log.warning("receiver %r: link %d failed: %s", self.member, link_id, e)
            with self._state.lock:
                self._state.failed_links.add(link_id)
                self._state.lock.notify_all()
            return
        with self._state.lock:
            if link_id != self._state.latest_link or self._state.closed:
                stale = group
            else:
                stale = self._state.link[1] if self._state.link is not None else None
                self._state.link = (link_id, group)
            self._state.lock.notify_all()
        links.abort(stale)

    def _publish(self, msg: Publish, expires: float) -> None:
        link_id, version = msg.link, msg.version
        st = self._state
        with st.lock:
            # The sender counts the link from when its side of the pair is up; this side comes
            # up in its own thread, possibly a moment later: a publish sent at once waits for it
            # (bounded by the job's time left; a link replaced or failed meanwhile ends it).
            st.lock.wait_for(
                lambda: (
                    (st.link is not None and st.link[0] == link_id)
                    or st.latest_link != link_id
                    or link_id in st.failed_links
                    or st.closed
                ),
                max(0.0, expires - time.monotonic() - 0.5),
            )
            link = st.link
        if link is None or link[0] != link_id:
            raise RuntimeError(f"no link {link_id} here (it failed or was replaced)")
        ranges = msg.image.ranges
        image = links.host_image(msg.image.nbytes)
        bucket = self._device_bucket(ranges) if self.config.backend == "nccl" else None
        try:
            links.recv_ranges(link[1], image, ranges, self.config.timeout_s, bucket=bucket)
        except Exception:
            self._state.reset_link(link_id)  # the sender drops it and asks us to join again
            raise
        # Keep the bytes only once the sender says every range left it while its source was
        # intact (see BroadcastSender._stream).
        key = (link_id, version)
        with self._state.lock:
            self._state.lock.wait_for(
                lambda: key in self._state.commits or self._state.link is not link,
                self.config.timeout_s,
            )
            committed = key in self._state.commits
            self._state.commits.discard(key)
        if not committed:
            raise RuntimeError(
                f"version {version} was not committed by the sender on link {link_id}"
            )
        self._keep(msg, image)

    def _fetch(self, msg: Fetch, expires: float) -> None:
        ranges = msg.image.ranges
        image = links.host_image(msg.image.nbytes)
        group = self._temp_group(msg.prefix, expires, rank=1)
        links.recv_ranges(group, image, ranges, self.config.timeout_s)
        # tell the holder everything arrived, so that it may drop the link
        done = torch.ones(1, dtype=torch.uint8)
        group.send([done], 0, len(ranges)).wait(links.seconds(self.config.timeout_s))
        self._keep(msg, image)

    def _serve(self, msg: Serve, expires: float) -> None:
        version = msg.version
        self._shelf.get(version)  # pinned while it is sent
        try:
            image = self._shelf.extra(version)
            if not isinstance(image, torch.Tensor):
                raise RuntimeError(f"version {version} is not staged here")
            group = self._temp_group(msg.prefix, expires, rank=0)
            links.send_ranges(group, image, msg.ranges, self.config.timeout_s)
            done = torch.zeros(1, dtype=torch.uint8)
            group.recv([done], 1, len(msg.ranges)).wait(links.seconds(self.config.timeout_s))
        finally:
            self._shelf.release(version)

    def _temp_group(self, prefix: str, expires: float, *, rank: int) -> Any:
        with self._state.lock:
            port = self._state.store_port
        # Always gloo: both images are in host memory.
        return links.pair_group(
            self._store_for(port),
            prefix,
            rank,
            backend="gloo",
            timeout_s=expires - time.monotonic(),
        )

    def _keep(self, msg: Publish | Fetch, image: torch.Tensor) -> None:
        """Offer a received image to the shelf (views into it) and acknowledge it."""
        version = msg.version
        source = f"weights version {version}"
        views = dict(unpack_buffer(image, msg.image.layout, source=source))
        self._shelf.offer(version, types.MappingProxyType(views), image)
        self._control.send(Have(member=self.member, version=version, link=msg.link))

    def _device_bucket(self, ranges: list[tuple[int, int]]) -> torch.Tensor:
        largest = max((end - start for start, end in ranges), default=0)
        if self._bucket is None or self._bucket.numel() < largest:
            self._bucket = None
            self._bucket = torch.empty(largest, dtype=torch.uint8, device="cuda")
        return self._bucket


def _work(
    ref: weakref.ref[BroadcastReceiver], jobs: queue.SimpleQueue[tuple[Job, float] | None]
) -> None:
    """The worker thread: runs jobs in order. It holds the receiver only while running a job,
    so an unreferenced receiver is collected (and its finalizer stops this thread)."""
    while (item := jobs.get()) is not None:
        receiver = ref()
        if receiver is None:
            return
        receiver._run_job(*item)
        del receiver
