"""``Controller``: the metadata of TransferQueue (never payload), built from parts.

It allocates row indexes and places rows on storage units; records which fields of which
rows are ready; keeps, per consumer task, which rows are queued, leased and done; hands out
batches through the task's sampler; frees rows once every task declared for their partition
has acknowledged them. Each concern is a part that owns its state; this class only wires
them (and reports ``stats``)::

    part          state it owns                          calls (the service's handlers)
    rows          header columns, ready bits, slots,     register_fields, lost
                  field specs, lost rows remembered
    partitions    partitions, their tasks and queues     partition
    leases        active leases, deadlines               (through queues)
    placement     units' bytes, hosts, liveness          (through writes, health)
    writes        capacity                               allocate, commit, discard
    queues        -                                      poll, ack, release, renew, expire,
                                                         declare_tasks, finish, clear,
                                                         reset_consumption
    copies        second copies under way                plan_copies, copies_made,
                                                         drop_copies
    retirement    loss log per task and per partition    lost_rows, retire_groups
    health        allocation deadlines, loss counters    lose_unit, unit_back, reclaim
    status        custom metadata per row                status, set/get_custom_meta
    keys          key map per partition                  key_rows, delete_keys, list_keys
    claims        names bound once to rows, per partition claim
    snapshots     -                                      export_partition, import_rows,
                                                         import_tasks

When a field lands, only the tasks that consume it look at only the rows written, so per-task
ready queues are maintained incrementally and a batch costs O(batch) to hand out.

This is plain synchronous code: no I/O, no waiting. :class:`ControllerService` adds blocking
``get_meta``, lease timers and freeing of payload on storage units; a
:class:`~transferqueue.controller.journaled.JournaledController` records the calls that
change the parts (the methods marked ``journaled``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from transferqueue.controller.claims import Claims
from transferqueue.controller.health import ALLOCATION_S, UnitHealth
from transferqueue.controller.keys import KeyedRows
from transferqueue.controller.leases import LeaseTable
from transferqueue.controller.partitions import Partitions
from transferqueue.controller.placement import SPREAD_BYTES, Placement
from transferqueue.controller.queues import Queues
from transferqueue.controller.rereplicate import Copies
from transferqueue.controller.retire import Retirement
from transferqueue.controller.rows import RowTable
from transferqueue.controller.snapshot import Snapshots
from transferqueue.controller.state import Changes
from transferqueue.controller.status import RowStatus
from transferqueue.controller.writes import Writes
from transferqueue.limits import MAX_LEASE_S

__all__ = ["SPREAD_BYTES", "Changes", "Controller"]


class Controller:
    """Row metadata, readiness, per-task queues and leases: the parts (see the module),
    wired. Not thread-safe by design."""

    def __init__(
        self,
        num_units: int = 1,
        *,
        capacity_rows: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        spread_bytes: int = SPREAD_BYTES,
        max_lease_s: float = MAX_LEASE_S,
        allocation_s: float = ALLOCATION_S,
        replicas: int = 1,
    ) -> None:
        """``replicas=2``: each row is written to two units (see
        :mod:`transferqueue.controller.health`)."""
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        if spread_bytes < 0:
            raise ValueError(f"spread_bytes must be >= 0 (0: always spread), got {spread_bytes}")
        self.num_units = num_units
        self.spread_bytes = spread_bytes
        self.clock = clock
        self.placement = Placement(num_units, spread_bytes, replicas)
        self.rows = RowTable(replicas=replicas, allocation_s=allocation_s)
        self.leases = LeaseTable(clock, max_lease_s)
        self.partitions = Partitions(self.rows, self.placement)
        self.queues = Queues(self.rows, self.partitions, self.leases)
        self.copies = Copies(self.rows, self.placement)
        self.writes = Writes(
            self.rows, self.partitions, self.placement, self.queues, self.copies, capacity_rows
        )
        self.retirement = Retirement(self.rows, self.partitions, self.leases)
        self.health = UnitHealth(
            self.rows,
            self.partitions,
            self.leases,
            self.placement,
            self.copies,
            self.retirement,
            self.writes,
            clock=clock,
            allocation_s=allocation_s,
        )
        self.status = RowStatus(self.rows, self.partitions)
        self.keys = KeyedRows(self.rows, self.partitions, self.writes)
        self.claims = Claims(self.rows, self.partitions)
        self.snapshots = Snapshots(
            self.rows,
            self.partitions,
            self.leases,
            self.writes,
            self.queues,
            self.keys,
            self.status,
        )

    @property
    def capacity_rows(self) -> int | None:
        return self.writes.capacity_rows

    @property
    def allocation_s(self) -> float:
        return self.health.allocation_s

    def parts(self) -> list[Any]:
        """The parts whose calls change the core (a journaled controller records them)."""
        return [
            self.rows,
            self.partitions,
            self.queues,
            self.copies,
            self.writes,
            self.retirement,
            self.health,
            self.status,
            self.keys,
            self.claims,
            self.snapshots,
        ]

    def stats(self) -> dict[str, Any]:
        """Rows, tasks, leases and units, as counts (what ``stats()`` of a client shows)."""
        parts = {}
        for part in self.partitions:
            tasks = {}
            for name, t in part.tasks.items():
                queued = t.sampler.available()
                tasks[name] = {
                    "fields": list(t.fields),
                    "sampler": t.sampler_name,
                    "queued": queued,
                    "leased": t.leased,
                    "done": t.done,
                    "dropped": t.dropped,
                    "lost": t.lost,
                    "retired": t.retired,
                    "waiting": part.rows_put - t.done - t.leased - queued - t.lost - t.retired,
                }
            parts[part.name] = {
                "rows_put": part.rows_put,
                "rows_live": part.rows_live,
                "rows_freed": part.rows_freed,
                "rows_lost": part.rows_lost,
                "rows_retired": part.rows_retired,
                "keys": self.keys.count(part.id),
                "claims": self.claims.count(part.name),
                "finished": part.finished,
                "declared_tasks": part.declared,
                "tasks": tasks,
            }
        health = self.health
        return {
            "rows_live": self.rows.live,
            "capacity_rows": self.capacity_rows,
            "next_index": self.rows.next_index,
            "active_leases": len(self.leases),
            "expired_leases": self.leases.expired,
            "returned_leases": self.leases.returned,
            "returned_rows": self.leases.rows_returned,
            "unit_bytes": self.placement.unit_bytes.tolist(),
            "units_alive": self.placement.alive.tolist(),
            "units_lost": health.units_lost,
            "rows_lost": health.rows_lost,
            "rows_reclaimed": health.rows_reclaimed,
            "rows_retired": self.retirement.rows_retired,
            "replicas": self.placement.replicas,
            "rows_one_copy": self.copies.one_copy(),
            "rows_recopied": self.copies.rows_recopied,
            "copies_refused": self.copies.copies_refused,
            "custom_meta_rows": self.status.custom_rows,
            "custom_meta_bytes": self.status.custom_bytes,
            "allocation_s": self.allocation_s,
            # (every partition's fields; one whose spec differs between partitions shows
            # one of them: partition_fields has each partition's)
            "fields": {
                n: s.describe() for specs in self.rows.specs.values() for n, s in specs.items()
            },
            "partition_fields": {
                p: {n: s.describe() for n, s in specs.items()}
                for p, specs in self.rows.specs.items()
            },
            "partitions": parts,
        }
