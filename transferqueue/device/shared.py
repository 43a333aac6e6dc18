"""Device columns that stay with their producer: read by other processes of the node by handle.

``put(data, share=["hidden"])`` does not copy the ``hidden`` column anywhere: the producer's
handle keeps the tensor (:class:`DeviceExporter`) and TransferQueue stores, per row, a small
*reference* (an object cell: the exporter's address, the put's key, the row). A reader's
``get_data`` finds the references and asks the exporter for a handle of the tensor
(:mod:`transferqueue.device.sharing`: CUDA IPC on a GPU), maps it, copies its rows into memory
of its own (device to device) and lets the mapping go (:class:`DeviceImporter`); a reader that
cannot map it (its process does not see that GPU) asks for the rows' bytes instead.

| event                                   | what happens to the tensor                        |
|-----------------------------------------|---------------------------------------------------|
| every declared task acked its rows      | the exporter sees them freed (it polls the rows'  |
| (the rows are freed)                    | status) and drops the tensor                      |
| the partition is cleared                | the same                                          |
| the producer's process dies             | the tensor dies with it: a reader's request finds |
|                                         | no exporter, the rows' groups are retired (gone   |
|                                         | from every task's queue and lease) and the read   |
|                                         | raises ``RowsLostError``, as with a dead unit     |

One export per request (a CUDA IPC handle carries one reference count: one opener each), so
any number of readers, each reading when it likes. Same node only: across nodes put the
column as usual (the host path).

Exporter protocol (ZeroMQ DEALER -> ROUTER, msgpack; ``export`` answers a handle, ``rows``
answers the rows' bytes as a second frame)::

    {"op": "export", "key": k}            -> {"ok": true, "handle": {...}}
    {"op": "rows", "key": k, "rows": [i]} -> {"ok": true, "dtype": d, "shape": s} + bytes
    (an unknown key)                      -> {"ok": false, "error": "..."}
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zmq

from transferqueue.device.sharing import SharingError, TensorSharer, make_sharer
from transferqueue.sched import zmq_in_batch

__all__ = ["REF", "DeviceExporter", "DeviceImporter", "ProducerGoneError", "is_ref_column"]

log = logging.getLogger(__name__)

REF = "__tq_device__"
"""The key that marks a row's reference to a shared device column (value: format, 1)."""
HOST = socket.gethostname()


class ProducerGoneError(RuntimeError):
    """The exporter of some rows' shared column is gone (its process died): ``positions`` are
    the rows (of the column read) whose values went with it."""

    def __init__(self, message: str, positions: np.ndarray) -> None:
        super().__init__(message)
        self.positions = positions


def is_ref_column(col: object) -> bool:
    """Whether an object column holds references to a shared device column."""
    return bool(isinstance(col, list) and col and isinstance(col[0], dict) and col[0].get(REF) == 1)


@dataclass
class _Kept:
    tensor: torch.Tensor
    partition: str | None = None  # known once the put's rows are
    indexes: np.ndarray | None = None


def _encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


class DeviceExporter:
    """Keeps shared columns and answers readers (see the module doc). ``live_rows(partition)``
    gives the partition's live row indexes (the controller's ``status``); it is called from
    the exporter's poll thread every ``poll_s`` while it keeps a column."""

    def __init__(
        self,
        live_rows: Callable[[str], np.ndarray],
        *,
        sharer: str | None = None,
        poll_s: float = 1.0,
    ) -> None:
        name = sharer or ("cuda" if torch.cuda.is_available() else "file")
        self._sharer: TensorSharer = make_sharer(name)
        self._live_rows = live_rows
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._kept: dict[str, _Kept] = {}
        self._ctx = zmq.Context()
        zmq_in_batch(self._ctx)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://@tq-device-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, name="tq-device-exporter", daemon=True),
            threading.Thread(target=self._poll, name="tq-device-liveness", daemon=True),
        ]
        self._finalizer = weakref.finalize(self, _stop, self._stop, self._threads, self._ctx)
        for t in self._threads:
            t.start()

    @property
    def kept(self) -> int:
        """Columns kept now."""
        with self._lock:
            return len(self._kept)

    def share(self, tensor: torch.Tensor) -> tuple[str, list[dict[str, Any]]]:
        """Keep ``tensor`` (rows on its first axis; made contiguous) and return its key and
        one reference per row (the object cells to put)."""
        if tensor.dim() == 0:
            raise ValueError("a shared column needs a row axis")
        kept = tensor.detach().contiguous()
        key = uuid.uuid4().hex
        with self._lock:
            self._kept[key] = _Kept(kept)
        base = {
            REF: 1,
            "address": self.address,
            "key": key,
            "pid": os.getpid(),
            "host": HOST,
            "dtype": str(kept.dtype).removeprefix("torch."),
            "shape": [int(d) for d in kept.shape[1:]],
        }
        return key, [{**base, "row": i} for i in range(int(kept.shape[0]))]

    def bind(self, key: str, partition: str, indexes: np.ndarray) -> None:
        """The rows ``key``'s references were put into: its tensor lives while any does."""
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                kept.partition, kept.indexes = partition, np.asarray(indexes, dtype=np.int64)

    def drop(self, key: str) -> None:
        with self._lock:
            self._kept.pop(key, None)
        self._sharer.collect()

    def close(self) -> None:
        self._finalizer()
        with self._lock:
            self._kept.clear()

    # -- threads ------------------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(200)):
                continue
            try:
                identity, frame = self._sock.recv_multipart(zmq.NOBLOCK)
                msg = msgpack.unpackb(frame, raw=False)
                frames = self._answer(msg)
            except zmq.ZMQError:
                continue
            except Exception as e:  # a bad request never stops the exporter
                frames = [_encode({"ok": False, "error": f"{type(e).__name__}: {e}"})]
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart([identity, *frames], copy=False)

    def _answer(self, msg: dict[str, Any]) -> list[Any]:
        with self._lock:
            kept = self._kept.get(str(msg.get("key")))
        if kept is None:
            return [_encode({"ok": False, "error": f"no column {msg.get('key')!r} kept here"})]
        if msg.get("op") == "export":
            return [_encode({"ok": True, "handle": self._sharer.export(kept.tensor)})]
        rows = torch.as_tensor(np.asarray(msg["rows"], dtype=np.int64), device=kept.tensor.device)
        host = kept.tensor.index_select(0, rows).cpu().contiguous()
        meta = {
            "ok": True,
            "dtype": str(host.dtype).removeprefix("torch."),
            "shape": list(host.shape),
        }
        return [_encode(meta), host.reshape(-1).view(torch.uint8).numpy().tobytes()]

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                bound = {k: v for k, v in self._kept.items() if v.partition is not None}
            for partition in {v.partition for v in bound.values()}:
                try:
                    live = self._live_rows(str(partition))
                except Exception as e:  # the controller away a moment: ask again later
                    log.debug("shared columns: status of %r failed: %s", partition, e)
                    continue
                for key, kept in bound.items():
                    rows = kept.indexes if kept.partition == partition else None
                    if rows is not None and not np.isin(rows, live).any():  # all freed
                        self.drop(key)


def _stop(stop: threading.Event, threads: list[threading.Thread], ctx: zmq.Context[Any]) -> None:
    stop.set()
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=5)
    ctx.destroy(linger=0)


class DeviceImporter:
    """A reader's end: resolves reference columns into tensors of its own."""

    def __init__(self, *, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        zmq_in_batch(self._ctx)
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self._ctx.destroy, 0)

    def close(self) -> None:
        self._finalizer()

    def resolve(self, refs: Sequence[dict[str, Any]], device: torch.device | None) -> torch.Tensor:
        """The rows ``refs`` point to, as one tensor ``[len(refs), ...]`` on ``device`` (None:
        the GPU the rows live on, as this process sees it; the host for host columns).
        Raises :class:`ProducerGoneError` naming the rows whose exporter is gone."""
        first = refs[0]
        dtype = getattr(torch, first["dtype"])
        shape = tuple(first["shape"])
        groups: dict[tuple[str, str], list[int]] = {}
        for pos, ref in enumerate(refs):
            groups.setdefault((ref["address"], ref["key"]), []).append(pos)
        out: torch.Tensor | None = None
        gone: list[int] = []
        for (address, key), positions in groups.items():
            rows = [int(refs[p]["row"]) for p in positions]
            pid, host = int(refs[positions[0]]["pid"]), refs[positions[0]]["host"]
            try:
                part = self._fetch(address, key, rows, device, pid, host)
            except ProducerGoneError:
                gone += positions
                continue
            if out is None:
                out = torch.empty((len(refs), *shape), dtype=dtype, device=part.device)
            index = torch.as_tensor(positions, device=out.device)
            out.index_copy_(0, index, part.to(out.device))
        if gone:
            raise ProducerGoneError(
                f"the producer of {len(gone)} rows' shared column is gone (its process "
                "ended): the rows went with it",
                np.asarray(sorted(gone), dtype=np.int64),
            )
        assert out is not None
        if out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return out

    def _fetch(
        self,
        address: str,
        key: str,
        rows: list[int],
        device: torch.device | None,
        pid: int,
        host: str,
    ) -> torch.Tensor:
        if host == HOST and not _alive(pid):
            raise ProducerGoneError(f"exporter pid {pid} has ended", np.empty(0, np.int64))
        reply, frames = self._ask(address, {"op": "export", "key": key}, pid, host)
        handle = reply["handle"]
        try:
            sharer = make_sharer(handle["kind"])
            mapped = sharer.open(handle)
        except SharingError:  # this process cannot map it: the rows' bytes instead
            reply, frames = self._ask(address, {"op": "rows", "key": key, "rows": rows}, pid, host)
            flat = torch.frombuffer(bytearray(frames[0]), dtype=torch.uint8)
            data = flat.view(getattr(torch, reply["dtype"])).view(tuple(reply["shape"]))
            return data if device is None else data.to(device)
        try:
            target = mapped.device if device is None else device
            first = rows[0]
            if rows == list(range(first, first + len(rows))):  # one run: a plain copy
                mine = mapped[first : first + len(rows)].to(target, copy=True)
            else:
                index = torch.as_tensor(rows, device=mapped.device)
                mine = mapped.index_select(0, index).to(target)  # rows of our own
            for used in {mapped.device, mine.device}:  # done before the mapping goes
                if used.type == "cuda":
                    torch.cuda.synchronize(used)
            return mine
        finally:
            if handle["kind"] == "file":
                sharer.retire(handle)  # (the exporter made it for us alone)
            del mapped

    def _ask(
        self, address: str, msg: dict[str, Any], pid: int, host: str
    ) -> tuple[dict[str, Any], list[bytes]]:
        with self._lock:
            sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            sock.send(_encode(msg))
            deadline = time.monotonic() + self.timeout_s
            while not sock.poll(200):
                if (host == HOST and not _alive(pid)) or time.monotonic() > deadline:
                    raise ProducerGoneError(
                        f"the exporter at {address} did not answer within {self.timeout_s} s",
                        np.empty(0, np.int64),
                    )
            reply_frame, *frames = sock.recv_multipart()
        finally:
            sock.close()
        reply = msgpack.unpackb(reply_frame, raw=False)
        if not reply.get("ok"):
            # a key the exporter no longer keeps: the rows were freed (or never bound)
            raise ProducerGoneError(str(reply.get("error")), np.empty(0, np.int64))
        return reply, frames


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
