"""A server admits at most ``max_connections`` client connections (see
:mod:`transferqueue.wire.peers`): the next client gets a typed error naming the limit on its
first call while the admitted ones are served as before, a slot frees when a client closes,
the service's own connections are never refused, and ``stats`` shows the counts.

The servers run on a loop thread of the test's process, on real ZeroMQ sockets over tcp;
every client is a real ``transferqueue.connect`` handle (one connection to each server)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import zmq.asyncio
from test_replicas import LIVENESS, SLACK_S
from tq_helpers import row_values, until

import transferqueue
from transferqueue.deploy.server import ControllerServer, UnitServer
from transferqueue.deploy.top import render
from transferqueue.errors import CapacityError, TooManyConnectionsError
from transferqueue.limits import CONNECTION_FD_RESERVE
from transferqueue.loop import LoopThread
from transferqueue.wire import messages as m
from transferqueue.wire.auth import session_keys
from transferqueue.wire.grants import Grants
from transferqueue.wire.peers import check_max_connections, default_max_connections
from transferqueue.wire.rpc import RpcClient, RpcServer

LIMIT = 3
GRANT_KEY = b"g" * 32


class Store:
    """A controller and two units (``replicas=2``) serving on a loop thread."""

    def __init__(self, max_connections: int) -> None:
        self.io = LoopThread("test-servers")
        self.ctx = zmq.asyncio.Context()

        async def start() -> tuple[list[UnitServer], ControllerServer]:
            units = [
                UnitServer(self.ctx, i, grant_key=GRANT_KEY, max_connections=max_connections)
                for i in range(2)
            ]
            for u in units:
                u.start()
            ctl = ControllerServer(
                self.ctx,
                [u.address for u in units],
                grant_key=GRANT_KEY,
                replicas=2,
                spread_bytes=0,
                max_connections=max_connections,
            )
            await ctl.start()
            return units, ctl

        self.units, self.controller = self.io.run(start())
        self.address = self.controller.address

    def connections(self) -> list[dict[str, Any]]:
        """The controller's connection counts, then each unit's (read on the servers' loop)."""

        async def read() -> list[dict[str, Any]]:
            servers = [self.controller.rpc, *(u.rpc for u in self.units)]
            return [s.peers.snapshot() for s in servers]

        return self.io.run(read())

    def close(self) -> None:
        async def stop() -> None:
            await self.controller.close()
            for u in self.units:
                await u.close()

        self.io.run(stop())
        self.io.close()
        self.ctx.term()


@pytest.fixture
def store() -> Iterator[Store]:
    s = Store(LIMIT)
    try:
        yield s
    finally:
        s.close()


def _round_trip(tq: transferqueue.TransferQueue, start: int) -> None:
    """A put and a read of the same rows through every server: bit-exact."""
    c = tq.client()
    x = row_values(start, 4)
    meta = c.put({"x": x}, partition=f"p{start}")
    got = c.get_data(meta)["x"]
    assert isinstance(got, torch.Tensor) and torch.equal(got, x)


def test_a_client_past_the_limit_is_refused_naming_it_and_the_others_are_served(
    store: Store,
) -> None:
    with contextlib.ExitStack() as stack:
        admitted = [stack.enter_context(transferqueue.connect(store.address)) for _ in range(3)]
        with pytest.raises(TooManyConnectionsError) as refused:
            transferqueue.connect(store.address)
        text = str(refused.value)
        assert isinstance(refused.value, CapacityError)  # (a capacity error: typed as one)
        assert f"controller at {store.address}" in text
        assert f"max_connections={LIMIT}" in text and "ulimit -n" in text
        for i, tq in enumerate(admitted):  # served as before the refusal
            _round_trip(tq, 100 * i)
        ctl, *units = store.connections()
        assert ctl["clients"] == LIMIT and ctl["clients_peak"] == LIMIT
        assert ctl["refusals"] == 1 and ctl["max_connections"] == LIMIT
        # the controller's own connection to each unit (and its pings) is never counted
        # as a client: 3 clients plus the controller, at a limit of 3
        assert all(u["clients"] == LIMIT and u["internal"] == 1 for u in units)
        assert all(u["refusals"] == 0 and u["connections"] >= LIMIT + 1 for u in units)

        admitted.pop().close()  # a slot frees once its connection is gone
        late = until(lambda: _try_connect(store.address), 10.0, "a client admitted after a close")
        stack.enter_context(late)
        _round_trip(late, 900)
        _round_trip(admitted[0], 1000)
        ctl, *_ = store.connections()
        assert ctl["clients"] == LIMIT and ctl["clients_peak"] == LIMIT


def _try_connect(address: str) -> transferqueue.TransferQueue | None:
    try:
        return transferqueue.connect(address)
    except TooManyConnectionsError:
        return None


def test_stats_show_each_servers_connections(store: Store) -> None:
    with transferqueue.connect(store.address) as tq:
        stats = tq.client().stats()
        assert stats["controller"]["connections"]["clients"] == 1
        assert stats["controller"]["connections"]["max_connections"] == LIMIT
        for unit in stats["units"]:
            assert unit["connections"]["clients"] == 1
            assert unit["connections"]["internal"] == 1  # the controller's
        view = render(stats).splitlines()  # (transferqueue top)
        rows = [line.split() for line in view if line.startswith(("controller", "unit "))]
        assert "clients/max" in "\n".join(view) and len(rows) == 3
        assert all(r[-2:] == [f"1/{LIMIT}", "0"] for r in rows)


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keys"])
def test_an_internal_connection_is_never_refused_and_a_client_cannot_claim_to_be_one(
    keyed: bool,
) -> None:
    """At a limit of one: the service's own connections (request ids with bit 63) are served
    past it; with keys, only those that come with the service's own key: a client with a
    client key that claims to be internal is counted, and refused, as a client."""
    server_keys, client_keys = session_keys() if keyed else (None, None)
    own = None if server_keys is None else server_keys.as_client()

    async def scenario() -> tuple[list[Any], dict[str, Any]]:
        ctx = zmq.asyncio.Context()
        unit = UnitServer(ctx, 0, keys=server_keys, grant_key=GRANT_KEY, max_connections=1)
        unit.start()
        first = RpcClient(ctx, unit.address, keys=client_keys)
        claims = RpcClient(ctx, unit.address, keys=client_keys, internal=True)
        inner = [RpcClient(ctx, unit.address, keys=own, internal=True) for _ in range(3)]
        try:
            outcomes: list[Any] = [await first.call(m.UnitPing())]
            with contextlib.suppress(TooManyConnectionsError):
                outcomes.append(await claims.call(m.UnitPing()))
            outcomes += [await c.call(m.UnitPing()) for c in inner]
            return outcomes, unit.rpc.peers.snapshot()
        finally:
            for c in (first, claims, *inner):
                await c.close()
            await unit.close()
            ctx.term()

    outcomes, counts = asyncio.run(scenario())
    if keyed:  # the claim is refused: the first client holds the one slot
        assert len(outcomes) == 4 and counts["refused"] == 1
        assert counts["clients"] == 1 and counts["internal"] == 3
    else:  # without keys every caller is trusted: the claim is believed
        assert len(outcomes) == 5 and counts["refused"] == 0
        assert counts["clients"] == 1 and counts["internal"] == 4


def test_a_unit_copies_rows_to_a_unit_whose_client_slots_are_all_taken() -> None:
    """Re-replication at a limit of one: unit 0 copies rows to unit 1 while a client holds
    unit 1's one slot; the copy is the service's own connection, never refused, and the rows
    arrive bit-exact."""
    x = row_values(0, 4)
    rows = np.arange(4, dtype=np.int64)
    specs = {"x": transferqueue.FieldSpec.dense(torch.float64, (4,))}

    async def scenario() -> tuple[int, Any, dict[str, Any]]:
        ctx = zmq.asyncio.Context()
        units = [UnitServer(ctx, i, grant_key=GRANT_KEY, max_connections=1) for i in (0, 1)]
        for u in units:
            u.start()
        grants = Grants(GRANT_KEY)
        to0, to1 = RpcClient(ctx, units[0].address), RpcClient(ctx, units[1].address)
        try:
            await to1.call(m.UnitPing())  # the one client slot of unit 1 is taken
            await to0.call(
                m.Write(
                    indexes=rows,
                    columns={"x": x},
                    specs=specs,
                    create=True,
                    grant=grants.sign(0, 0, 4),
                )
            )
            copy = m.CopyRows(
                indexes=rows,
                fields=["x"],
                specs=specs,
                target=1,
                address=units[1].address,
                grant=grants.sign(1, 0, 4),
                timeout_s=10.0,
            )
            copied = await to0.call(copy)
            back = await to1.call(m.Read(indexes=rows, fields=["x"]))
            return copied, back["x"], units[1].rpc.peers.snapshot()
        finally:
            for c in (to0, to1):
                await c.close()
            for u in units:
                await u.close()
            ctx.term()

    copied, back, counts = asyncio.run(scenario())
    assert copied == 4 and torch.equal(back, x)
    assert counts["clients"] == 1 and counts["internal"] == 1 and counts["refusals"] == 0


def test_a_refused_connection_is_admitted_at_its_next_request_once_a_slot_frees() -> None:
    async def scenario() -> tuple[int, dict[str, Any]]:
        ctx = zmq.asyncio.Context()
        server = RpcServer(ctx, "tcp://127.0.0.1:0", "unit", _ping_handlers(), max_connections=1)
        server.start()
        first, second = RpcClient(ctx, server.address), RpcClient(ctx, server.address)
        try:
            await first.call(m.UnitPing())
            with pytest.raises(TooManyConnectionsError, match="max_connections=1"):
                await second.call(m.UnitPing())
            await first.close()
            tries = 0
            while True:  # (the server learns of the close from its monitor: soon)
                tries += 1
                try:
                    await second.call(m.UnitPing())
                    break
                except TooManyConnectionsError:
                    assert tries < 100
                    await asyncio.sleep(0.02)
            return tries, server.peers.snapshot()
        finally:
            await first.close()
            await second.close()
            await server.close()
            ctx.term()

    _, counts = asyncio.run(scenario())
    assert counts["clients"] == 1 and counts["refused"] == 0 and counts["refusals"] >= 1
    assert counts["clients_peak"] == 1


def _ping_handlers() -> dict[Any, Any]:
    from transferqueue.wire import protocol

    class Pong:
        def __getattr__(self, kind: str) -> Any:
            return lambda msg, caller: "pong"

    return protocol.handlers("unit", Pong())


def test_the_default_follows_the_open_file_limit_and_bad_settings_are_refused() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        assert default_max_connections() == max(soft - CONNECTION_FD_RESERVE, soft // 2)
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_connections must be an integer >= 1"):
            check_max_connections(bad)
    assert check_max_connections(None) is None and check_max_connections(8) == 8


@pytest.mark.service
def test_serve_passes_max_connections_to_every_server_process() -> None:
    """``transferqueue.serve(max_connections=...)`` (the CLI's ``--max-connections``): each
    server process admits that many clients, and a bad value is refused before any starts."""
    with pytest.raises(ValueError, match="max_connections must be an integer >= 1"):
        transferqueue.serve(num_units=1, max_connections=0)
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, max_connections=2) as svc,
        transferqueue.connect(svc.address) as a,
        transferqueue.connect(svc.address) as b,
    ):
        with pytest.raises(TooManyConnectionsError, match="max_connections=2"):
            transferqueue.connect(svc.address)
        _round_trip(a, 0)
        _round_trip(b, 10)
        stats = a.client().stats()
        for server in (stats["controller"], *stats["units"]):
            assert server["connections"]["clients"] == 2
            assert server["connections"]["max_connections"] == 2


@pytest.mark.slow
def test_a_storm_of_clients_past_the_limit_each_get_an_answer_at_once() -> None:
    """2,000 clients connect at once to a unit that admits 1,500: every first call is answered
    within seconds (a listen backlog of ZeroMQ's default 100 dropped SYNs: 1-31 s of retries
    were measured), 1,500 served and 500 refused, and each keeps its outcome."""
    n, limit = 2000, 1500
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 3 * n:
        pytest.skip(f"needs an open-file limit of {3 * n} (ulimit -n), have {soft}")

    async def scenario() -> tuple[float, list[Any], list[Any], dict[str, Any]]:
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, 2 * n + 64)
        unit = UnitServer(ctx, 0, grant_key=GRANT_KEY, max_connections=limit)
        unit.start()
        clients = [RpcClient(ctx, unit.address, call_timeout_s=60) for _ in range(n)]
        try:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            first = await asyncio.gather(
                *(c.call(m.UnitPing()) for c in clients), return_exceptions=True
            )
            took = loop.time() - t0
            again = await asyncio.gather(
                *(c.call(m.UnitPing()) for c in clients), return_exceptions=True
            )
            return took, first, again, unit.rpc.peers.snapshot()
        finally:
            for c in clients:
                await c.close()
            await unit.close()
            ctx.term()

    took, first, again, counts = asyncio.run(scenario())
    served = [isinstance(r, str) for r in first]
    assert sum(served) == limit
    assert all(isinstance(r, TooManyConnectionsError) for r in first if not isinstance(r, str))
    assert [isinstance(r, str) for r in again] == served  # the same clients, both rounds
    assert took < 10.0, f"first calls of {n} clients took {took:.1f} s"
    assert counts["clients"] == limit and counts["refused"] == n - limit
    assert counts["connections"] == n and counts["refusals"] == 2 * (n - limit)


@pytest.mark.slow
@pytest.mark.service
def test_a_killed_unit_registers_and_gets_its_copies_while_every_client_slot_is_taken() -> None:
    """``replicas=2`` at a limit of one client per server, the one client holding every
    slot: unit 1 is killed, restarted by the service, registers with the controller, and
    unit 0 copies the rows back to it; none of these connections is refused."""
    x = row_values(0, 64)
    with (
        transferqueue.serve(num_units=2, spread_bytes=0, replicas=2, max_connections=1) as svc,
        transferqueue.connect(svc.address) as tq,
    ):
        c = tq.client()
        meta = c.put({"x": x}, partition="p")
        with pytest.raises(TooManyConnectionsError):
            transferqueue.connect(svc.address)
        os.kill(svc.pids[1], signal.SIGKILL)
        bound_s = LIVENESS.bound_s + SLACK_S

        def ctl() -> dict[str, Any]:
            return c.stats()["controller"]

        until(lambda: svc.restarts[1] == 1, bound_s, "unit 1 restarted")
        until(lambda: ctl()["units_lost"] == 1 and all(ctl()["units_alive"]), bound_s, "back")
        until(lambda: ctl()["rows_recopied"] == 64, bound_s, "the rows copied to unit 1 again")
        got = c.get_data(meta)["x"]
        assert isinstance(got, torch.Tensor) and torch.equal(got, x)
        stats = c.stats()
        servers = [stats["controller"], *stats["units"]]
        # (only the second client's hello was refused, by the controller)
        assert [s["connections"]["refusals"] for s in servers] == [1, 0, 0]
        assert all(s["connections"]["clients"] == 1 for s in servers)
        assert stats["units"][1]["connections"]["internal"] >= 1  # (the copies' and pings')
        assert stats["units"][1]["rows"] == 64 and stats["controller"]["rows_lost"] == 0


@pytest.mark.slow
@pytest.mark.ray
def test_start_on_ray_passes_max_connections_to_every_server_actor(ray_cluster: None) -> None:
    from transferqueue.deploy.ray import start_on_ray

    with start_on_ray(num_units=2, spread_bytes=0, max_connections=1) as tq:
        _round_trip(tq, 0)
        stats = tq.client().stats()
        for server in (stats["controller"], *stats["units"]):
            assert server["connections"]["max_connections"] == 1
            assert server["connections"]["clients"] == 1
        assert tq.address is not None
        with pytest.raises(TooManyConnectionsError, match="max_connections=1"):
            transferqueue.connect(tq.address)
