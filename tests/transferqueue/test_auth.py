"""A service beyond loopback: CURVE keys or no start at all; without a trusted key no read,
ack, clear or even stats; leases answer only to the client that took them; clear and reset
only to the admin key. (127.0.0.2 stands in for a network address: only 127.0.0.1 counts as
loopback.)"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import rawwire as raw
import torch
import zmq

import transferqueue
from transferqueue.errors import AuthError, DeniedError, PeerGoneError, UnknownLeaseError
from transferqueue.wire import codec as wire
from transferqueue.wire import messages as m
from transferqueue.wire.auth import ClientKeys, client_keys, keygen, server_keys

pytestmark = [
    pytest.mark.service,
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
]

HOST = "127.0.0.2"


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    keygen(d, clients=("client", "other"), admin=True)
    return d


@pytest.fixture(scope="module")
def service(keys: Path) -> Iterator[transferqueue.LocalService]:
    with transferqueue.serve(num_units=1, host=HOST, keys=keys) as svc:
        yield svc


def _as(keys: Path, name: str) -> ClientKeys:
    base = client_keys(keys)
    assert base is not None
    public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
    assert secret is not None
    return ClientKeys(base.server, public, secret)


def test_keygen_writes_private_secret_keys(keys: Path) -> None:
    names = sorted(p.name for p in keys.iterdir())
    for n in ("server", "client", "other", "admin"):
        assert f"{n}.key" in names and f"{n}.key_secret" in names
        assert stat.S_IMODE(os.stat(keys / f"{n}.key_secret").st_mode) == 0o600
    loaded = server_keys(keys)
    assert loaded is not None and len(loaded.clients) == 4 and len(loaded.admins) == 1


def test_listening_beyond_loopback_without_keys_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="transferqueue keygen"):
        transferqueue.serve(num_units=1, host=HOST)
    proc = subprocess.run(
        [sys.executable, "-m", "transferqueue.deploy.cli", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "TRANSFERQUEUE_KEYS"},
    )
    assert proc.returncode == 2 and "--keys DIR" in proc.stderr, proc.stderr


def test_a_client_with_the_keys_works(service: transferqueue.LocalService, keys: Path) -> None:
    assert service.address.startswith(f"tcp://{HOST}:")  # what clients are told
    with transferqueue.connect(service.address, keys=keys) as tq:
        client = tq.client()
        x = torch.randn(16, 8)
        client.put({"x": x, "o": ["ü"] * 16}, group=0, partition="keyed")
        meta = client.get_meta("t", ["x", "o"], 16, partition="keyed", timeout_s=10)
        cols = client.get_data(meta)
        assert torch.equal(cols["x"], x) and cols["o"] == ["ü"] * 16  # type: ignore[arg-type]
        client.ack(meta)
        assert client.stats()["controller"]["partitions"]["keyed"]["rows_put"] == 16


@pytest.mark.slow
def test_without_a_trusted_key_nothing_is_answered(
    service: transferqueue.LocalService, keys: Path
) -> None:
    """Not stats, not a read, not an ack, not a clear: with no key, or a key of its own."""
    with transferqueue.connect(service.address, keys=keys) as tq:
        client = tq.client()
        meta = client.put({"g": torch.arange(4)}, group=0, partition="guarded")
        leased = client.get_meta("g", ["g"], 4, partition="guarded", timeout_s=10)
        with pytest.raises(PeerGoneError, match="keys"):
            transferqueue.connect(service.address, connect_timeout_s=1)
        stranger = zmq.curve_keypair()
        ctx = zmq.Context()
        try:
            for who in ("no key", "unknown key"):
                for address, msg in [
                    (service.address, m.Stats()),
                    (service.address, m.Ack(lease_id=leased.lease_id or 1)),
                    (service.address, m.Clear()),
                    (service.unit_addresses[0], m.UnitStats()),
                    (service.unit_addresses[0], m.Read(indexes=meta.indexes, fields=["g"])),
                    (service.unit_addresses[0], m.ClearUnit()),
                ]:
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    if who == "unknown key":
                        base = client_keys(keys)
                        assert base is not None
                        ClientKeys(base.server, *stranger).apply(sock)
                    sock.connect(address)
                    sock.send_multipart([bytes(f) for f in wire.encode_request(5, msg)])
                    assert not sock.poll(1500), (who, msg.kind)  # no answer at all
                    sock.close()
        finally:
            ctx.destroy(linger=0)
        assert client.get_data(meta)["g"].tolist() == [0, 1, 2, 3]  # type: ignore[union-attr]
        client.ack(leased)  # the lease was not acked by anyone else


def test_a_lease_answers_only_to_the_client_that_took_it(
    service: transferqueue.LocalService, keys: Path
) -> None:
    mine = transferqueue.connect(service.address, keys=_as(keys, "client"))
    other = transferqueue.connect(service.address, keys=_as(keys, "other"))
    try:
        a, b = mine.client(), other.client()
        a.put({"l": torch.arange(4)}, group=0, partition="leases")
        meta = a.get_meta("t", ["l"], 4, partition="leases", timeout_s=10)
        assert meta.lease_id is not None and meta.lease_id > 2**32  # (random, not 1, 2, ...)
        with pytest.raises(UnknownLeaseError, match="never issued to this client"):
            b.ack(meta)
        with pytest.raises(UnknownLeaseError):
            b.put({"l2": torch.arange(4)}, meta=meta)  # renew, then commit: refused
        with pytest.raises(UnknownLeaseError):
            b.release(meta)
        a.ack(meta)
        assert a.stats()["controller"]["active_leases"] == 0
    finally:
        mine.close()
        other.close()


def test_clear_and_reset_need_the_admin_key(
    service: transferqueue.LocalService, keys: Path
) -> None:
    with transferqueue.connect(service.address, keys=_as(keys, "client")) as tq:
        client = tq.client()
        client.put({"a": torch.arange(2)}, group=0, partition="admin")
        with pytest.raises(DeniedError, match="admin key"):
            client.clear("admin")
        with pytest.raises(DeniedError, match="admin key"):
            tq.reset()
        assert client.stats()["controller"]["partitions"]["admin"]["rows_live"] == 2
    with transferqueue.connect(service.address, keys=_as(keys, "admin")) as tq:
        tq.client().clear("admin")
        assert tq.client().stats()["controller"]["partitions"]["admin"]["rows_live"] == 0


def test_a_unit_refuses_a_free_without_the_grant_from_a_plain_client(
    service: transferqueue.LocalService, keys: Path
) -> None:
    with transferqueue.connect(service.address, keys=_as(keys, "client")) as tq:
        client = tq.client()
        meta = client.put({"f": torch.arange(2)}, group=0, partition="free")
        (link,) = tq._units
        with pytest.raises(DeniedError, match="grant"):
            tq._io.run(link.free(np.asarray(meta.indexes)))
        assert client.get_data(meta)["f"].tolist() == [0, 1]  # type: ignore[union-attr]
        ctx = zmq.Context()
        try:  # a raw write naming row 2**27 with this client's key: denied, nothing sized
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            _as(keys, "client").apply(sock)
            sock.connect(service.unit_addresses[0])
            col = raw.tensor("int64", [1], raw.inline(b"\x00" * 8))
            body = [
                raw.int64s([2**27]),
                {"x": col},
                {"x": {"kind": "dense", "dtype": "int64"}},
                True,
            ]
            assert raw.error_code(raw.ask(sock, raw.request("write", body))) == "denied"
        finally:
            ctx.destroy(linger=0)


@pytest.mark.ray
def test_the_ray_deployment_uses_the_same_keys(ray_cluster: None, keys: Path) -> None:
    from transferqueue.deploy.ray import start_on_ray

    tq = start_on_ray(num_units=1, keys=keys, host=HOST)
    try:
        client = tq.client()
        meta = client.put({"x": torch.arange(3)}, group=0)
        assert client.get_data(meta)["x"].tolist() == [0, 1, 2]  # type: ignore[union-attr]
        assert tq.address is not None
        with pytest.raises(PeerGoneError):
            transferqueue.connect(tq.address, connect_timeout_s=1)
    finally:
        tq.close()
    with pytest.raises(Exception, match="keygen"):
        start_on_ray(num_units=1, host=HOST)  # beyond loopback without keys: refused


def test_clients_are_given_the_advertised_host(keys: Path) -> None:
    from transferqueue.wire.auth import advertised_host

    assert advertised_host(HOST) == HOST and advertised_host("0.0.0.0", "node7") == "node7"
    try:  # bound to every interface: the address this host reaches others from
        assert not advertised_host("0.0.0.0").startswith("127.")
    except ValueError as e:  # (a host with no route out: the error says what to pass)
        assert "--advertise-host" in str(e)
    with transferqueue.serve(
        num_units=1, host="0.0.0.0", keys=keys, advertise_host="127.0.0.3"
    ) as svc:
        assert svc.address.startswith("tcp://127.0.0.3:")
        assert all(a.startswith("tcp://127.0.0.3:") for a in svc.unit_addresses)
        with transferqueue.connect(svc.address, keys=keys) as tq:  # reachable there
            assert tq.client().stats()["units"][0]["rows"] == 0


def test_a_request_zeromq_cannot_queue_fails_as_the_peer_gone_naming_keys(
    service: transferqueue.LocalService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DEALER whose connection the server dropped (a refused handshake: no keys) has no
    pipe to queue a request on until it reconnects, and ZeroMQ refuses the send. The call
    fails at once as the peer gone, naming keys (what ``connect`` and ride-through expect),
    never with ZeroMQ's own error. The refusal is made here: its timing is the kernel's."""
    import asyncio

    import zmq.asyncio

    from transferqueue.wire.rpc import RpcClient

    def refuse(*args: object, **kwargs: object) -> None:
        raise zmq.Again()

    async def go() -> None:
        ctx = zmq.asyncio.Context()
        client = RpcClient(ctx, service.address, call_timeout_s=60)
        monkeypatch.setattr(client._io, "send", refuse)
        try:
            t0 = asyncio.get_running_loop().time()
            with pytest.raises(PeerGoneError, match="keys"):
                await client.call(m.Stats())
            assert asyncio.get_running_loop().time() - t0 < 30  # at once, not the call's bound
        finally:
            await client.close()
            ctx.term()

    asyncio.run(go())
