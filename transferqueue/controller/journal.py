"""The controller's state on disk: a snapshot plus an append-only log of its calls.

A controller started with a ``state_dir`` survives its own death (SIGKILL included): every
call that changes its core (:class:`~transferqueue.controller.journaled.JournaledController`)
appends one record to the log before the service replies, and a restarted controller loads the last
snapshot and replays the log after it. The directory (mode 0700, the controller's alone)::

    snapshot          the core at one instant, and the first log segment after it
    log.000000000007  records, in order: [u32 length | u32 crc32 | msgpack record]

A record is ``[method, clock, lease ids drawn, failed, args, kwargs]``: the method's name,
the clock value the call saw, the random lease ids it drew (replayed as they were), whether
it raised (replayed, it must raise again), its arguments (numpy arrays and field specs as
msgpack extensions). Each record reaches the OS in one ``write``: a process killed at any
point leaves every record of a call that was answered. What a *host* crash keeps depends on
``fsync``:

| fsync    | a record is on disk                    | a host crash loses               |
|----------|----------------------------------------|----------------------------------|
| never    | when the OS writes it back              | the last ~30 s of calls           |
| batch    | at the service's next tick (<= 0.5 s)   | calls answered in the last 0.5 s  |
| always   | before the call is answered             | nothing answered                  |

A snapshot is taken every ``snapshot_records`` records or ``snapshot_s`` seconds (at the
service's tick, between calls) and at a clean shutdown: the log moves to a new segment, the
core is pickled (protocol 5, its arrays as out-of-band buffers) into a temporary file that
is fsynced and renamed over ``snapshot``, then older segments are deleted. Pickle is used
because the core's object graph (samplers and their queues, leases, loss logs) is restored
exactly with no per-class code; it is safe here because only the controller's own files in
its own 0700 directory are ever loaded (anyone able to write there controls the service
already), and a snapshot of another format version is refused with a
:class:`~transferqueue.errors.CheckpointError` naming the directory and the fix.
"""

from __future__ import annotations

import fcntl
import functools
import os
import pickle
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import msgspec
import numpy as np

from transferqueue.controller.fsync import FSYNC_POLICIES
from transferqueue.errors import CheckpointError
from transferqueue.schema import FieldSpec
from transferqueue.wire.replies import TaskImport

__all__ = [
    "FORMAT_VERSION",
    "FSYNC_POLICIES",
    "Journal",
    "JournalSettings",
    "Record",
    "Recorder",
    "decode_record",
    "encode_record",
    "journaled",
    "journaled_methods",
    "read_records",
    "read_snapshot",
]

FORMAT_VERSION = 5  # 2: copy plans (header "copying", unit_epochs); 3: the core in parts;
# 4: the loss log of each partition (rows lost before a task's first poll count for it);
# 5: field specs per partition
SNAPSHOT = "snapshot"
_LOG = "log."
_MAGIC = b"TQCTLST\0"
_SNAP_HEAD = struct.Struct("<8sIQIQ")  # magic, version, next segment, buffers, pickle bytes
_REC_HEAD = struct.Struct("<II")  # record length, crc32 of the record
_EXT_ARRAY, _EXT_SPEC, _EXT_TASK = 1, 2, 3

Record = tuple[str, float, list[int], bool, list[Any], dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class JournalSettings:
    """How a controller keeps its state (see the module): ``fsync`` policy, and when a
    snapshot replaces the log (``snapshot_records`` records or ``snapshot_s`` seconds)."""

    fsync: str = "batch"
    snapshot_records: int = 100_000
    snapshot_s: float = 300.0

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if not isinstance(self.snapshot_records, int) or self.snapshot_records < 1:
            raise ValueError(f"snapshot_records must be >= 1, got {self.snapshot_records!r}")
        if not isinstance(self.snapshot_s, int | float) or not self.snapshot_s > 0:
            raise ValueError(f"snapshot_s must be a positive number, got {self.snapshot_s!r}")


# -- which calls are recorded --------------------------------------------------------------
P = ParamSpec("P")
T = TypeVar("T")


class Recorder(Protocol):
    """What records the calls of a journaled controller
    (:class:`~transferqueue.controller.journaled.Recording`)."""

    def call(
        self,
        name: str,
        run: Callable[..., T],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fingerprint: Callable[[], Any] | None,
    ) -> T: ...


class _Part(Protocol):
    recorder: Recorder | None


S = TypeVar("S", bound=_Part)


def journaled(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
    """Mark a method of a part of the controller core that changes the core: a journaled
    controller records each outermost call of it under the method's name (a call from
    another marked method is part of that one's record). Its part has a ``recorder``
    attribute (None: nothing is recorded, the method runs as it is)."""
    return _marked(method, None)


def journaled_unless_same(
    fingerprint: Callable[[S], Any],
) -> Callable[[Callable[Concatenate[S, P], T]], Callable[Concatenate[S, P], T]]:
    """:func:`journaled`, but a call that leaves ``fingerprint(part)`` as it was and raised
    nothing is not recorded (a timer's call that found nothing due)."""

    def mark(method: Callable[Concatenate[S, P], T]) -> Callable[Concatenate[S, P], T]:
        return _marked(method, fingerprint)

    return mark


def _marked(
    method: Callable[Concatenate[S, P], T], fingerprint: Callable[[S], Any] | None
) -> Callable[Concatenate[S, P], T]:
    name = method.__name__

    @functools.wraps(method)
    def call(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        recorder = self.recorder
        if recorder is None:
            return method(self, *args, **kwargs)
        fp = None if fingerprint is None else functools.partial(fingerprint, self)
        return recorder.call(name, functools.partial(method, self), args, kwargs, fp)

    call.__journaled__ = name  # type: ignore[attr-defined]
    return call


def journaled_methods(part: object) -> dict[str, Callable[..., Any]]:
    """The methods of ``part`` marked :func:`journaled`, bound, by name."""
    out = {}
    for cls in reversed(type(part).__mro__):
        for attr, value in vars(cls).items():
            name = getattr(value, "__journaled__", None)
            if name is not None:
                out[name] = getattr(part, attr)
    return out


# -- records ---------------------------------------------------------------------------------
def _array(arr: np.ndarray) -> msgspec.msgpack.Ext:
    if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        arr = arr.copy(order="C")
    return msgspec.msgpack.Ext(_EXT_ARRAY, _enc.encode([arr.dtype.str, list(arr.shape), arr.data]))


def _hook(value: Any) -> Any:
    """msgpack for what it has no type of: numpy arrays and scalars."""
    if isinstance(value, np.ndarray):
        return _array(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a journal record cannot hold {type(value).__name__}")


def _pre(value: Any) -> Any:
    """``value`` with field specs and task imports as msgpack extensions (msgpack would
    write them as plain maps and lists; only register_fields and loads carry them)."""
    if isinstance(value, FieldSpec):
        spec: list[Any] = [value.kind, value.dtype, list(value.shape)]
        if value.ndim:
            spec.append(value.ndim)  # (shaped fields; older journals have three items)
        return msgspec.msgpack.Ext(_EXT_SPEC, _enc.encode(spec))
    if isinstance(value, TaskImport):
        parts = [getattr(value, f) for f in value.__struct_fields__]
        return msgspec.msgpack.Ext(_EXT_TASK, _enc.encode(parts))
    if isinstance(value, dict):
        return {k: _pre(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_pre(v) for v in value]
    return value


def _ext(code: int, data: memoryview) -> Any:
    if code == _EXT_ARRAY:
        dtype, shape, raw = _dec.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _EXT_SPEC:
        kind, dtype, shape, *ndim = _dec.decode(data)
        return FieldSpec(kind, dtype, tuple(shape), *ndim)
    if code == _EXT_TASK:
        return TaskImport(*_dec.decode(data))
    raise CheckpointError(f"a journal record holds an unknown extension type {code}")


_enc = msgspec.msgpack.Encoder(enc_hook=_hook)
_TYPED = ("register_fields", "import_tasks")  # (the calls whose arguments need _pre)
_dec = msgspec.msgpack.Decoder(ext_hook=_ext)


def encode_record(rec: Record) -> bytes:
    """One record as it is appended: length, crc32, msgpack."""
    body = _enc.encode(_pre(list(rec)) if rec[0] in _TYPED else rec)
    return _REC_HEAD.pack(len(body), zlib.crc32(body)) + body


def decode_record(body: bytes | memoryview) -> Record:
    name, clock, ids, failed, args, kwargs = _dec.decode(body)
    return name, clock, ids, failed, args, kwargs


def read_records(path: str, *, repair: bool = False) -> Iterator[Record]:
    """The records of one log segment, in order. A torn or corrupt last record (a process
    killed in the middle of a write) ends the segment; with ``repair`` the file is cut there,
    so that new records do not follow garbage."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos + _REC_HEAD.size <= len(data):
        n, crc = _REC_HEAD.unpack_from(data, pos)
        body = memoryview(data)[pos + _REC_HEAD.size : pos + _REC_HEAD.size + n]
        if len(body) < n or zlib.crc32(body) != crc:
            break
        yield decode_record(body)
        pos += _REC_HEAD.size + n
    if pos < len(data) and repair:
        with open(path, "r+b") as f:
            f.truncate(pos)


# -- the directory ---------------------------------------------------------------------------
def _segments(state_dir: str) -> list[int]:
    seqs = []
    for name in os.listdir(state_dir):
        if name.startswith(_LOG) and name[len(_LOG) :].isdigit():
            seqs.append(int(name[len(_LOG) :]))
    return sorted(seqs)


def _segment_path(state_dir: str, seq: int) -> str:
    return os.path.join(state_dir, f"{_LOG}{seq:012d}")


def read_snapshot(state_dir: str) -> tuple[Any, int] | None:
    """The pickled core of the last snapshot and the first log segment after it; None when
    the directory has no snapshot yet."""
    path = os.path.join(state_dir, SNAPSHOT)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        head = f.read(_SNAP_HEAD.size)
        if len(head) < _SNAP_HEAD.size or head[:8] != _MAGIC:
            raise CheckpointError(
                f"{path} is not a TransferQueue controller snapshot; point state_dir at a "
                "directory only the controller writes, or an empty one"
            )
        _, version, next_seq, nbufs, nbytes = _SNAP_HEAD.unpack(head)
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"state_dir {state_dir} holds a controller snapshot of format version "
                f"{version}, this TransferQueue reads version {FORMAT_VERSION}; start the "
                "controller with the TransferQueue version that wrote it, or with an empty "
                "state_dir (its rows are then forgotten)"
            )
        sizes = struct.unpack(f"<{nbufs}Q", f.read(8 * nbufs))
        body = f.read(nbytes)
        buffers = []
        for size in sizes:
            buf = bytearray(size)
            if f.readinto(buf) != size:
                raise CheckpointError(f"{path} is truncated; it was not written by a rename")
            buffers.append(buf)
    if len(body) != nbytes:
        raise CheckpointError(f"{path} is truncated; it was not written by a rename")
    return pickle.loads(body, buffers=buffers), next_seq


class Journal:
    """The log a journaled controller appends to, and its snapshots (see the module)."""

    def __init__(self, state_dir: str | os.PathLike[str], settings: JournalSettings) -> None:
        self.state_dir = os.fspath(state_dir)
        self.settings = settings
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        os.chmod(self.state_dir, 0o700)  # (the controller's alone: see the module)
        # One controller per directory: a second one appending would garble the log. The
        # kernel drops the lock with its process, however it dies.
        self._lock: int | None = os.open(
            os.path.join(self.state_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600
        )
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise CheckpointError(
                f"state_dir {self.state_dir} is in use by another running controller; give "
                "each controller its own directory"
            ) from None
        self._fd: int | None = None
        self.seq = 0
        self.records = 0  # since the last snapshot
        self.appended = 0  # over this journal's life
        self._dirty = False
        self._snapshot_at = time.monotonic()
        self.last_snapshot_s = 0.0  # how long the last snapshot took

    def segments_from(self, first: int) -> list[str]:
        """The paths of the log segments numbered ``first`` or later, in order."""
        return [_segment_path(self.state_dir, s) for s in _segments(self.state_dir) if s >= first]

    def has_state(self) -> bool:
        return os.path.exists(os.path.join(self.state_dir, SNAPSHOT))

    def open_segment(self, seq: int) -> None:
        """Append from now on to segment ``seq`` (the current one is synced and closed)."""
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd = os.open(_segment_path(self.state_dir, seq), flags, 0o600)
        self.seq = seq

    def append(self, rec: Record) -> None:
        """Write one record with one ``write`` (it survives the process), then sync it as
        the fsync policy says."""
        if self._fd is None:
            raise CheckpointError(f"the journal in {self.state_dir} is closed")
        data = encode_record(rec)
        view = memoryview(data)
        while view:  # (a regular file takes it whole; a short write goes on where it ended)
            view = view[os.write(self._fd, view) :]
        self.records += 1
        self.appended += 1
        if self.settings.fsync == "always":
            os.fsync(self._fd)
        else:
            self._dirty = True

    def sync(self) -> None:
        """Flush appended records to disk (the service's tick, with ``fsync="batch"``)."""
        if self._fd is not None and self._dirty and self.settings.fsync != "never":
            os.fsync(self._fd)
        self._dirty = False

    def snapshot_due(self) -> bool:
        s = self.settings
        return self.records >= s.snapshot_records or (
            self.records > 0 and time.monotonic() - self._snapshot_at >= s.snapshot_s
        )

    def snapshot(self, core: Any) -> None:
        """Write ``core`` as the snapshot, atomically, and drop the log before it."""
        t0 = time.perf_counter()
        nxt = self.seq + 1
        self.open_segment(nxt)  # (records from now on follow the snapshot)
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps(core, protocol=5, buffer_callback=buffers.append)
        raws = [b.raw() for b in buffers]
        path = os.path.join(self.state_dir, SNAPSHOT)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb", closefd=True) as f:
                f.write(_SNAP_HEAD.pack(_MAGIC, FORMAT_VERSION, nxt, len(raws), len(body)))
                f.write(struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)))
                f.write(body)
                for r in raws:
                    f.write(r)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(self.state_dir)
        for seq in _segments(self.state_dir):
            if seq < nxt:
                os.unlink(_segment_path(self.state_dir, seq))
        self.records = 0
        self._snapshot_at = time.monotonic()
        self.last_snapshot_s = time.perf_counter() - t0

    def close(self) -> None:
        self.sync()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            os.close(self._lock)  # (and so the directory's lock)
            self._lock = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
