"""The weight-transport interface: how the trainer's weights reach every generator host.

Three roles, each a small Protocol:

| role              | lives in                          | methods                                 |
|-------------------|-----------------------------------|-----------------------------------------|
| `WeightTransport` | anywhere: a small picklable config | `sender()`, `receiver(member)`          |
| `WeightSender`    | the trainer's rank-0 process      | `publish`, `members`, `close`           |
|                   |                                   | (+ `publish_buckets`, `last_sync`)      |
| `WeightReceiver`  | each generator-host process       | `newest`, `wait_newer`, `get`,          |
|                   |                                   | `release`, `close`                      |

The deployment code makes one transport with :func:`make_transport` and passes it (pickled)
to every process; the trainer's rank 0 calls ``transport.sender()`` and each generator host
``transport.receiver(member)`` with a name unique to that host *incarnation* (a restarted host
takes a new name). Receivers may start before or after the sender; one that starts late (a
restarted host) is handed the newest version without the trainer doing anything.

Versions are the policy versions of the workflow (optimizer steps): non-negative, strictly
increasing per sender; newest wins (a receiver may skip versions it was too slow to load).

A sharded trainer has no rank that may hold the whole model: it publishes with
:func:`publish_stream`, which hands the full weights to the sender one bucket at a time
(every rank gathers each bucket); senders that write or send as they go (``shm``, ``ipc``)
implement ``publish_buckets`` and never hold more than a bucket, the others get the buckets
collected into one state in host memory (the device holds one bucket at a time still).

Every publish records its times (:class:`SyncTimes`, ``sender.last_sync``): how long the
trainer was held, and how long the bytes took to reach every receiver. The generator's side
of a sync (the pause while its engine loads the version) is timed by its host.

Errors are one small hierarchy (:class:`TransportError`); messages name the field, what was
expected and what was received.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from engines.weights_io import StateSpec

__all__ = [
    "BucketSender",
    "ReceiverFailedError",
    "StateError",
    "SyncTimes",
    "TransportClosedError",
    "TransportError",
    "TransportTimeoutError",
    "VersionError",
    "WeightReceiver",
    "WeightSender",
    "WeightTransport",
    "check_state",
    "check_version",
    "make_transport",
    "publish_stream",
    "register_transport",
    "sync_metrics",
    "transport_names",
]


class TransportError(Exception):
    """Base class of every weight-transport error."""


class StateError(TransportError, TypeError, ValueError):
    """A state dict that cannot be sent: a value that is not a tensor, a meta or sparse
    tensor, a key that is not a string."""


class VersionError(TransportError, ValueError):
    """A version that is negative, not newer than the last published one, or not (or no
    longer) available at a receiver."""


class TransportTimeoutError(TransportError, TimeoutError):
    """A bounded wait ran out (constructing a transport end, a transfer)."""


class TransportClosedError(TransportError):
    """The sender or receiver was closed, or the transport cannot be used in this process."""


class ReceiverFailedError(TransportError):
    """Some receivers did not get a published version.

    Raised by :meth:`WeightSender.publish` *after* the version was delivered to every other
    receiver: the version is published (it is the newest, later receivers get it). The failed
    receivers are dropped from the sender's membership; one still alive joins again by itself
    and is handed the newest version then.
    """

    def __init__(self, version: int, failures: Mapping[str, str]) -> None:
        self.version = version
        self.failures = dict(failures)
        """member name -> why its delivery failed"""
        detail = "; ".join(f"{m!r}: {why}" for m, why in sorted(self.failures.items()))
        super().__init__(
            f"weights version {version} did not reach {len(failures)} receiver(s): {detail}"
        )


@runtime_checkable
class WeightSender(Protocol):
    """The trainer's end (one per transport, in the trainer's rank-0 process)."""

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Make ``version`` the newest weights; called by the train stage after an optimizer
        step (from one thread at a time).

        Returns once every *current* receiver can obtain ``version`` (receivers that join
        later get the newest version when they join). The sender does not rely on ``state``
        after it returns: the trainer may change those tensors at once (implementations copy,
        pack or finish sending before returning; ``inprocess`` documents its exception).
        Bounded by the transport's ``timeout_s``.

        Raises:
            StateError: ``state`` holds something that is not a dense tensor with values.
            VersionError: ``version`` is negative or not newer than the last published one.
            ReceiverFailedError: some receivers failed (named); the others got the version.
            TransportClosedError: the sender was closed.
        """
        ...

    def members(self) -> list[str]:
        """The receivers a publish would deliver to now (joined and, where the transport
        needs one, linked); for metrics and for waiting on a restarted host."""
        ...

    def close(self) -> None:
        """Release every resource (sockets, shared memory, process groups); idempotent."""
        ...


@runtime_checkable
class BucketSender(Protocol):
    """A sender that takes a version a bucket at a time (``shm`` writes each into its file as
    it comes, ``ipc`` hands each to the receivers' devices): the trainer never holds the whole
    state. Called through :func:`publish_stream`."""

    def publish_buckets(
        self,
        specs: Sequence[StateSpec],
        buckets: Iterable[Mapping[str, torch.Tensor]],
        version: int,
    ) -> None:
        """Publish ``version``, whose tensors are listed by ``specs`` (in order; tied names
        grouped) and arrive in ``buckets`` in that order, each tensor under every one of its
        names. Same contract as :meth:`WeightSender.publish` otherwise; the sender may keep
        no reference to a bucket once it asked for the next one."""
        ...


@dataclasses.dataclass(frozen=True)
class SyncTimes:
    """One publish, as its sender timed it."""

    version: int
    publish_s: float
    """How long ``publish`` held the trainer (gathering and packing included)."""
    transfer_s: float
    """From the first byte sent until every current receiver held the version."""
    nbytes: int
    """Bytes of the version (each tied tensor once)."""


def sync_metrics(sender: object) -> dict[str, float]:
    """The newest publish's times as step metrics (``weights_publish_s``,
    ``weights_transfer_s``); empty for a sender that does not time itself."""
    sync = getattr(sender, "last_sync", None)
    if not isinstance(sync, SyncTimes):
        return {}
    return {"weights_publish_s": sync.publish_s, "weights_transfer_s": sync.transfer_s}


class SyncClock:
    """Times one publish into a :class:`SyncTimes` (``start`` is when ``publish`` began)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first_byte: float | None = None

    def sending(self) -> None:
        """The first byte leaves now (later calls keep the first time)."""
        if self.first_byte is None:
            self.first_byte = time.perf_counter()

    def done(self, version: int, nbytes: int) -> SyncTimes:
        now = time.perf_counter()
        first = self.first_byte if self.first_byte is not None else now
        return SyncTimes(version, now - self.start, now - first, nbytes)


def publish_stream(
    sender: WeightSender,
    specs: Sequence[StateSpec],
    buckets: Iterable[Mapping[str, torch.Tensor]],
    version: int,
) -> None:
    """Publish a version that arrives a bucket at a time (a sharded trainer's
    ``state_buckets``): through the sender's ``publish_buckets`` where it has one, else
    collected into one state in host memory and published whole.

    ``buckets`` is iterated to its end even when publishing fails, because each bucket is a
    collective gather every rank of a sharded trainer takes part in; then the error is raised.
    """
    iterator = iter(buckets)
    try:
        if isinstance(sender, BucketSender):
            sender.publish_buckets(specs, iterator, version)
            return
        state: dict[str, torch.Tensor] = {}
        for bucket in iterator:
            hosted: dict[int, torch.Tensor] = {}
            for name, tensor in bucket.items():
                key = id(tensor)
                if key not in hosted:
                    hosted[key] = tensor.detach().to("cpu")
                state[name] = hosted[key]
        sender.publish(state, version)
    finally:
        _drain(iterator)


def _drain(iterator: Iterator[Any]) -> None:
    for _ in iterator:
        pass


@runtime_checkable
class WeightReceiver(Protocol):
    """A generator host's end (one per host incarnation).

    The host's weight follower polls :meth:`newest` or blocks in :meth:`wait_newer`, and at
    its engine's next micro-batch boundary loads ``get(v)`` into the engine (copying), then
    calls ``release(v)``. Every method is thread-safe and bounded.
    """

    def newest(self) -> int:
        """The newest version :meth:`get` can return now; -1 when none arrived yet."""
        ...

    def wait_newer(self, version: int, timeout_s: float) -> int:
        """Block until a version newer than ``version`` is available or ``timeout_s`` passes;
        return :meth:`newest` either way (the caller compares)."""
        ...

    def get(self, version: int) -> Mapping[str, torch.Tensor]:
        """The state of ``version`` as tensors in host memory (device memory for ``ipc``),
        which the caller copies from
        (into an engine's parameters) and never writes to (they may be shared with other
        receivers or served to newcomers); valid until ``release(version)``. Tied weights are
        views of the same bytes. Pins ``version``: it is kept (not freed when superseded)
        until released. Raises :class:`VersionError` when ``version`` is not available: only
        the newest and the pinned versions are."""
        ...

    def release(self, version: int) -> None:
        """Unpin ``version`` (each ``get`` needs one ``release``); a superseded version is
        freed once unpinned. Releasing a version that is not pinned does nothing."""
        ...

    def close(self) -> None:
        """Leave the transport and release every resource; idempotent."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """A transport's configuration and factory: small and picklable (it is passed to Ray
    actors and spawned processes), so it holds addresses and options, never live objects."""

    name: str
    """The registry name (``make_transport(name)``)."""

    def sender(self) -> WeightSender:
        """The trainer's end; called once, in the trainer's rank-0 process."""
        ...

    def receiver(self, member: str) -> WeightReceiver:
        """A generator host's end; ``member`` names this host incarnation uniquely."""
        ...


_TRANSPORTS: dict[str, Callable[..., WeightTransport]] = {}
T = TypeVar("T", bound=type)


def register_transport(name: str) -> Callable[[T], T]:
    """Class decorator: ``make_transport(name, **options)`` builds ``cls(**options)``."""

    def add(cls: T) -> T:
        if name in _TRANSPORTS:
            raise ValueError(f"weight transport {name!r} is already registered")
        _TRANSPORTS[name] = cls
        return cls

    return add


def transport_names() -> list[str]:
    """The registered transport names, sorted."""
    return sorted(_TRANSPORTS)


def make_transport(name: str, **options: Any) -> WeightTransport:
    """The transport registered as ``name``, configured with ``options`` (its fields)."""
    if name not in _TRANSPORTS:
        raise ValueError(
            f"unknown weight transport {name!r}; known: {', '.join(transport_names())}"
        )
    cls = _TRANSPORTS[name]
    if dataclasses.is_dataclass(cls):
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(
                f"weight transport {name!r} has no option {unknown[0]!r}; "
                f"options: {', '.join(known)}"
            )
    return cls(**options)


def check_version(version: object, newest: int) -> int:
    """``version`` as an int if it may be published after ``newest``, else :class:`VersionError`."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionError(f"version must be an int, got {type(version).__name__} {version!r}")
    if version < 0:
        raise VersionError(f"version must be >= 0, got {version}")
    if version <= newest:
        raise VersionError(
            f"version must be newer than the last published version {newest}, got {version}"
        )
    return version


def check_state(state: object) -> Mapping[str, torch.Tensor]:
    """``state`` if every entry is a dense tensor with values under a string key, else
    :class:`StateError` naming the first bad entry."""
    if not isinstance(state, Mapping):
        raise StateError(
            f"state must be a mapping of name -> torch.Tensor, got {type(state).__name__}"
        )
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise StateError(f"state keys must be str, got {type(name).__name__} {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise StateError(f"state[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type == "meta":
            raise StateError(
                f"state[{name!r}] is on the meta device and has no values to send; "
                "materialize the model (e.g. to_empty + load) before publishing"
            )
        if tensor.layout != torch.strided:
            raise StateError(
                f"state[{name!r}] has layout {tensor.layout}, expected torch.strided; "
                "send .to_dense()"
            )
    return state
