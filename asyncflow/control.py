"""A running job's control channel: ``asyncflow scale OUTPUT_DIR rollout=N reward=M``.

The driver of a run whose deployment can scale (``deploy=ray``) listens on a ZeroMQ REP
socket on loopback and writes its address into the run's output folder, ``control.json``
(removed when the run ends); the output folder names the run. One request, one reply, both
one msgpack map:

| request                                 | reply                                          |
|-----------------------------------------|------------------------------------------------|
| ``{"op": "scale", "stage": s, "n": n}`` | ``{"ok": true, "stage": s, "n": n, "was": m}`` |
| ``{"op": "instances"}``                 | ``{"ok": true, "instances": {stage: n}}``      |
| anything the driver refuses             | ``{"ok": false, "error": "one line"}``         |

Requests are checked twice: by the command (:func:`parse_scale`, before anything is sent) and
by the driver (:meth:`ControlServer` refuses what its deployment cannot scale), so that a bad
request never disturbs the run. On loopback (``deploy.control_host``'s default) whoever can
open a local socket on the driver's host may scale the run (the same trust as ``ray`` itself
on one node). Beyond loopback the channel speaks CURVE, as TransferQueue's servers do: the
driver refuses to listen without keys (``transferqueue.keys=DIR``, ``transferqueue keygen
DIR``), trusts every ``*.key`` of that directory, and the command connects with the client key
of ``--keys DIR`` (or ``TRANSFERQUEUE_KEYS``); ``control.json`` says whether keys are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from transferqueue.aio import within
from transferqueue.errors import AuthError
from transferqueue.wire.auth import (
    advertised_host,
    client_keys,
    is_loopback,
    require_keys,
    server_keys,
)

__all__ = [
    "CONTROL_FILE",
    "SCALABLE",
    "ControlError",
    "ControlServer",
    "ask",
    "check_stage",
    "parse_scale",
    "serve",
]

log = logging.getLogger(__name__)

CONTROL_FILE = "control.json"
"""The control channel's address in a running job's output folder."""

SCALABLE = ("rollout", "reward")
"""The stages a ``deploy.mode=ray`` run scales while it runs (``reward``: its workers, so not
with ``reward.colocate=true``)."""

STAGES = ("rollout", "reward", "reference", "train")
"""Every stage a request may name (only a deployment's ``scalable`` ones can be scaled)."""

Scaler = Callable[[str, int], Awaitable[int]]
"""``scale(stage, n)``: the stage's instance count before; raises ``ControlError``."""


class ControlError(ValueError):
    """A scale request that cannot be done: the message is the one line to print."""


def parse_scale(args: Sequence[str], scalable: Sequence[str] = SCALABLE) -> dict[str, int]:
    """``["rollout=2", ...]`` as ``{"rollout": 2}``; a ``ControlError`` naming what can be
    scaled for a stage that cannot, a count below 1 or a malformed argument."""
    can = ", ".join(f"{s}=N" for s in scalable)
    if not args:
        raise ControlError(f"nothing to scale: give {can}")
    out: dict[str, int] = {}
    for arg in args:
        stage, eq, value = arg.partition("=")
        if not eq:
            raise ControlError(f"{arg!r} is not STAGE=N; what can be scaled: {can}")
        check_stage(stage, scalable)
        try:
            n = int(value)
        except ValueError:
            raise ControlError(
                f"{stage}={value!r}: N must be an integer >= 1, as in {can}"
            ) from None
        if n < 1:
            raise ControlError(
                f"{stage}={n}: a stage keeps at least 1 instance; what can be scaled: {can}"
            )
        out[stage] = n
    return out


def check_stage(stage: str, scalable: Sequence[str]) -> None:
    """Raise ``ControlError`` unless ``stage`` is one of ``scalable``."""
    if stage in scalable:
        return
    can = ", ".join(f"{s}=N" for s in scalable) or "nothing (deploy.mode=ray scales rollout)"
    if stage == "train":
        why = "the train stage cannot be scaled while it runs (its ranks form one group)"
    elif stage == "reward" and "rollout" in scalable:  # (a deploy.mode=ray run's only cause)
        why = (
            "this run scores in the rollout host (reward.colocate=true): it has no reward "
            "workers to scale (start it with reward.colocate=false)"
        )
    elif stage in STAGES:
        why = f"the {stage} stage cannot be scaled in this run"
    else:
        why = f"unknown stage {stage!r}"
    raise ControlError(f"{why}; what can be scaled: {can}")


class ControlServer:
    """The driver's side: a REP socket on loopback answering scale requests with ``scale``
    (run on the driver's loop, one request at a time), its address in ``out_dir``'s
    :data:`CONTROL_FILE` until :meth:`close`."""

    def __init__(
        self,
        out_dir: Path,
        scale: Scaler,
        instances: Callable[[], dict[str, int]],
        scalable: Sequence[str],
        host: str = "127.0.0.1",
        keys: str | os.PathLike[str] | None = None,
    ) -> None:
        self._scale = scale
        self._closed = False
        self._instances = instances
        self.scalable = tuple(scalable)
        # beyond loopback: CURVE with the run's keys, or no channel at all (see module doc)
        server = server_keys(keys) if keys is not None or not is_loopback(host) else None
        require_keys(host, server)
        self._ctx = zmq.asyncio.Context()
        self._auth = None if server is None else server.authenticator(self._ctx)
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        if server is not None:
            server.apply(self._sock)
        self.file = out_dir / CONTROL_FILE
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
            self.address = f"tcp://{advertised_host(host)}:{port}"
            tmp = self.file.with_suffix(".tmp")
            info = {"address": self.address, "pid": os.getpid(), "curve": server is not None}
            tmp.write_text(json.dumps(info))
            tmp.replace(self.file)  # (a reader never sees half a file)
        except BaseException:
            self.close()
            raise

    async def run(self) -> None:
        """Answer requests until cancelled; a request in hand then is answered with an error
        (the run ended), so that its command does not wait out its timeout."""
        while True:
            raw = await self._sock.recv()
            try:
                reply = await self.handle(raw)
            except asyncio.CancelledError:
                ended = {"ok": False, "error": "the run ended before the request was done"}
                with contextlib.suppress(Exception):
                    await within(self._sock.send(msgpack.packb(ended)), 1.0)
                raise
            await self._sock.send(msgpack.packb(reply))

    async def handle(self, raw: bytes) -> dict[str, Any]:
        """One request's reply (never raises: a refusal is ``{"ok": false, ...}``)."""
        try:
            req = msgpack.unpackb(raw)
            if not isinstance(req, dict):
                raise ControlError("a request is a map with an 'op'")
            op = req.get("op")
            if op == "instances":
                return {"ok": True, "instances": self._instances()}
            if op != "scale":
                raise ControlError(f"unknown op {op!r}: 'scale' or 'instances'")
            stage, n = req.get("stage"), req.get("n")
            if not isinstance(stage, str) or not isinstance(n, int) or isinstance(n, bool):
                raise ControlError("a scale request names a stage (str) and n (int)")
            parse_scale([f"{stage}={n}"], self.scalable)  # (the command checked it too)
            was = await self._scale(stage, n)
            return {"ok": True, "stage": stage, "n": n, "was": was}
        except ControlError as e:
            return {"ok": False, "error": str(e)}
        except Exception as e:  # the run goes on; the caller reads why
            log.exception("control: a request failed")
            return {"ok": False, "error": f"the run could not do it: {e!r}"}

    def close(self) -> None:
        """Stop listening and remove the control file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            # (only ours: a later run of the same folder may have written its own)
            if json.loads(self.file.read_text())["address"] == getattr(self, "address", None):
                self.file.unlink()
        self._sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


async def serve(server: ControlServer) -> None:
    """The driver's ``control`` job: answer until cancelled, then close."""
    try:
        await server.run()
    finally:
        server.close()


def ask(
    out_dir: Path,
    request: dict[str, Any],
    timeout_s: float = 600.0,
    keys: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Send ``request`` to the run writing ``out_dir`` and return its reply; a
    ``ControlError`` when no run is listening there (no control file, or nothing answers
    within ``timeout_s``) or its channel needs keys this command lacks (``keys``: a key
    directory, else ``TRANSFERQUEUE_KEYS``)."""
    path = Path(out_dir) / CONTROL_FILE
    try:
        info = json.loads(path.read_text())
        address, curve = str(info["address"]), bool(info.get("curve", False))
    except FileNotFoundError:
        raise ControlError(
            f"no running job writes {out_dir} (no {CONTROL_FILE}): a deploy.mode=ray run "
            "listens there while it runs"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ControlError(f"{path} is not a control file: {e!r}") from None
    mine = None
    if curve:
        try:
            mine = client_keys(keys)
        except AuthError as e:
            raise ControlError(f"the run's control channel needs keys: {e}") from None
        if mine is None:
            raise ControlError(
                f"the run writing {out_dir} listens beyond loopback with CURVE keys: give the "
                "run's key directory (asyncflow scale --keys DIR, or TRANSFERQUEUE_KEYS=DIR)"
            )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if mine is not None:
        mine.apply(sock)
    try:
        sock.connect(address)
        sock.send(msgpack.packb(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise ControlError(
                f"the run writing {out_dir} did not answer at {address} within {timeout_s:g} s "
                "(it may have ended without removing its control file)"
            )
        reply: dict[str, Any] = msgpack.unpackb(sock.recv())
        return reply
    finally:
        sock.close(0)
        ctx.term()
