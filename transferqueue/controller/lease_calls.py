"""The controller's calls on leases: ``ack``, ``release``, ``renew``, and their expiry.

A mixin of :class:`~transferqueue.controller.core.Controller`. An ack, a release or a renew sent
again after its reply was lost changes nothing (clients send them again through a controller
restart, see :mod:`transferqueue.client.controller_link`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from transferqueue.controller.leases import Lease, LeaseTable
from transferqueue.controller.state import Changes, PartitionState, TaskState
from transferqueue.errors import UnknownLeaseError
from transferqueue.slots import SlotMap
from transferqueue.wire.replies import LEASED, QUEUED

__all__ = ["LeaseCalls"]


class LeaseCalls:
    """``ack``, ``release``, ``renew``, ``expire``; mixed into the Controller."""

    # (the Controller's state this mixin works on)
    leases: LeaseTable
    _h: dict[str, np.ndarray]
    _by_id: dict[int, PartitionState]
    _map: SlotMap
    _slots: Callable[[np.ndarray], np.ndarray]
    _without_lost: Callable[[np.ndarray], np.ndarray]  # (UnitHealth's)
    _mark_done: Callable[..., Changes]

    def _held(
        self,
        lease_id: int,
        indexes: np.ndarray | None,
        slots: np.ndarray | None,
        owner: str | None = None,
    ) -> Lease:
        lease = self.leases.get(lease_id, owner)
        if indexes is not None and slots is not None:
            task = self._task_of(lease)
            held = (task.lease[slots] == lease_id) & (task.state[slots] == LEASED)
            if not held.all():
                rows = indexes[~held][:5].tolist()
                raise UnknownLeaseError(
                    f"rows {rows} are not held by lease {lease_id} (acknowledged already or "
                    "never part of it)"
                )
        return lease

    def _task_of(self, lease: Lease) -> TaskState:
        part = self._by_id[lease.task[0]]
        return part.tasks[lease.task[1]]

    def _lease_slots(self, lease: Lease, indexes: np.ndarray | None) -> np.ndarray:
        if indexes is None:
            task = self._task_of(lease)
            slots = self._map.lookup(lease.indexes)
            slots = slots[slots >= 0]
            return slots[(task.lease[slots] == lease.lease_id) & (task.state[slots] == LEASED)]
        indexes = self._without_lost(np.asarray(indexes, dtype=np.int64))
        slots = self._slots(indexes)
        self._held(lease.lease_id, indexes, slots, lease.owner)
        return slots

    def ack(
        self, lease_id: int, indexes: np.ndarray | None = None, owner: str | None = None
    ) -> Changes:
        """Consume the lease's rows (all, or ``indexes`` of them). Acking a lease that was
        fully acknowledged already is a no-op (an ack sent again: its reply was lost)."""
        if self.leases.closed_reason(lease_id) in ("lost", "acked"):
            return Changes()  # (a lease whose rows were all lost with a unit: nothing left)
        lease = self.leases.get(lease_id, owner)
        return self._finish_rows(lease, self._lease_slots(lease, indexes), acked=True)

    def release(
        self, lease_id: int, indexes: np.ndarray | None = None, owner: str | None = None
    ) -> Changes:
        """Give rows back unconsumed (a consumer that cannot process them); no-op if acked,
        or released already (a release sent again)."""
        closed = self.leases.closed_reason(lease_id)
        if closed in ("lost", "released") or (indexes is None and closed == "acked"):
            return Changes()
        lease = self.leases.get(lease_id, owner)
        return self._finish_rows(lease, self._lease_slots(lease, indexes), acked=False)

    def renew(
        self,
        lease_id: int,
        lease_s: float,
        indexes: np.ndarray | None = None,
        owner: str | None = None,
    ) -> None:
        """Extend the deadline (a producer about to write results for the lease's rows)."""
        self.leases.check_lease_s(lease_s)
        if self.leases.closed_reason(lease_id) == "lost":
            return  # (its rows were lost with a unit: a commit says so)
        lease = self.leases.get(lease_id, owner)
        if indexes is not None:
            self._lease_slots(lease, indexes)
        self.leases.renew(lease, lease_s)

    def _finish_rows(self, lease: Lease, slots: np.ndarray, *, acked: bool) -> Changes:
        task = self._task_of(lease)
        part = self._by_id[lease.task[0]]
        n = int(slots.size)
        task.leased -= n
        task.lease[slots] = -1
        lease.remaining -= n
        if lease.remaining <= 0:
            self.leases.close(lease, "acked" if acked else "released")
        if acked:
            changes = self._mark_done(part, task, slots, dropped=False)
        else:
            task.state[slots] = QUEUED
            task.sampler.add(self._h["index"][slots], returned=True)
            changes = Changes()
        changes.woken.add(task.key)
        return changes

    def expire(self) -> Changes:
        """Return the rows of leases past their deadline to their tasks' queues."""
        changes = Changes()
        for lease in self.leases.due():
            task = self._task_of(lease)
            slots = self._map.lookup(lease.indexes)
            slots = slots[slots >= 0]
            slots = slots[(task.lease[slots] == lease.lease_id) & (task.state[slots] == LEASED)]
            task.leased -= int(slots.size)
            task.lease[slots] = -1
            task.state[slots] = QUEUED
            task.sampler.add(self._h["index"][slots], returned=True)
            changes.woken.add(task.key)
        return changes

    def next_deadline(self) -> float | None:
        return self.leases.next_deadline()
