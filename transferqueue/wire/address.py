"""TransferQueue's endpoints: the forms an address may take, checked before any socket opens,
and binding one (``tcp://HOST:0`` picks a free port).

    tcp://HOST:PORT    a port 1..65535 (binding: 0 or ``*`` picks a free one)
    ipc:///PATH        a Unix socket path (this host only)
    inproc://NAME      within one process (one ZeroMQ context)
"""

from __future__ import annotations

from typing import Any

import zmq

from transferqueue.errors import BadRequestError

__all__ = ["bind_address", "check_address"]


def check_address(address: Any, *, bind: bool = False) -> str:
    """``address`` if it is an endpoint TransferQueue can use; else a
    :class:`BadRequestError` showing the expected form (checked before any socket opens)."""
    ok = False
    if isinstance(address, str):
        if address.startswith("tcp://"):
            host, sep, port = address[len("tcp://") :].rpartition(":")
            low = 0 if bind else 1
            ok = bool(sep and host) and (
                (port.isdigit() and low <= int(port) <= 65535) or (bind and port == "*")
            )
        elif address.startswith(("ipc://", "inproc://")):
            ok = len(address.split("://", 1)[1]) > 0
    if not ok:
        raise BadRequestError(
            f"{address!r} is not a TransferQueue address; expected tcp://HOST:PORT (for "
            "example tcp://127.0.0.1:5555, as `transferqueue serve` prints it) or ipc:///PATH"
        )
    return str(address)


def bind_address(sock: zmq.Socket[Any], address: str) -> str:
    """Bind ``address``; ``tcp://host:0`` picks a free port. Returns the bound address."""
    if address.startswith("tcp://") and address.rsplit(":", 1)[-1] in ("0", "*"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(address)
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
