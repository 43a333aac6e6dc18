"""The weight transports' control channel: TransferQueue's typed request/reply layer, the
``weights`` server role, membership that mends itself (a sender that restarts, a receiver
that starts first). Real sockets and process groups, in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asyncflow.transport import links as links_module
from asyncflow.transport import make_transport
from asyncflow.transport import messages as m
from asyncflow.transport.control import ControlClient, ControlServer, unique_ipc_address
from transferqueue.errors import ProtocolError
from transferqueue.wire.protocol import KINDS, handlers
from transferqueue.wire.rpc import RpcClient

FAST: dict[str, dict[str, Any]] = {
    "shm": {"heartbeat_s": 0.2, "dead_after_s": 1.0, "timeout_s": 30.0},
    "broadcast": {"heartbeat_s": 0.2, "dead_after_s": 1.0, "timeout_s": 30.0},
}


def wait_until(what: Callable[[], bool], timeout_s: float = 30.0, why: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {why}")
        time.sleep(0.02)


def test_the_weights_kinds_are_a_role_of_their_own() -> None:
    """The weight senders' kinds sit in their own table: TransferQueue's ``ping`` of the
    controller and of the unit are untouched, and a server of the role needs every handler."""
    assert sorted(KINDS[m.ROLE]) == ["failed", "have", "join", "leave", "ping", "poll", "relay"]
    assert KINDS[m.ROLE]["ping"] is m.Ping
    assert KINDS["controller"]["ping"] is not m.Ping and KINDS["unit"]["ping"] is not m.Ping

    class OnlyPing:
        def ping(self, msg: m.Ping, caller: object) -> str:
            return "x"

    with pytest.raises(TypeError, match="no handler for the weights message kind"):
        handlers(m.ROLE, OnlyPing())
    with pytest.raises(TypeError, match="no message kinds are declared for the server role"):
        handlers("nobody", OnlyPing())


def test_a_message_refused_by_its_schema_is_a_typed_reply_and_the_sender_goes_on() -> None:
    transport = make_transport("shm", **FAST["shm"])
    sender = transport.sender()
    receiver = None
    try:

        async def strangers() -> list[BaseException]:
            import zmq.asyncio

            rpc = RpcClient(zmq.asyncio.Context.instance(), transport.address)  # type: ignore[attr-defined]
            errors: list[BaseException] = []
            try:
                for bad in (
                    m.Have(member="", version=0),  # an empty name
                    m.Poll(member="x", timeout_s=-1.0),  # a negative wait
                    m.Failed(member="x", version=0, reason="r" * 5000),  # over its bound
                ):
                    try:
                        await rpc.call(bad, wait_s=10)
                    except ProtocolError as e:
                        errors.append(e)
                # an unknown member is told to join, never served
                events = await rpc.call(m.Poll(member="x", timeout_s=0.1), wait_s=10)
                assert events is not None and [type(e) for e in events] == [m.Rejoin]
            finally:
                await rpc.close()
            return errors

        errors = asyncio.run(strangers())
        assert len(errors) == 3, errors
        assert all(str(e).startswith(("have:", "poll:", "failed:")) for e in errors), errors
        receiver = transport.receiver("r")
        wait_until(lambda: sender.members() == ["r"], why="the receiver to join")
        sender.publish({"w": torch.arange(4.0)}, 0)
        assert receiver.newest() == 0
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()


def test_a_bad_address_is_refused_with_the_expected_form() -> None:
    with pytest.raises(ValueError, match="address must be a ZeroMQ endpoint"):
        make_transport("shm", address="nowhere")


@pytest.mark.parametrize("name", ["shm", "broadcast"])
def test_receivers_join_a_restarted_sender_by_themselves(name: str) -> None:
    """The sender's process restarts (here: a second sender on the same address): the
    receiver notices the first one gone, resets what it held from it, joins the second and
    gets its versions, with nobody doing anything."""
    transport = make_transport(name, **FAST[name])
    first = transport.sender()
    receiver = transport.receiver("r")
    try:
        wait_until(lambda: first.members() == ["r"], why="the receiver to join")
        first.publish({"w": torch.zeros(8)}, 0)
        assert receiver.newest() == 0
        first.close()
        second = transport.sender()
        try:
            wait_until(lambda: second.members() == ["r"], why="the receiver to join again")
            second.publish({"w": torch.ones(8)}, 1)
            assert receiver.newest() == 1
            assert torch.equal(receiver.get(1)["w"], torch.ones(8))
            receiver.release(1)
        finally:
            second.close()
    finally:
        receiver.close()
        first.close()


def test_a_receiver_that_starts_first_joins_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver started well before its sender sends JOIN again each time its call runs out
    (``dead_after_s``); the sender, once up, takes them as one: one membership, one link (it
    built a link per JOIN, each waiting ``timeout_s`` for a peer that never came)."""
    pair_group, built = links_module.pair_group, []

    def counted(store: Any, prefix: str, rank: int, **kw: Any) -> Any:
        if rank == 0:
            built.append(prefix)
        return pair_group(store, prefix, rank, **kw)

    monkeypatch.setattr(links_module, "pair_group", counted)
    transport = make_transport("broadcast", **FAST["broadcast"])
    receiver = transport.receiver("early")
    try:
        time.sleep(3 * transport.dead_after_s)  # type: ignore[attr-defined]
        sender = transport.sender()
        try:
            wait_until(lambda: sender.members() == ["early"], why="the receiver to link")
            sender.publish({"w": torch.arange(3.0)}, 0)
            assert receiver.newest() == 0
            assert built == ["link/1"]
        finally:
            sender.close()
    finally:
        receiver.close()


def test_a_relay_reaches_the_member_it_names_and_only_from_a_member() -> None:
    """A receiver's event for another receiver (ipc: a holder's image for a newcomer) is
    passed on by the sender to that receiver's next poll; one from a stranger, or for a
    receiver that is not a member, is dropped and the channel goes on."""
    address = unique_ipc_address()
    got: dict[str, list[m.Event]] = {"a": [], "b": []}
    server = ControlServer(
        address,
        on_join=lambda member, msg: None,
        on_message=lambda member, msg: None,
        on_lost=lambda member, reason: None,
        heartbeat_s=0.2,
        dead_after_s=5.0,
    )
    server.start()
    ends = {
        name: ControlClient(
            address, name, on_message=got[name].append, heartbeat_s=0.2, dead_after_s=5.0
        )
        for name in ("a", "b")
    }
    try:
        for end in ends.values():
            end.start()
        wait_until(lambda: sorted(server.members()) == ["a", "b"], why="a and b to join")
        image = m.IpcImage(version=3, layout=[("w", "float32", [2], 0)], handle={"kind": "file"})
        ends["a"].send(m.Relay(member="z", to="b", event=image))  # not a member: dropped
        ends["a"].send(m.Relay(member="a", to="gone", event=image))  # nobody: dropped
        ends["a"].send(m.Relay(member="a", to="b", event=image))
        wait_until(lambda: bool(got["b"]), why="b to get the relayed image")
        time.sleep(0.5)  # (a few polls more: nothing else arrives)
        assert got["b"] == [image] and got["a"] == []
        assert sorted(server.members()) == ["a", "b"]  # (join order is theirs)
    finally:
        for end in ends.values():
            end.close()
        server.close()
