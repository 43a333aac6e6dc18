"""Same-host shared memory for the data plane.

When a client and a storage unit run on the same host, column buffers need not cross a
socket: the client copies them into a shared-memory *arena* it owns and the message carries
``[arena name, offset]`` in place of a frame (see :mod:`transferqueue.wire`). The unit copies
straight from the arena into its buffers; on a read it copies the rows into the arena and the
client copies them out. That is two ``memcpy`` per leg instead of a socket's send, the
kernel's copies and the receiver's page faults: on the reference machine a 300 MB leg took
~0.16 s this way against ~0.46 s over ZeroMQ loopback.

How an arena comes to be shared:

1. The client creates ``/dev/shm/tq-<token>-<generation>``, reserves its pages with
   ``posix_fallocate`` (so a full ``/dev/shm`` is an error now, never a ``SIGBUS`` later) and
   maps it.
2. It asks the unit to ``shm_attach`` it. The unit maps the file by name, and removes the
   name, so nothing is left in ``/dev/shm`` when either process dies; the pages live as long
   as one of the two mappings does. A unit on another host (or one that cannot open the file)
   answers with an error and the client sends frames to that unit from then on.
3. One request at a time uses an arena (a second concurrent request to the same unit sends
   frames). An arena grows by replacing it with a larger one (a new generation); the unit
   drops the old mapping when the new one is attached.

Nothing in the arena is trusted: the unit only resolves names it has attached and checks
every offset against the mapping's size.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import secrets
from collections import OrderedDict

import numpy as np

from transferqueue.errors import ProtocolError

__all__ = ["SHM_DIR", "Arena", "Placer", "Segments", "shm_available"]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN = 64  # every placed buffer starts on a cache line (and so is aligned for any dtype)
_NAME = re.compile(r"tq-([0-9a-f]{16})-([0-9]{1,9})")


def shm_available(directory: str = SHM_DIR) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A shared-memory segment owned by a client (one per storage unit it talks to)."""

    def __init__(self, token: str, generation: int, size: int, directory: str = SHM_DIR):
        self.name = f"tq-{token}-{generation}"
        self.size = size
        self.busy = False
        self._path = os.path.join(directory, self.name)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)

    def unlink(self) -> None:
        """Remove the name (the unit does so once it has mapped it; this is the fallback)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ProtocolError(
                f"reply names bytes {offset}..{offset + nbytes} of arena {self.name}, "
                f"which holds {self.size}"
            )
        return self.buf[offset : offset + nbytes].data

    def resolve(self, name: str, offset: int, nbytes: int) -> memoryview:
        if name != self.name:
            raise ProtocolError(f"reply names shared-memory arena {name!r}; ours is {self.name}")
        return self.view(offset, nbytes)

    def close(self) -> None:
        self.unlink()
        self.buf = np.empty(0, dtype=np.uint8)
        # Views handed out keep the mapping alive; it is unmapped when the last one goes.
        with contextlib.suppress(BufferError):
            self._map.close()


class Placer:
    """Copies buffers into an arena region, one after the other, while they fit."""

    def __init__(self, name: str, region: np.ndarray) -> None:
        self.name = name
        self.region = region
        self.used = 0  # bytes of the region taken (aligned)
        self.overflow = 0  # payload bytes that did not fit (they go as frames)

    def __call__(self, raw: memoryview) -> list[str | int] | None:
        n = raw.nbytes
        start = self.used
        if start + n > self.region.size:
            self.overflow += n
            return None
        self.region[start : start + n] = np.frombuffer(raw, dtype=np.uint8)
        self.used = _align(start + n)
        return [self.name, start]


def new_token() -> str:
    return secrets.token_hex(8)


class Segments:
    """The arenas a storage unit has attached, by client token (bounded, oldest dropped)."""

    def __init__(self, directory: str = SHM_DIR, max_clients: int = 256) -> None:
        self.directory = directory
        self.max_clients = max_clients
        self._by_token: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()

    def attach(self, name: str) -> int:
        """Map the client's arena ``name`` and remove its file; returns its size."""
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ProtocolError(f"{name!r} is not a TransferQueue arena name")
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise ProtocolError(
                f"cannot open shared-memory arena {name} ({e.strerror}); the client is on "
                "another host or cannot share memory with this unit, and sends frames instead"
            ) from None
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size) if size else None
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if mapped is None:
            raise ProtocolError(f"shared-memory arena {name} is empty")
        token = m.group(1)
        self._by_token.pop(token, None)  # an older generation of this client's arena
        self._by_token[token] = (name, np.frombuffer(mapped, dtype=np.uint8))
        while len(self._by_token) > self.max_clients:
            self._by_token.popitem(last=False)
        return size

    def detach(self, name: str) -> None:
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is not None:
            entry = self._by_token.get(m.group(1))
            if entry is not None and entry[0] == name:
                del self._by_token[m.group(1)]

    def region(self, name: str, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        buf = self._buffer(name)
        end = buf.size if nbytes is None else offset + nbytes
        if not isinstance(offset, int) or offset < 0 or end > buf.size or end < offset:
            raise ProtocolError(
                f"bytes {offset}..{end} are outside shared-memory arena {name} ({buf.size} bytes)"
            )
        return buf[offset:end]

    def resolve(self, name: str, offset: int, nbytes: int) -> memoryview:
        return self.region(name, offset, nbytes).data

    def _buffer(self, name: str) -> np.ndarray:
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        entry = self._by_token.get(m.group(1)) if m is not None else None
        if entry is None or entry[0] != name:
            raise ProtocolError(f"shared-memory arena {name!r} is not attached to this unit")
        self._by_token.move_to_end(m.group(1))  # type: ignore[union-attr]
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_token)
