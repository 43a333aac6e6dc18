"""ZeroMQ servers: the controller and the storage units as request/reply services.

Each server is a plain object on an asyncio loop: a :class:`RpcServer` in front of the same
core the embedded deployment uses (:class:`ControllerService`, :class:`StorageUnit` through a
:class:`LocalUnitLink`). Nothing here knows how it was started: ``transferqueue serve`` runs
them as processes, the Ray deployment inside actors, tests inside threads.

Requests reach the handlers below already decoded into their declared message structs and
checked against their schema (:mod:`transferqueue.wire.messages`); a handler method is named after
its kind. A storage unit creates rows only under the controller's grant
(:mod:`transferqueue.wire.grants`); controller and units share the grant key.

The controller watches its units with heartbeats (:mod:`transferqueue.wire.liveness`): a unit
silent for ``dead_after_s`` loses its rows at once (:mod:`transferqueue.controller.health`) and
takes no new ones until it answers again, from a new incarnation (restarted: it re-registers, on the
same address or a new one) or the old one (it was only unreachable: it is cleared first).
A unit drops the shared-memory arenas of clients whose process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq.asyncio

from transferqueue.client.links import OFFLOAD_BYTES, nbytes_to_copy
from transferqueue.controller.core import SPREAD_BYTES, Controller
from transferqueue.controller.handlers import AdminHandlers, handlers
from transferqueue.controller.health import ALLOCATION_S
from transferqueue.controller.journal import JournalSettings
from transferqueue.controller.journaled import JournaledController, open_controller
from transferqueue.controller.recopy import Copier
from transferqueue.controller.recovery import reconcile
from transferqueue.controller.rereplicate import CopyPlan
from transferqueue.controller.service import ControllerService
from transferqueue.deploy.local_links import LocalUnitLink
from transferqueue.deploy.metrics import MetricsEndpoint, check_metrics_port, process_memory
from transferqueue.errors import BadRequestError, PeerGoneError, TQError
from transferqueue.limits import MAX_LEASE_S
from transferqueue.storage.shm import SHM_DIR, Placer, Segments, sweep_orphans
from transferqueue.storage.unit import StorageUnit
from transferqueue.wire import messages as m
from transferqueue.wire import protocol
from transferqueue.wire.auth import ServerKeys
from transferqueue.wire.codec import PROTOCOL_VERSION
from transferqueue.wire.grants import Grants
from transferqueue.wire.liveness import DEFAULT_LIVENESS, Liveness, new_incarnation
from transferqueue.wire.peers import max_connections_for
from transferqueue.wire.protocol import Caller
from transferqueue.wire.rpc import RpcClient, RpcServer, SendThenRelease, check_address

__all__ = ["ControllerServer", "UnitServer", "grant_key_for"]

log = logging.getLogger(__name__)

_SWEEP_S = 1.0  # how often a unit looks for arenas of clients that are gone
_REGISTER_TRIES_S = 30.0  # how long a restarted unit refuses new rows while not registered
_REGISTER_BACKOFF_S = 2.0  # the longest pause between a restarted unit's registrations
_VERIFY_S = 1.5  # how long the controller waits for a registering unit's ping (it retries)
# How long a restarted controller asks each unit for its incarnation before serving without
# it (its rows lost; taken back when it answers): a unit restarting too may take that long.
_RECOVERY_UNITS_S = 30.0
_MAX_PEERS = 64  # connections a unit keeps to other units (the targets of its copies)


def grant_key_for(keys: ServerKeys | None, grant_key: bytes | None) -> bytes:
    """The key controller and units sign and check grants with: given, else derived from the
    service's secret key (every server of a keyed service loads it)."""
    if grant_key is not None:
        return grant_key
    if keys is None:
        raise ValueError(
            "a TransferQueue server needs the service's grant key (grant_key=) or its keys "
            "(keys=); `transferqueue serve` and start_on_ray pass them"
        )
    return hashlib.blake2b(keys.secret, person=b"tq-grant", digest_size=32).digest()


class UnitServer:
    """One storage unit behind a ROUTER socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        unit_id: int,
        address: str = "tcp://127.0.0.1:0",
        *,
        capacity_bytes: int | None = None,
        shm_dir: str = SHM_DIR,
        keys: ServerKeys | None = None,
        grant_key: bytes | None = None,
        controller: str | None = None,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        max_connections: int | None = None,
    ) -> None:
        """``controller``: the address of the controller to register with once serving (a
        unit restarted by its supervisor; the first units are named to the controller).
        ``max_connections``: client connections admitted (default: the open-file limit less a
        reserve; the service's own are never refused: :mod:`transferqueue.wire.peers`).
        ``metrics_port``: serve Prometheus metrics there once started (0: any free port;
        None: no endpoint; see :mod:`transferqueue.deploy.metrics`), on ``metrics_host``."""
        self._metrics_port = check_metrics_port(metrics_port)
        self._metrics_host = metrics_host
        self.metrics: MetricsEndpoint | None = None
        self.unit = StorageUnit(unit_id, capacity_bytes=capacity_bytes)
        self.incarnation = new_incarnation()
        self._controller = controller
        # A restarted unit (one that registers) takes new rows once the controller answered
        # its registration: rows written before then could count with its dead incarnation's.
        self._registered = controller is None
        self._keys = keys
        self._ctx = ctx
        self._background: list[asyncio.Task[None]] = []
        self.grants = Grants(grant_key_for(keys, grant_key))
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tq-unit{unit_id}")
        # Ragged values received as frames are owned by the server: adopt them, no copy.
        self.link = LocalUnitLink(self.unit, self._executor, adopt=True)
        # Arenas of clients on this host (see transferqueue.storage.shm).
        self.segments = Segments(shm_dir)
        self.shm_writes = 0
        self.shm_reads = 0
        self.rows_copied = 0  # rows this unit copied to others (re-replication)
        self._peers: dict[str, RpcClient] = {}  # other units, by address (copies go there)
        self.rpc = RpcServer(
            ctx,
            address,
            "unit",
            protocol.handlers("unit", self),
            join=False,
            resolve=self.segments.resolve,
            keys=keys,
            max_connections=max_connections_for(max_connections),
        )
        self.address = self.rpc.address

    def start(self) -> None:
        self.rpc.start()
        if self._metrics_port is not None:
            self.metrics = MetricsEndpoint(
                self.metrics_snapshot, self._metrics_port, self._metrics_host
            )
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(self._sweep()))
        if self._controller is not None:
            self._background.append(loop.create_task(self._register(self._controller)))

    def ping(self, msg: m.UnitPing, caller: Caller) -> str:
        return self.incarnation

    async def _register(self, address: str) -> None:
        """Tell the controller where this (restarted) unit listens, until it answers: it
        places rows here again once it knows. A restarted controller may serve only after
        ``_RECOVERY_UNITS_S`` (it pings the address this unit had first), so the unit never
        stops asking while it lives (each call bounded, backoff up to ``_REGISTER_BACKOFF_S``);
        after ``_REGISTER_TRIES_S`` it takes new rows all the same (the controller's
        heartbeat tells it apart from its dead incarnation) and says so."""
        own = None if self._keys is None else self._keys.as_client()
        rpc = RpcClient(self._ctx, address, keys=own, call_timeout_s=5.0, internal=True)
        msg = m.RegisterUnit(
            unit_id=self.unit.unit_id, address=self.address, incarnation=self.incarnation
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _REGISTER_TRIES_S
        backoff = 0.2
        try:
            while True:
                try:
                    await rpc.call(msg)
                    if not self._registered:
                        log.info("unit %d registered at %s", self.unit.unit_id, self.address)
                    else:
                        log.warning("unit %d registered late, at last", self.unit.unit_id)
                    return
                except TQError as e:
                    if not self._registered and loop.time() > deadline:
                        log.error(
                            "unit %d could not register within %g s (%s): it takes new rows "
                            "all the same and keeps asking",
                            self.unit.unit_id,
                            _REGISTER_TRIES_S,
                            e,
                        )
                        self._registered = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _REGISTER_BACKOFF_S)
        finally:
            self._registered = True
            await rpc.close()

    async def _sweep(self) -> None:
        """Drop the arenas of clients whose process is gone (a producer killed mid-put):
        their memory is released once no row holds a view of it."""
        while True:
            await asyncio.sleep(_SWEEP_S)
            try:
                self.segments.drop_dead()
                sweep_orphans(self.segments.directory)
            except Exception:  # the sweep keeps running whatever one pass meets
                log.exception("unit %d: sweeping arenas failed", self.unit.unit_id)

    async def write(self, msg: m.Write, caller: Caller) -> None:
        if msg.create:  # new rows: only those the controller allocated here, to this writer
            self.grants.check(msg.grant, self.unit.unit_id, msg.indexes)
            if not self._registered:  # (as if the old incarnation answered: it is gone)
                raise PeerGoneError(
                    f"storage unit {self.unit.unit_id} restarted and the controller has not "
                    "answered its registration yet: rows it allocated here before are lost "
                    "(the client asks the controller, and puts again)"
                )
        # Views of the client's arena are copied, never adopted ... unless it is a write arena
        # (the client reuses it only when the unit holds no view of it): then ragged values
        # stay views of it, no copy.
        keep = msg.keep if msg.shm else None
        self.shm_writes += msg.shm
        error: BaseException | None = None
        try:
            await self.link.write(
                msg.indexes,
                msg.columns,
                msg.specs,
                create=msg.create,
                adopt=(keep is not None) if msg.shm else None,
            )
        except Exception as e:
            error = e.with_traceback(None)  # (its frames would hold the request's views)
        finally:
            if keep is not None:
                del msg  # (the request's views: only what the unit kept stays)
                self.segments.seal(keep)  # before the reply: the client may reuse the arena
        if error is not None:
            raise error

    async def copy_rows(self, msg: m.CopyRows, caller: Caller) -> int:
        """Copy rows to another unit (the controller re-replicating, see
        :mod:`transferqueue.controller.recopy`): read here, written there as a put's
        create-write."""
        cols = await self.link.read(msg.indexes, msg.fields)
        rpc = self._peers.get(msg.address)
        if rpc is None:
            while len(self._peers) >= _MAX_PEERS:  # (units that moved: the oldest goes)
                await self._peers.pop(next(iter(self._peers))).close()
            own = None if self._keys is None else self._keys.as_client()
            rpc = self._peers[msg.address] = RpcClient(
                self._ctx,
                check_address(msg.address),
                keys=own,
                call_timeout_s=msg.timeout_s,
                internal=True,
            )
        write = m.Write(
            indexes=msg.indexes, columns=cols, specs=msg.specs, create=True, grant=msg.grant
        )
        await rpc.call(write, wait_s=msg.timeout_s)
        self.rows_copied += int(msg.indexes.size)
        return int(msg.indexes.size)

    async def read(self, msg: m.Read, caller: Caller) -> Any:
        target = msg.shm  # the client's arena to place the rows in, if any
        region = None if target is None else self.segments.region(target)
        # The client's write arenas: ragged values it wrote from them go back named where
        # they are (the client views them; no copy on either side).
        local = self.segments.kept_ranges(msg.mine) if msg.mine else []
        cols, pins = await self.link.read_pinned(msg.indexes, msg.fields)
        link = self.link
        release = (lambda: link.unpin(pins)) if pins else None
        if region is None and not local:
            return cols if release is None else SendThenRelease(cols, release)
        if region is None:  # no arena to copy into: the rest goes as frames
            target, region = "", np.empty(0, dtype=np.uint8)
        place = Placer(str(target), region, local=local)
        self.shm_reads += 1
        big = sum(nbytes_to_copy(c, local) for c in cols.values()) >= OFFLOAD_BYTES
        return SendThenRelease(cols, release, place=place, offload=big)

    def shm_attach(self, msg: m.ShmAttach, caller: Caller) -> int:
        return self.segments.attach(msg.name, keep=msg.keep, pid=msg.pid)

    def shm_detach(self, msg: m.ShmDetach, caller: Caller) -> None:
        self.segments.detach(msg.name)

    async def free(self, msg: m.Free, caller: Caller) -> None:
        if not caller.may("admin"):  # a writer undoing its own put
            self.grants.check(msg.grant, self.unit.unit_id, msg.indexes)
        await self.link.free(msg.indexes)

    async def clear(self, msg: m.ClearUnit, caller: Caller) -> None:
        await self.link.clear()

    async def inventory(self, msg: m.UnitInventory, caller: Caller) -> np.ndarray:
        """Every row held (a controller that restarted compares them with its own)."""
        return await self.link.inventory()

    async def reset(self, msg: m.ResetUnit, caller: Caller) -> None:
        """Data and counters; attached arenas stay valid."""
        self.shm_writes = self.shm_reads = 0
        await self.link.reset()

    @property
    def metrics_address(self) -> str | None:
        """The URL of this unit's Prometheus endpoint (None: off)."""
        return None if self.metrics is None else self.metrics.url

    def _unit_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        stats.update(
            shm_arenas=len(self.segments),
            shm_attached_bytes=self.segments.nbytes,
            shm_writes=self.shm_writes,
            shm_reads=self.shm_reads,
            rows_copied=self.rows_copied,
        )
        return stats

    async def stats(self, msg: m.UnitStats, caller: Caller) -> dict[str, Any]:
        stats = self._unit_stats(await self.link.stats())
        stats.update(
            requests=self.rpc.counters.snapshot(),
            connections=self.rpc.peers.snapshot(),
            memory=process_memory(self.segments.directory),
            metrics_address=self.metrics_address,
        )
        return stats

    async def metrics_snapshot(self) -> dict[str, Any]:
        """What a scrape exposes (on the loop; the unit's stats under its link's lock: its
        copies run on worker threads)."""
        return {
            "server": "unit",
            "requests": self.rpc.counters.snapshot(),
            "connections": self.rpc.peers.snapshot(),
            "memory": process_memory(self.segments.directory),
            "unit": self._unit_stats(await self.link.stats()),
        }

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        for task in self._background:
            task.cancel()
        for task in self._background:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.rpc.close()
        for peer in self._peers.values():
            await peer.close()
        self._executor.shutdown(wait=False)


class ControllerServer:
    """The controller behind a ROUTER socket; it frees payload on the units it knows."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        unit_addresses: Sequence[str],
        address: str = "tcp://127.0.0.1:0",
        *,
        capacity_rows: int | None = None,
        spread_bytes: int = SPREAD_BYTES,
        max_lease_s: float = MAX_LEASE_S,
        keys: ServerKeys | None = None,
        grant_key: bytes | None = None,
        liveness: Liveness = DEFAULT_LIVENESS,
        allocation_s: float = ALLOCATION_S,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        replicas: int = 1,
        state_dir: str | None = None,
        journal: JournalSettings | None = None,
        max_connections: int | None = None,
    ) -> None:
        """``metrics_port``: serve Prometheus metrics there once started (0: any free port;
        None: no endpoint; see :mod:`transferqueue.deploy.metrics`), on ``metrics_host``.
        ``replicas=2``: each row on two units, on two hosts where the units' addresses name
        several (see :mod:`transferqueue.controller.placement`). ``state_dir``: keep the
        controller's state there (:mod:`transferqueue.controller.journal`, settings ``journal``); a
        controller started on a directory with state recovers it, keeping the settings it was first
        started with, and reconciles with its units before serving
        (:mod:`transferqueue.controller.recovery`). ``max_connections``: as a unit's."""
        if not unit_addresses:
            raise ValueError("a controller needs at least one storage unit address")
        self._metrics_port = check_metrics_port(metrics_port)
        self._metrics_host = metrics_host
        self.metrics: MetricsEndpoint | None = None
        self.unit_addresses = list(unit_addresses)
        grants = Grants(grant_key_for(keys, grant_key))
        self._ctx = ctx
        self._own = None if keys is None else keys.as_client()  # (units know it as the service)
        self.liveness = liveness
        self._units: list[RpcClient] = []
        # per unit: its incarnation as last heard (None: not yet), and a revival under way
        self._incarnations: list[str | None] = [None] * len(self.unit_addresses)
        self._reviving: dict[int, asyncio.Task[None]] = {}
        self._started = False
        try:
            for i, a in enumerate(self.unit_addresses):
                self._units.append(self._unit_client(i, a))
            options: dict[str, Any] = dict(
                capacity_rows=capacity_rows,
                spread_bytes=spread_bytes,
                max_lease_s=max_lease_s,
                allocation_s=allocation_s,
                replicas=replicas,
            )
            controller: Controller
            self.recovered = False  # (state_dir held state: reconciled with units at start)
            if state_dir is None:
                controller = Controller(len(self._units), **options)
                for i, a in enumerate(self.unit_addresses):
                    controller.placement.set_host(i, _host_of(a))
            else:
                controller, self.recovered = open_controller(
                    state_dir, lambda: JournaledController(len(self._units), **options), journal
                )
                for i, a in enumerate(self.unit_addresses):
                    controller.health.set_unit_host(i, _host_of(a))
            self.service = ControllerService(
                controller,
                self._free_rows,
                grants=grants,
                holder_dead_after_s=liveness.holder_dead_after_s,
                holder_grace_s=liveness.holder_grace_s,
            )
            self._admin = AdminHandlers(self.service)
            self._grants = grants
            self.copier = Copier(self.service, self._copy)
            self.rpc = RpcServer(
                ctx,
                address,
                "controller",
                protocol.handlers("controller", self, *handlers(self.service)),
                keys=keys,
                max_connections=max_connections_for(max_connections),
            )
        except BaseException:
            for u in self._units:
                u._io.close()
            raise
        self.address = self.rpc.address

    def _unit_client(self, unit: int, address: str) -> RpcClient:
        return RpcClient(
            self._ctx,
            address,
            keys=self._own,
            ping=m.UnitPing(),
            liveness=self.liveness,
            keepalive=True,
            on_pong=functools.partial(self._pong, unit),
            on_silent=functools.partial(self._silent, unit),
            internal=True,
        )

    async def start(self) -> None:
        """Learn each unit's incarnation (so that a unit restarted from now on is told from
        the one that held rows), then serve."""
        wait_s = self.liveness.bound_s * 4
        ctl = self.service.controller
        if self.recovered:
            # a unit restarting along with this controller may not listen for a while (or be
            # dead for good): serve without it, its rows lost, until it registers (_heard)
            found = await asyncio.gather(
                *(self._first_answer(i, _RECOVERY_UNITS_S) for i in range(len(self._units)))
            )
            for unit, incarnation in enumerate(found):
                if incarnation is None and ctl.placement.alive[unit]:
                    log.warning(
                        "storage unit %d did not answer the restarted controller within %g s: "
                        "its rows are lost; it is taken back when it answers",
                        unit,
                        _RECOVERY_UNITS_S,
                    )
                    self.service.lose_unit(unit)
            self._incarnations = list(found)
        else:
            self._incarnations = list(
                await asyncio.gather(*(u.call(m.UnitPing(), wait_s=wait_s) for u in self._units))
            )
        if self.recovered and isinstance(ctl, JournaledController):
            await reconcile(self.service, self._units, wait_s=wait_s)
            if ctl.journal is not None:
                ctl.journal.snapshot(ctl)  # (the next restart starts from here)
        await self.service.start()
        self.rpc.start()
        for u in self._units:
            u.start_watch()
        self.copier.start()
        if self._metrics_port is not None:
            self.metrics = MetricsEndpoint(
                self.metrics_snapshot, self._metrics_port, self._metrics_host
            )
        self._started = True

    async def _first_answer(self, unit: int, bound_s: float) -> str | None:
        """Unit ``unit``'s incarnation, asked until it answers for at most ``bound_s``
        (None: it did not)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while True:
            try:
                wait_s = max(0.1, min(self.liveness.bound_s, deadline - loop.time()))
                answer: str = await self._units[unit].call(m.UnitPing(), wait_s=wait_s)
                return answer
            except TQError:
                if loop.time() >= deadline:
                    return None
                await asyncio.sleep(0.2)

    @property
    def metrics_address(self) -> str | None:
        """The URL of the controller's Prometheus endpoint (None: off)."""
        return None if self.metrics is None else self.metrics.url

    async def metrics_snapshot(self) -> dict[str, Any]:
        """What a scrape exposes (on the loop)."""
        return {
            "server": "controller",
            "requests": self.rpc.counters.snapshot(),
            "connections": self.rpc.peers.snapshot(),
            "memory": process_memory(SHM_DIR),
            "controller": self.service.stats(),
        }

    def stats(self, msg: m.Stats, caller: Caller) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """The core's stats, with this server's request counters, memory and metrics URL."""
        stats = self._admin.stats(msg, caller)
        if isinstance(stats, dict):
            return self._server_stats(stats)
        return self._server_stats_later(stats)

    async def _server_stats_later(self, stats: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        return self._server_stats(await stats)

    def _server_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        stats.update(
            requests=self.rpc.counters.snapshot(),
            connections=self.rpc.peers.snapshot(),
            memory=process_memory(SHM_DIR),
            metrics_address=self.metrics_address,
        )
        return stats

    def _free_rows(self, unit_id: int, indexes: np.ndarray) -> Awaitable[None]:
        if not self.service.controller.placement.alive[unit_id]:
            return _nothing()  # (its memory died with it; a revived unit is cleared)
        return self._units[unit_id].request(m.Free(indexes=indexes))

    async def _copy(self, plan: CopyPlan, expires: float) -> int:
        """Have the plan's source unit copy its rows to the target by ``expires`` (wall
        clock), when the target's grant for them expires (see transferqueue.controller.recopy)."""
        lo, hi = int(plan.indexes.min()), int(plan.indexes.max()) + 1
        timeout_s = max(0.1, expires - time.time())
        ctl = self.service.controller
        part = ctl.partitions.by_id(plan.partition)
        specs = ctl.rows.specs_of(part.name) if part is not None else {}
        if any(f not in specs for f in plan.fields):
            raise BadRequestError(f"copy plan {plan.plan_id}: its partition was cleared")
        msg = m.CopyRows(
            indexes=plan.indexes,
            fields=plan.fields,
            specs={f: specs[f] for f in plan.fields},
            target=plan.target,
            address=self.unit_addresses[plan.target],
            grant=self._grants.sign(plan.target, lo, hi, expires),
            timeout_s=timeout_s,
        )
        return await self._units[plan.source].call(msg, wait_s=timeout_s + 2.0)

    # -- unit health -------------------------------------------------------------------------
    def _silent(self, unit: int) -> None:
        """Unit ``unit`` stopped answering: its rows are lost (see
        transferqueue.controller.health)."""
        if self.service.controller.placement.alive[unit]:
            self.service.lose_unit(unit)

    def _pong(self, unit: int, incarnation: str) -> None:
        self._heard(unit, incarnation)

    def _heard(self, unit: int, incarnation: str) -> asyncio.Task[None] | None:
        """A ping's answer (or a registration): a new incarnation is a restarted unit. Returns
        the unit's revival under way (None: nothing to revive)."""
        known = self._incarnations[unit]
        alive = bool(self.service.controller.placement.alive[unit])
        if alive and known in (None, incarnation):  # (a unit lost unheard of is revived)
            self._incarnations[unit] = incarnation
            return None
        if known != incarnation and alive:  # restarted faster than it was missed
            self.service.lose_unit(unit)
        task = self._reviving.get(unit)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._revive(unit, incarnation))
            self._reviving[unit] = task
            task.add_done_callback(lambda t, u=unit: self._revived(u, t))  # type: ignore[misc]
        return task

    async def _revive(self, unit: int, incarnation: str) -> None:
        """Clear the unit (it may hold rows the controller declared lost: it was only
        unreachable), then place rows on it again."""
        await self._units[unit].call(m.ClearUnit(), wait_s=self.liveness.dead_after_s * 2)
        self._incarnations[unit] = incarnation
        self.service.unit_back(unit)

    def _revived(self, unit: int, task: asyncio.Task[None]) -> None:
        self._reviving.pop(unit, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("storage unit %d did not come back: %r", unit, task.exception())

    async def lost(self, msg: m.Lost, caller: Caller) -> np.ndarray:
        """Which rows were lost, once the units of the failed read said who they are: a
        unit that restarted between two heartbeats answers a read of its old rows with
        UnknownRowError, which without this check would pass for a reader's mistake."""
        units = [u for u in set(msg.units) if u < len(self._units)]
        await asyncio.gather(*(self._check_incarnation(u) for u in units))
        return self.service.controller.rows.lost(msg.indexes)

    async def _check_incarnation(self, unit: int) -> None:
        if not self.service.controller.placement.alive[unit] or unit in self._reviving:
            return  # (already lost)
        try:
            answer = await self._units[unit].call(m.UnitPing(), wait_s=_VERIFY_S)
        except TQError:
            return  # (silent: the heartbeat declares it lost within its bound)
        self._heard(unit, answer)

    async def register_unit(self, msg: m.RegisterUnit, caller: Caller) -> None:
        """A restarted unit: where it listens now, and its incarnation."""
        unit = msg.unit_id
        if unit >= len(self._units):
            raise BadRequestError(
                f"register_unit: unit_id {unit} is not one of this controller's units "
                f"(0..{len(self._units) - 1})"
            )
        # Believed only once the unit at that address answers with that incarnation: a
        # request that named another would otherwise cost the unit its rows.
        moved = msg.address != self.unit_addresses[unit]
        rpc = self._unit_client(unit, check_address(msg.address)) if moved else self._units[unit]
        try:
            answer = await rpc.call(m.UnitPing(), wait_s=_VERIFY_S)
        except TQError:
            answer = None
        if answer != msg.incarnation:
            if moved:
                await rpc.close()
            raise BadRequestError(
                f"register_unit: the unit at {msg.address} did not answer as incarnation "
                f"{msg.incarnation!r} within {_VERIFY_S} s"
            )
        if moved:
            old = self._units[unit]
            self._units[unit] = rpc
            self.unit_addresses[unit] = msg.address
            self.service.controller.health.set_unit_host(unit, _host_of(msg.address))
            if self._started:
                rpc.start_watch()
            await old.close()
        # Answered once the unit's old rows are lost and it is cleared: the unit takes new
        # rows only after this reply, so none written to it can be counted with the old ones.
        revival = self._heard(unit, msg.incarnation)
        if revival is not None:
            await asyncio.shield(revival)

    def hello(self, msg: m.Hello, caller: Caller) -> m.HelloReply:
        return m.HelloReply(PROTOCOL_VERSION, self.unit_addresses)

    async def reset(self, msg: m.Reset, caller: Caller) -> None:
        await self.service.reset()
        alive = self.service.controller.placement.alive
        await asyncio.gather(
            *(u.call(m.ResetUnit()) for i, u in enumerate(self._units) if alive[i])
        )

    async def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        await self.copier.close()
        await self.rpc.close()
        await self.service.close()
        for u in self._units:
            await u.close()


async def _nothing() -> None:
    return None


def _host_of(address: str) -> str:
    """The host part of a unit's address (``tcp://HOST:PORT``; every ``ipc://`` path is on
    this host): units that share it share a machine, as far as the controller can tell."""
    if address.startswith("tcp://"):
        return address[len("tcp://") :].rsplit(":", 1)[0]
    return "local"
