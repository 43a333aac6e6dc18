"""Keys, and who may do what: ZeroMQ CURVE on every socket of a service beyond loopback.

A service listening anywhere but ``127.0.0.1``, ``::1``, ``localhost`` or an ``ipc://`` path
needs keys; without them it refuses to start. With keys, every connection is encrypted and
authenticated (CURVE): a peer without an authorized key gets no answer at all, not even to
``stats``. ``transferqueue keygen DIR`` writes them (ZeroMQ certificate files)::

    DIR/server.key_secret   the service's keypair: every server loads it (the controller
                            also reaches the units with it)
    DIR/server.key          its public key: every client needs it
    DIR/client.key_secret   a client's keypair (``--client NAME``: NAME.key_secret)
    DIR/client.key
    DIR/admin.key_secret    with ``--admin``: the only key that may ``clear`` and ``reset``
    DIR/admin.key           (when an ``admin*.key`` exists; otherwise every client may)

Servers trust every ``*.key`` public key in DIR. A client host needs ``server.key`` and its
own ``*.key_secret``. Keys reach the code by argument (``keys=DIR``, ``--keys DIR``) or
through the environment, read here and nowhere else:

| variable                  | meaning                                                       |
|---------------------------|---------------------------------------------------------------|
| TRANSFERQUEUE_KEYS        | the key directory (servers and clients)                       |
| TRANSFERQUEUE_CLIENT_KEY  | a client's secret key file (default: DIR/client.key_secret,   |
|                           | else admin.key_secret, else server.key_secret)                |
| TRANSFERQUEUE_GRANT_KEY   | set by a service for its own server processes (see grants)    |

A request's caller is the client's public key (z85, :class:`~transferqueue.wire.messages.Caller`):
leases are bound to it, and admin-only kinds check it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
import zmq.auth.thread

from transferqueue.errors import AuthError
from transferqueue.wire.protocol import Caller

__all__ = [
    "ClientKeys",
    "ServerKeys",
    "advertised_host",
    "client_keys",
    "grant_key_from_env",
    "is_loopback",
    "keygen",
    "require_keys",
    "server_keys",
    "session_keys",
]

ENV_KEYS = "TRANSFERQUEUE_KEYS"
ENV_CLIENT_KEY = "TRANSFERQUEUE_CLIENT_KEY"
ENV_GRANT_KEY = "TRANSFERQUEUE_GRANT_KEY"
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
_KEYGEN_HINT = (
    "create keys with `transferqueue keygen DIR` and pass them to the service and its clients "
    f"(--keys DIR, keys=DIR, or {ENV_KEYS}=DIR)"
)


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs: the service's public key and its own keypair (z85)."""

    server: bytes
    public: bytes
    secret: bytes

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True)
class ServerKeys:
    """What a server needs: the service's keypair and the public keys it trusts (z85)."""

    public: bytes
    secret: bytes
    clients: frozenset[bytes]
    admins: frozenset[bytes] = frozenset()

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret

    def as_client(self) -> ClientKeys:
        """The keys one server uses to reach another (the controller reaching units)."""
        return ClientKeys(self.public, self.public, self.secret)

    def caller(self, user_id: str) -> Caller:
        key = user_id.encode()
        if key == self.public:
            return Caller(user_id, "service")
        if key in self.admins or not self.admins:
            return Caller(user_id, "admin")
        return Caller(user_id, "client")

    def authenticator(self, ctx: zmq.Context[Any]) -> zmq.auth.thread.ThreadAuthenticator:
        """ZeroMQ's authentication handler for ``ctx``: only trusted keys get in."""
        allowed = self.clients | {self.public}

        class _Provider:
            def callback(self, domain: str, key: bytes) -> bool:
                return key in allowed

        auth = zmq.auth.thread.ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_Provider())
        return auth


def keygen(
    directory: str | os.PathLike[str],
    *,
    clients: tuple[str, ...] = ("client",),
    admin: bool = False,
) -> list[Path]:
    """Write the service's keypair, client keypairs and (``admin``) an admin keypair into
    ``directory``; existing files are kept. Returns the files written."""
    if not zmq.has("curve"):
        raise AuthError("this libzmq was built without CURVE; install pyzmq's wheels")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    written = []
    for name in ("server", *clients, *(("admin",) if admin else ())):
        if not (d / f"{name}.key_secret").exists():
            pub, sec = zmq.auth.create_certificates(d, name)
            os.chmod(sec, 0o600)
            written += [Path(pub), Path(sec)]
    return written


def session_keys() -> tuple[ServerKeys, ClientKeys]:
    """A fresh service keypair and one client keypair, in memory (nothing written): for a
    deployment that starts the service and hands the client keys to its own processes, e.g.
    over Ray's control plane. The client is the only trusted key, and so an admin."""
    if not zmq.has("curve"):
        raise AuthError("this libzmq was built without CURVE; install pyzmq's wheels")
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    server = ServerKeys(server_public, server_secret, frozenset({client_public}))
    return server, ClientKeys(server_public, client_public, client_secret)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read key file {path}: {e}; {_KEYGEN_HINT}") from None


def _directory(keys: str | os.PathLike[str] | None) -> Path | None:
    if keys is None:
        keys = os.environ.get(ENV_KEYS) or None
    if keys is None:
        return None
    d = Path(keys)
    if not d.is_dir():
        raise AuthError(f"key directory {d} does not exist; {_KEYGEN_HINT}")
    return d


def server_keys(keys: ServerKeys | str | os.PathLike[str] | None = None) -> ServerKeys | None:
    """The server's keys: given, or loaded from a directory (argument, else
    ``TRANSFERQUEUE_KEYS``); None when there are none."""
    if isinstance(keys, ServerKeys):
        return keys
    d = _directory(keys)
    if d is None:
        return None
    public, secret = _load(d / "server.key_secret")
    if secret is None:
        raise AuthError(f"{d / 'server.key_secret'} holds no secret key")
    trusted = {name: _load(name)[0] for name in sorted(d.glob("*.key"))}
    admins = frozenset(k for p, k in trusted.items() if p.name.startswith("admin"))
    return ServerKeys(public, secret, frozenset(trusted.values()), admins)


def client_keys(keys: ClientKeys | str | os.PathLike[str] | None = None) -> ClientKeys | None:
    """A client's keys: given, or loaded from a directory (argument, else
    ``TRANSFERQUEUE_KEYS``) with the secret key of ``TRANSFERQUEUE_CLIENT_KEY`` or the
    directory's client, admin or server key; None when there are none."""
    if isinstance(keys, ClientKeys):
        return keys
    d = _directory(keys)
    if d is None:
        return None
    server, _ = _load(d / "server.key")
    named = os.environ.get(ENV_CLIENT_KEY)
    candidates = (
        [Path(named)] if named else [d / f"{n}.key_secret" for n in ("client", "admin", "server")]
    )
    for path in candidates:
        if path.exists():
            public, secret = _load(path)
            if secret is None:
                raise AuthError(f"{path} holds no secret key")
            return ClientKeys(server, public, secret)
    raise AuthError(
        f"no client secret key in {d} (looked for {[p.name for p in candidates]}); {_KEYGEN_HINT}"
    )


def grant_key_from_env() -> bytes | None:
    """The grant key a service handed its server processes (hex), if any."""
    value = os.environ.get(ENV_GRANT_KEY)
    return bytes.fromhex(value) if value else None


def _host(address: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` address; None for ipc/inproc."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://") :].rsplit(":", 1)[0]


def is_loopback(address_or_host: str) -> bool:
    """Whether only this host can reach it: ``127.0.0.1``, ``::1``, ``localhost``, ipc,
    inproc. (Other 127.x addresses count as beyond loopback: the rule stays one line.)"""
    host = _host(address_or_host) if "://" in address_or_host else address_or_host
    return host is None or host in _LOOPBACK


def require_keys(address_or_host: str, keys: ServerKeys | None) -> None:
    """Refuse to listen beyond loopback without keys, saying what to do."""
    if keys is None and not is_loopback(address_or_host):
        raise AuthError(
            f"refusing to listen on {address_or_host} without keys: anyone who can reach it "
            f"could read, change or drop every row. {_KEYGEN_HINT[0].upper()}{_KEYGEN_HINT[1:]}; "
            "or listen on 127.0.0.1 only"
        )
    if keys is not None and not zmq.has("curve"):
        raise AuthError("this libzmq was built without CURVE; keys cannot be used")


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host clients are told to connect to: ``advertise_host``, else the bound host, else
    (bound to every interface) the address this host reaches other hosts from."""
    if advertise_host:
        return advertise_host
    if bind_host not in ("0.0.0.0", "*", "::", "[::]"):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # (UDP: picks a route, sends nothing)
            host = str(s.getsockname()[0])
        except OSError:
            host = ""
    try:
        routable = bool(host) and not ipaddress.ip_address(host).is_loopback
    except ValueError:
        routable = False
    if not routable:
        raise ValueError(
            f"listening on {bind_host}, but this host has no address other hosts could reach "
            "it by; pass --advertise-host (advertise_host=) with the name clients should use"
        )
    return host
