"""Leases: rows handed to a consumer task until it acknowledges them or the deadline passes.

A lease is what makes delivery exactly-once under consumer crashes: ``get_meta`` marks rows
*leased*, not consumed; only an ``ack`` (or a ``put`` naming the lease) consumes them. When
the deadline passes first, the controller returns the rows to the task's queue and the lease
id is remembered as expired, so a late ack from a consumer that was only slow gets a clear
:class:`LeaseExpiredError` instead of silently consuming rows someone else now holds.

A lease also names its *holder*: the client handle that took it (``name/token``, see
:mod:`transferqueue.controller.holders`). When the holder is known to be dead, its leases close
as ``returned`` and their rows go back at once, as at a deadline; a late ack then gets the
same :class:`LeaseExpiredError`.

Lease ids are random 63-bit numbers (nobody can guess another consumer's), and a lease taken
by an authenticated client (its key: the ``owner``) answers only to that client: to anyone
else it is a lease never issued.

A lease may also name the *request* that took it (``get_meta``'s ``request_id``, drawn by the
client per call): while the lease is active, :meth:`LeaseTable.of_request` finds it again, so
that the same call sent again (its reply lost with a controller that died) gets the same batch
instead of leaving it leased to nobody until its deadline.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from transferqueue.errors import BadRequestError, LeaseExpiredError, UnknownLeaseError
from transferqueue.limits import MAX_LEASE_S
from transferqueue.wire.ids import random_id63

__all__ = ["Lease", "LeaseTable", "TaskKey", "random_lease_id"]

TaskKey = tuple[int, str]  # (partition id, task name)

_CLOSED_MEMORY = 65536  # how many closed lease ids keep their reason for error messages


@dataclass
class Lease:
    lease_id: int
    task: TaskKey
    indexes: np.ndarray
    deadline: float
    remaining: int
    owner: str | None = None  # the key of the client that took it (None: no keys in use)
    holder: str | None = None  # the handle that took it (None: not told; only the deadline)
    # rows lost with a unit while leased, (indexes, groups): consumed if the lease is acked,
    # else logged as lost for its task when it ends (see transferqueue.controller.retire)
    lost: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # the request that took it (get_meta's request_id), and what its reply said beside the
    # rows (answered again to a sending of that request, see LeaseTable.of_request)
    request_id: int | None = None
    reason: str = "full"
    splits: list[np.ndarray] | None = None


def random_lease_id() -> int:
    """A fresh random 63-bit lease id (:func:`transferqueue.wire.ids.random_id63`)."""
    return random_id63()


class LeaseTable:
    """Active leases, a deadline heap, and the recent history of closed ones."""

    def __init__(self, clock: Callable[[], float], max_lease_s: float = MAX_LEASE_S) -> None:
        self._clock = clock
        self.max_lease_s = max_lease_s
        self._active: dict[int, Lease] = {}
        self._heap: list[tuple[float, int]] = []
        self._closed: OrderedDict[int, str] = OrderedDict()
        self.expired = 0  # leases whose deadline passed before their rows were acknowledged
        self.returned = 0  # leases closed because their holder died (see holders)
        self.rows_returned = 0  # the rows those leases held when they closed
        self._by_holder: dict[str, set[int]] = {}
        self._by_request: dict[int, int] = {}  # request id -> its active lease's id
        # called with (lease, why) as each lease closes (the controller's loss log)
        self.on_close: Callable[[Lease, str], None] | None = None
        # draws a lease id (a journaled controller records the ids drawn and replays them,
        # see transferqueue.controller.journal)
        self.new_id: Callable[[], int] = random_lease_id

    def __len__(self) -> int:
        return len(self._active)

    def check_lease_s(self, lease_s: float) -> float:
        """``lease_s`` if it is a finite time in (0, max_lease_s]; else a typed error."""
        if not isinstance(lease_s, int | float) or not 0 < lease_s <= self.max_lease_s:
            raise BadRequestError(
                f"lease_s must be a number of seconds in (0, {self.max_lease_s:g}] (the "
                f"controller's max_lease_s), got {lease_s!r}"
            )
        return float(lease_s)

    def __setstate__(self, state: dict[str, object]) -> None:
        """(A snapshot written before holders were recorded: none known, nothing returned.)"""
        state.setdefault("returned", 0)
        state.setdefault("rows_returned", 0)
        state.setdefault("_by_holder", {})
        state.setdefault("_by_request", {})
        self.__dict__.update(state)

    def open(
        self,
        task: TaskKey,
        indexes: np.ndarray,
        lease_s: float,
        owner: str | None = None,
        holder: str | None = None,
        request_id: int | None = None,
    ) -> Lease:
        deadline = self._clock() + self.check_lease_s(lease_s)
        lease_id = self.new_id()
        while lease_id == 0 or lease_id in self._active or lease_id in self._closed:
            lease_id = self.new_id()
        lease = Lease(lease_id, task, indexes, deadline, int(indexes.size), owner, holder)
        self._active[lease_id] = lease
        if holder is not None:
            self._by_holder.setdefault(holder, set()).add(lease_id)
        if request_id is not None:
            lease.request_id = request_id
            self._by_request[request_id] = lease_id
        heapq.heappush(self._heap, (lease.deadline, lease_id))
        return lease

    def acked_at_once(self) -> int:
        """The lease id of a batch consumed as it is handed out (``get_meta(consume=True)``):
        drawn as :meth:`open` draws one and recorded as closed ``acked`` at once, so that an
        ack sent with it is a no-op and a commit finds it acked, as after ``open`` and
        ``close``; without the active lease, deadline and holder entries those would make
        and undo in the same call."""
        lease_id = self.new_id()
        while lease_id == 0 or lease_id in self._active or lease_id in self._closed:
            lease_id = self.new_id()
        self._closed[lease_id] = "acked"
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)
        return lease_id

    def get(self, lease_id: int, owner: str | None = None) -> Lease:
        """The active lease, or a typed error saying what became of it. A lease another
        client took (``owner`` differs) is reported as never issued."""
        lease = self._active.get(lease_id)
        if lease is not None and lease.owner is not None and lease.owner != owner:
            raise UnknownLeaseError(
                f"lease {lease_id} was never issued to this client; pass the BatchMeta "
                "returned by this client's get_meta"
            )
        if lease is not None:
            if lease.deadline > self._clock():
                return lease
            raise LeaseExpiredError(
                f"lease {lease_id} expired; its rows are being returned to task "
                f"{lease.task[1]!r}. Ask for a longer lease_s or acknowledge sooner"
            )
        why = self._closed.get(lease_id)
        if why == "returned":
            raise LeaseExpiredError(
                f"lease {lease_id} was returned: its holder (the client that took it) was "
                "declared gone (silent past the controller's holder_dead_after_s, closed, or "
                "replaced by a restarted host), and its rows were handed out again; drop this "
                "batch. A live client keeps its leases as long as it runs"
            )
        if why == "expired":
            raise LeaseExpiredError(
                f"lease {lease_id} expired and its rows were handed out again; "
                "ask for a longer lease_s or acknowledge sooner"
            )
        if why == "reset":
            raise UnknownLeaseError(
                f"lease {lease_id} was closed by reset_consumption: its rows went back to "
                "the task's queue and will be handed out again; drop this batch"
            )
        if why is not None:
            raise UnknownLeaseError(f"lease {lease_id} is no longer active ({why})")
        raise UnknownLeaseError(
            f"lease {lease_id} was never issued by this controller; pass the BatchMeta "
            "returned by get_meta"
        )

    def of_request(self, request_id: int, task: TaskKey, owner: str | None) -> Lease | None:
        """The active lease that request ``request_id`` took for ``task``, if ``owner`` (the
        asking client's key) took it and its deadline has not passed; else None."""
        lease = self._active.get(self._by_request.get(request_id, 0))
        if lease is None or lease.task != task or lease.owner != owner:
            return None
        return lease if lease.deadline > self._clock() else None

    def active(self, lease_id: int) -> Lease | None:
        """The lease if it is active (whatever its deadline), else None."""
        return self._active.get(lease_id)

    def closed_reason(self, lease_id: int) -> str | None:
        return self._closed.get(lease_id)

    def renew(self, lease: Lease, lease_s: float) -> None:
        lease.deadline = self._clock() + self.check_lease_s(lease_s)
        heapq.heappush(self._heap, (lease.deadline, lease.lease_id))

    def close(self, lease: Lease, why: str) -> None:
        self._active.pop(lease.lease_id, None)
        if lease.holder is not None:
            held = self._by_holder.get(lease.holder)
            if held is not None:
                held.discard(lease.lease_id)
                if not held:
                    del self._by_holder[lease.holder]
        request = lease.request_id
        if request is not None and self._by_request.get(request) == lease.lease_id:
            del self._by_request[request]
        self._closed[lease.lease_id] = why
        if self.on_close is not None:
            self.on_close(lease, why)
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    def due(self) -> list[Lease]:
        """Remove and return the leases whose deadline has passed."""
        now = self._clock()
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, lid = heapq.heappop(self._heap)
            lease = self._active.get(lid)
            if lease is not None and lease.deadline == deadline:
                self.close(lease, "expired")
                self.expired += 1
                out.append(lease)
        return out

    def holders(self) -> list[str]:
        """The holders of active leases."""
        return list(self._by_holder)

    def of_holder(self, holder: str) -> list[Lease]:
        """The active leases ``holder`` took."""
        return [self._active[lid] for lid in self._by_holder.get(holder, ())]

    def give_back(self, lease: Lease, rows: int) -> None:
        """Close ``lease`` as returned (its holder is gone), its ``rows`` going back."""
        self.close(lease, "returned")
        self.returned += 1
        self.rows_returned += rows

    def next_deadline(self) -> float | None:
        while self._heap:
            deadline, lid = self._heap[0]
            lease = self._active.get(lid)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(self._heap)
        return None

    def of_partition(self, partition_id: int) -> list[Lease]:
        return [lease for lease in self._active.values() if lease.task[0] == partition_id]

    def drop_rows(self, lease_ids: np.ndarray) -> None:
        """Rows left the leases ``lease_ids`` (one id per row: lost with a unit, retired);
        a lease left empty closes, unless it must learn whether its holder consumed rows it
        lost (``Lease.lost``, see transferqueue.controller.retire): then it stays open until
        acknowledged, released or expired."""
        if lease_ids.size == 0:
            return
        ids, counts = np.unique(lease_ids, return_counts=True)
        for lid, count in zip(ids.tolist(), counts.tolist(), strict=True):
            lease = self._active.get(lid)
            if lease is not None:
                lease.remaining -= count
                if lease.remaining <= 0 and not lease.lost:
                    self.close(lease, "lost")

    def clamp(self) -> None:
        """Deadlines further away than ``max_lease_s`` (a clock that restarted) come closer."""
        latest = self._clock() + self.max_lease_s
        moved = False
        for lease in self._active.values():
            if lease.deadline > latest:
                lease.deadline, moved = latest, True
        if moved:
            self._heap = [(lease.deadline, lid) for lid, lease in self._active.items()]
            heapq.heapify(self._heap)
