"""Same-host shared memory for the data plane.

When a client and a storage unit run on the same host, column buffers need not cross a socket:
the client copies them into a shared-memory *arena* it owns and the message carries ``[arena
name, offset]`` in place of a frame (see :mod:`transferqueue.wire.codec`). The unit copies straight
from the arena into its buffers, except the ragged values of a write placed in a *write arena*
(:class:`WriteArenas`): those it keeps as views of the arena until the rows are freed, and the
client writes into that arena again only once the unit has cleared its flag (:class:`Kept`). A
client may copy a put into a write arena before it knows the put's rows (while the controller
allocates them) and give the arena back if the rows go to another unit
(:meth:`WriteArenas.unlend`). On a read the unit copies the rows into an arena *lent* to that
read (:class:`ReadArenas`), and the tensors the client returns are views of it: the arena is
lent again only once the last of them is gone; ragged values the reader itself wrote from a
write arena are not copied at all, but named where they are, and the client hands out
copy-on-write views of its own arena (:meth:`WriteArenas.view`). That is two ``memcpy`` for a
write and one for a read (none for a writer's own ragged values), instead of a socket's send,
the kernel's copies and the receiver's page faults: on the reference machine a 300 MB leg took
~0.16 s this way against ~0.46 s over ZeroMQ loopback. When every lendable arena is still
viewed by results the caller holds, a read lands in the client's request arena and is copied
out.

How an arena comes to be shared:

1. The client creates ``/dev/shm/tq-<token>-<generation>``, reserves its pages with
   ``posix_fallocate`` (so a full ``/dev/shm`` is an error now, never a ``SIGBUS`` later) and
   maps it.
2. It asks the unit to ``shm_attach`` it. The unit maps the file by name, and removes the
   name, so nothing is left in ``/dev/shm`` when either process dies; the pages live as long
   as one of the two mappings does. A unit on another host (or one that cannot open the file)
   answers with an error and the client sends frames to that unit from then on.
3. One request at a time uses the request arena (a second concurrent request to the same
   unit sends frames). It grows by replacing it with a larger one (a new generation); the
   unit drops the old mapping when the new one is attached. Read and write arenas have
   tokens of their own; the client detaches those it no longer needs.

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
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from transferqueue.errors import ProtocolError, UnknownArenaError

__all__ = [
    "SHM_DIR",
    "WRITE_HEADER",
    "Arena",
    "Kept",
    "Loan",
    "Placer",
    "ReadArenas",
    "Segments",
    "WriteArenas",
    "align",
    "shm_available",
]

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ALIGN = 64  # every placed buffer starts on a cache line (and so is aligned for any dtype)
_NAME = re.compile(r"tq-([0-9a-f]{16})-([0-9]{1,9})")


def shm_available(directory: str = SHM_DIR) -> bool:
    return os.path.isdir(directory) and os.access(directory, os.W_OK)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """A shared-memory segment owned by a client (one per storage unit it talks to).

    ``private``: keep the file open, to hand out copy-on-write views of what the client
    wrote (:meth:`private_view`).
    """

    def __init__(
        self,
        token: str,
        generation: int,
        size: int,
        directory: str = SHM_DIR,
        private: bool = False,
    ):
        self.name = f"tq-{token}-{generation}"
        self.size = size
        self.busy = False
        self._path = os.path.join(directory, self.name)
        self._fd: int | None = None
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now rather than SIGBUS on first touch
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        if private:
            self._fd = fd
        else:
            os.close(fd)
        self.buf = np.frombuffer(self._map, dtype=np.uint8)

    def private_view(self, offset: int, nbytes: int) -> memoryview:
        """Bytes of the arena through a mapping of their own, copy-on-write: they read what
        the arena holds now, and writes to them stay in that mapping (nothing shared, and no
        other view, changes). The mapping goes with the last view of it."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ProtocolError(
                f"reply names bytes {offset}..{offset + nbytes} of arena {self.name}, "
                f"which holds {self.size}"
            )
        if self._fd is None:
            raise ProtocolError(f"arena {self.name} has no private views")
        if nbytes == 0:
            return memoryview(bytearray(0))
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(
            self._fd,
            offset + nbytes - start,
            flags=mmap.MAP_PRIVATE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
            offset=start,
        )
        return np.frombuffer(m, dtype=np.uint8)[offset - start :].data

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        # Views handed out keep the mapping alive; it is unmapped when the last one goes.
        with contextlib.suppress(BufferError):
            self._map.close()


class Placer:
    """Copies buffers into an arena region, one after the other, while they fit.

    ``local``: ``(name, address, size)`` of arenas the receiver owns and can view (a
    client's write arenas, on a read by that client): a buffer lying inside one is named
    where it is, not copied.
    """

    def __init__(
        self,
        name: str,
        region: np.ndarray,
        base: int = 0,
        local: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        self.name = name
        self.region = region
        self.base = base  # offset of the region in the arena (what references name)
        self.local = local
        self.used = 0  # bytes of the region taken (aligned)
        self.overflow = 0  # payload bytes that did not fit (they go as frames)
        self.named = 0  # payload bytes named in the receiver's own arenas

    def __call__(self, raw: memoryview) -> list[str | int] | None:
        n = raw.nbytes
        if self.local:
            address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
            for name, start, size in self.local:
                if start <= address and address + n <= start + size:
                    self.named += n
                    return [name, address - start]
        start = self.used
        if start + n > self.region.size:
            self.overflow += n
            return None
        self.region[start : start + n] = np.frombuffer(raw, dtype=np.uint8)
        self.used = align(start + n)
        return [self.name, self.base + start]


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host: a client that shares memory with a
    unit is on its host). A zombie counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # (another user's process)
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True  # (no /proc: trust kill)


def new_token() -> str:
    """An arena token: this process's id (8 hex digits), then 8 random ones. The id lets a
    unit remove the file of an arena whose client died before any unit mapped it
    (:func:`sweep_orphans`)."""
    return f"{os.getpid() & 0xFFFFFFFF:08x}{secrets.token_hex(4)}"


ORPHAN_AGE_S = 10.0
"""An arena file no unit mapped is removed once this old, if its creator is gone."""


def sweep_orphans(directory: str = SHM_DIR, min_age_s: float = ORPHAN_AGE_S) -> int:
    """Remove the arena files in ``directory`` whose creator process is gone and that are
    at least ``min_age_s`` old: a client killed between making an arena and its unit mapping
    it (the unit removes the name once mapped) would leave the file, and its memory, for
    good. Returns how many were removed."""
    removed = 0
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue
        with contextlib.suppress(OSError):  # (removed or mapped meanwhile)
            if now - entry.stat().st_mtime < min_age_s:
                continue
            if _process_alive(int(m.group(1)[:8], 16)):
                continue
            os.unlink(entry.path)
            removed += 1
    return removed


class Segments:
    """The arenas a storage unit has attached, by client token (bounded, oldest dropped)."""

    def __init__(self, directory: str = SHM_DIR, max_clients: int = 1024) -> None:
        self.directory = directory
        self.max_clients = max_clients
        self._by_token: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()
        self._kept: dict[str, Kept] = {}  # write arenas whose buffers this unit may keep
        self._pids: dict[str, int] = {}  # client token -> its process (when it said)

    def attach(self, name: str, keep: bool = False, pid: int | None = None) -> int:
        """Map the client's arena ``name`` and remove its file; returns its size. ``keep``:
        a write arena (see :class:`WriteArenas`): rows written from it may stay views of it,
        and its flag tells the client when none is left. ``pid``: the client's process, whose
        arenas :meth:`drop_dead` drops once it is gone."""
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
        if keep and size <= WRITE_HEADER:
            raise ProtocolError(f"write arena {name} of {size} bytes has no room past its header")
        old = self._by_token.pop(token, None)  # an older generation of this client's arena
        if old is not None:
            self._kept.pop(old[0], None)
        buf = np.frombuffer(mapped, dtype=np.uint8)
        self._by_token[token] = (name, buf)
        if pid is not None:
            self._pids[token] = pid
        if keep:
            self._kept[name] = Kept(buf)
        while len(self._by_token) > self.max_clients:
            old_token, (gone, _) = self._by_token.popitem(last=False)
            self._kept.pop(gone, None)
            self._pids.pop(old_token, None)
        return size

    @property
    def nbytes(self) -> int:
        """Bytes of the arenas attached (mapped by this unit)."""
        return sum(int(buf.nbytes) for _, buf in self._by_token.values())

    def drop_dead(self) -> int:
        """Drop the arenas of clients whose process is gone (they will never detach them);
        their memory is unmapped once no row holds a view of it. Returns how many."""
        dead = [t for t, pid in self._pids.items() if not _process_alive(pid)]
        for token in dead:
            del self._pids[token]
            entry = self._by_token.pop(token, None)
            if entry is not None:
                self._kept.pop(entry[0], None)
        return len(dead)

    def detach(self, name: str) -> None:
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is not None:
            entry = self._by_token.get(m.group(1))
            if entry is not None and entry[0] == name:
                del self._by_token[m.group(1)]
                self._pids.pop(m.group(1), None)
                self._kept.pop(name, None)  # views still held keep the memory mapped

    def region(self, name: str, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        buf = self._buffer(name)
        end = buf.size if nbytes is None else offset + nbytes
        if not isinstance(offset, int) or offset < 0 or end > buf.size or end < offset:
            raise ProtocolError(
                f"bytes {offset}..{end} are outside shared-memory arena {name} ({buf.size} bytes)"
            )
        return buf[offset:end]

    def resolve(self, name: str, offset: int, nbytes: int) -> memoryview:
        region = self.region(name, offset, nbytes)
        kept = self._kept.get(name)
        return region.data if kept is None else kept.view(region)

    def kept_ranges(self, names: Sequence[str]) -> list[tuple[str, int, int]]:
        """``(name, address, size)`` of the write arenas among ``names`` (for a
        :class:`Placer`'s ``local``); other names are ignored."""
        out = []
        for name in names:
            kept = self._kept.get(name)
            if kept is not None:
                out.append((name, kept.buf.ctypes.data, kept.buf.size))
        return out

    def seal(self, name: str) -> None:
        """The request that wrote from write arena ``name`` is over: once the views it left
        are gone, the arena is the client's again."""
        kept = self._kept.get(name)
        if kept is not None:
            kept.seal()

    def _buffer(self, name: str) -> np.ndarray:
        m = _NAME.fullmatch(name) if isinstance(name, str) else None
        if m is None:
            raise ProtocolError(f"{name!r} is not a TransferQueue arena name")
        entry = self._by_token.get(m.group(1))
        if entry is None or entry[0] != name:
            raise UnknownArenaError(
                f"shared-memory arena {name!r} is not attached to this unit (it restarted, or "
                "dropped the arena): the client attaches a new one"
            )
        self._by_token.move_to_end(m.group(1))
        return entry[1]

    def __len__(self) -> int:
        return len(self._by_token)


WRITE_HEADER = ALIGN
"""Bytes at the start of a write arena before its data; byte 0 is the flag: 1 while the unit
may hold views of the arena, 0 once the client may write into it again."""


class Kept:
    """A unit's side of a write arena: counts the views of it that are alive.

    Every buffer a request resolves in the arena is a fresh memoryview with a finalizer; a
    ragged column written with adoption keeps its values as such a view. When the request is
    over (:meth:`seal`) and the last view is gone, the unit clears the arena's flag, and the
    client may write into the arena again. (The unit reads the arena only through those views,
    so it is done with the memory when it clears the flag.)
    """

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self._live = 0
        self._sealed = True
        self._lock = threading.RLock()  # views may die inside a garbage collection run

    def view(self, region: np.ndarray) -> memoryview:
        with self._lock:
            if self._live == 0:
                self._sealed = False  # a new request
            self._live += 1
        mv = region.data
        weakref.finalize(mv, self._drop)
        return mv

    def seal(self) -> None:
        with self._lock:
            self._sealed = True
            if self._live == 0:
                self.buf[0] = 0

    def _drop(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live == 0 and self._sealed:
                self.buf[0] = 0


class WriteArenas:
    """A client's write arenas with one unit: arenas a put's buffers are placed in, which the
    unit may keep (ragged values adopted as views instead of copied) until the rows are gone.

    An arena's first byte is its flag (:data:`WRITE_HEADER`): the client sets it when it lends
    the arena to a write, the unit clears it once it holds no view of it. A read by this
    client of rows it wrote may come back as views of the arena itself (:meth:`view`: a
    copy-on-write mapping of their own, so no copy anywhere, and a caller that modifies them
    changes nothing stored and no other result). Only arenas that are free (flag clear) and
    not held (no such view alive, no read in flight that may name it: :meth:`pin`) are lent
    again.
    ``max_bytes`` bounds them all. Lent, added and retired on the client's I/O loop; views
    end on any thread.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._arenas: list[Arena] = []
        self._retired: list[Arena] = []
        self._by_name: dict[str, Arena] = {}
        self._holds: dict[str, int] = {}  # views alive and reads in flight, per arena
        self._lock = threading.RLock()  # (views may end inside a garbage collection run)

    @property
    def bytes(self) -> int:
        return sum(a.size for a in self._arenas)

    def _free(self, arena: Arena) -> bool:
        return int(arena.buf[0]) == 0 and not self._holds.get(arena.name)

    def lend(self, nbytes: int) -> Arena | None:
        """The smallest free arena with ``nbytes`` past its header, flagged as lent."""
        with self._lock:
            fits = [a for a in self._arenas if a.size - WRITE_HEADER >= nbytes and self._free(a)]
            if not fits:
                return None
            arena = min(fits, key=lambda a: a.size)
            arena.buf[0] = 1
            return arena

    def unlend(self, arena: Arena) -> None:
        """Take back an arena :meth:`lend` gave that no write was sent from."""
        with self._lock:
            arena.buf[0] = 0

    def room_for(self, size: int) -> bool:
        """Whether a new arena of ``size`` fits the bound; retires free arenas (smallest
        first) to make room."""
        with self._lock:
            used = self.bytes
            for arena in sorted(self._arenas, key=lambda a: a.size):
                if used + size <= self.max_bytes:
                    break
                if self._free(arena):
                    self._drop(arena)
                    used -= arena.size
            return used + size <= self.max_bytes

    def add(self, arena: Arena) -> Arena:
        """A newly attached arena, lent to the write at hand."""
        with self._lock:
            arena.buf[0] = 1
            self._arenas.append(arena)
            self._by_name[arena.name] = arena
            return arena

    def retire(self, arena: Arena) -> None:
        """Never lend ``arena`` again (a write from it got no clean answer)."""
        with self._lock:
            if arena in self._arenas:
                self._drop(arena)

    def _drop(self, arena: Arena) -> None:
        self._arenas.remove(arena)
        self._retired.append(arena)  # (views of it may still be made until it is handed out)

    def retired(self) -> list[Arena]:
        """Arenas no longer lent (the caller detaches them from the unit and closes them)."""
        with self._lock:
            out, self._retired = self._retired, []
            for a in out:
                self._by_name.pop(a.name, None)
            return out

    def pin(self) -> list[Arena]:
        """Hold every arena the unit may hold rows in (flag set), for a read that may name
        them; :meth:`unpin` once its reply is in."""
        with self._lock:
            held = [a for a in self._arenas if int(a.buf[0]) == 1]
            for a in held:
                self._holds[a.name] = self._holds.get(a.name, 0) + 1
            return held

    def unpin(self, arenas: Sequence[Arena]) -> None:
        with self._lock:
            for a in arenas:
                self._release(a.name)

    def view(self, name: str, offset: int, nbytes: int) -> memoryview | None:
        """Bytes of write arena ``name`` (None: not one of these), copy-on-write (see
        :meth:`Arena.private_view`); the arena is held until the view is gone."""
        with self._lock:
            arena = self._by_name.get(name)
            if arena is None:
                return None
            mv = arena.private_view(offset, nbytes)
            self._holds[name] = self._holds.get(name, 0) + 1
        weakref.finalize(mv, self._release, name)
        return mv

    def _release(self, name: str) -> None:
        with self._lock:
            left = self._holds.get(name, 0) - 1
            if left > 0:
                self._holds[name] = left
            else:
                self._holds.pop(name, None)

    def reset(self) -> list[Arena]:
        """Forget every arena (the unit no longer knows them: it restarted); the caller
        closes them. Views already handed out keep their own mappings."""
        with self._lock:
            out = self._arenas + self._retired
            self._arenas, self._retired = [], []
            self._by_name.clear()
            return out

    def close(self) -> list[Arena]:
        with self._lock:
            self.max_bytes = 0
            return self.reset()


class Loan:
    """An arena lent to one read: the rows land in it and the result's tensors view it.

    Every buffer of the reply is handed out as a fresh memoryview of the arena (``view``);
    the tensors built on it keep it alive. The loan ends when the read is over (``seal``) and
    the last of those memoryviews is gone: then ``on_end(loan)`` runs, on whichever thread
    dropped the last reference.
    """

    def __init__(self, arena: Arena, on_end: Callable[[Loan], None]) -> None:
        self.arena = arena
        self.reusable = False
        """Whether the arena may take another read once the loan ends (the unit answered)."""
        self._on_end = on_end
        self._live = 0
        self._sealed = False
        # Re-entrant: a loan may end in a garbage collection run inside a locked section.
        self._lock = threading.RLock()

    def view(self, offset: int, nbytes: int) -> memoryview:
        mv = self.arena.view(offset, nbytes)
        with self._lock:
            self._live += 1
        weakref.finalize(mv, self._drop)
        return mv

    def seal(self, reusable: bool) -> None:
        """The read is over: no more views; ``reusable`` if the unit is done writing."""
        with self._lock:
            self.reusable = reusable
            self._sealed = True
            ended = self._live == 0
        if ended:
            self._on_end(self)

    def _drop(self) -> None:
        with self._lock:
            self._live -= 1
            ended = self._sealed and self._live == 0
        if ended:
            self._on_end(self)


class ReadArenas:
    """A client's read arenas with one unit: each is lent to one read at a time and comes back
    when the tensors of that read are gone, so reads hand out views, never copies.

    Arenas are created (and attached to the unit) by the caller; this class only keeps the
    books, thread-safely (loans end on the threads that drop the results). ``max_bytes``
    bounds the arenas in use and free together.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[Arena] = []
        self._loans: dict[str, Loan] = {}
        self._retired: list[Arena] = []  # ended unusable, or evicted: to detach, then close
        self._lock = threading.RLock()  # (loans may end inside a locked section: see Loan)

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._used()

    def _used(self) -> int:
        loans = sum(loan.arena.size for loan in self._loans.values())
        return sum(a.size for a in self._free) + loans

    def lend(self, nbytes: int) -> Loan | None:
        """A loan of the smallest free arena holding ``nbytes``; None if none is free."""
        with self._lock:
            fits = [a for a in self._free if a.size >= nbytes]
            if not fits:
                return None
            arena = min(fits, key=lambda a: a.size)
            self._free.remove(arena)
            loan = self._loans[arena.name] = Loan(arena, self._ended)
            return loan

    def room_for(self, size: int) -> bool:
        """Whether a new arena of ``size`` bytes fits the bound; retires free arenas (smallest
        first) to make room. Retired arenas are for the caller to detach (``retired``)."""
        with self._lock:
            used = self._used()
            for arena in sorted(self._free, key=lambda a: a.size):
                if used + size <= self.max_bytes:
                    break
                self._free.remove(arena)
                self._retired.append(arena)
                used -= arena.size
            return used + size <= self.max_bytes

    def add(self, arena: Arena) -> Loan:
        """Lend a newly attached arena."""
        with self._lock:
            loan = self._loans[arena.name] = Loan(arena, self._ended)
            return loan

    def loan(self, name: str) -> Loan | None:
        with self._lock:
            return self._loans.get(name)

    def retired(self) -> list[Arena]:
        """Arenas no longer used (the caller detaches them from the unit and closes them)."""
        with self._lock:
            out, self._retired = self._retired, []
            return out

    def reset(self) -> list[Arena]:
        """Every arena, for the caller to detach or close; loans still out keep their
        mappings until their results are gone, and never come back."""
        with self._lock:
            out = self._free + [loan.arena for loan in self._loans.values()] + self._retired
            self._free, self._loans, self._retired = [], {}, []
            return out

    def close(self) -> list[Arena]:
        """:meth:`reset`, and no arena is made from now on."""
        with self._lock:
            self.max_bytes = 0
            return self.reset()

    def _ended(self, loan: Loan) -> None:
        with self._lock:
            if self._loans.get(loan.arena.name) is not loan:
                return  # closed meanwhile
            del self._loans[loan.arena.name]
            if loan.reusable and self.max_bytes > 0:
                self._free.append(loan.arena)
            else:
                self._retired.append(loan.arena)
