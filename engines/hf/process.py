"""The HF generation engine in a process of its own: sampling that does not share the GIL.

In one process, generation and training run on two threads that take turns holding the GIL:
a small model's every operation is mostly Python dispatch, so overlapping the two stages
gains little on two cores (``docs/benchmarks.md``, "Where one step's time goes").
:class:`HFProcessGenerationEngine` keeps the :class:`engines.protocols.GenerationEngine`
interface in the caller's process and runs an :class:`engines.hf.HFGenerationEngine` in a
child process (``python -m engines.hf.process``), so the rollout's model work runs on another
core than the trainer's.

| message (caller -> child)                 | reply                                        |
|-------------------------------------------|----------------------------------------------|
| ``("generate", id, ids, lengths, params)``| ``("ok", id, (tokens, logprobs, lengths,     |
|                                           | finish, token_versions, versions))``          |
| ``("load", id, path, layout, version)``   | ``("ok", id, None)`` once loaded              |
| ``("rng", id, state)``                    | ``("ok", id, None)``: the seed stream goes on |
| ``("close",)``                            | the child exits                               |

A failed call replies ``("error", id, message)`` and the child goes on serving. Prompts and
results travel as whole numpy arrays (one flat array and the lengths), never a tensor per row;
weights as one shared-memory file (:func:`engines.weights_io.pack_state`) that the child maps
and copies into its model, so an update costs one copy on each side and no pickling.

Semantics are those of the engine in the caller's process with ``partial=False``: calls run
one at a time in arrival order, an update after the calls queued before it, with the same
seed the same samples. Interruptible generation (``partial=True``) stays in process.

Lifetime and failures: the child starts in the background (importing torch and loading the
model take seconds); until it answers ``("ready",)`` (bounded by ``start_timeout_s``), calls
run on an engine in the caller's process, so a run's first step never waits for the child.
The first call after that hands the child the current weights, version and seed stream, and
from then on every call and update goes to the child. A child that fails to start is logged
and the engine in the caller's process serves on; a child that dies later fails every pending
and later call with :class:`EngineProcessError` naming its exit code (the rollout worker's own
error handling then applies). :meth:`close` (also at exit) asks the child to stop and kills
it after 5 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.packed import (
    PackedGenerations,
    pack_generations,
    pack_prompts,
    unpack_generations,
    unpack_prompts,
)
from engines.protocols import Generation, SamplingParams
from engines.weights_io import pack_state, unpack_state

__all__ = ["EngineProcessError", "HFProcessGenerationEngine"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")


class EngineProcessError(RuntimeError):
    """The generation engine's process died, failed to start, or refused a call."""


def _send(sock: socket.socket, message: object) -> None:
    body = pickle.dumps(message, protocol=5)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("the other side closed the connection")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, size))


class HFProcessGenerationEngine:
    """An :class:`engines.hf.HFGenerationEngine` in a child process (module docstring).

    The child starts in the background: until it has answered (importing torch and loading
    the model take a few seconds), calls run on an engine in this process, so the first step
    does not wait for it. At the first call after it is ready, the child gets this process's
    current weights and version, and every later call and update goes to it (the engine in
    this process is then closed). A child that fails to start is logged and the engine in
    this process serves on.

    Args:
        model: a saved model folder (the child loads it; an in-memory model cannot cross).
        version: version of the initial weights (as the in-process engine).
        threads: ``torch`` threads of the child (default: the caller's).
        start_timeout_s: bound on the child's start (import, model load) before it answers.
        **engine_kwargs: the in-process engine's options (``device``, ``dtype``, ``seed``,
            ``max_batch_size``, ``pad_id``); ``partial`` must be false.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        version: int = -1,
        threads: int | None = None,
        start_timeout_s: float = 300.0,
        **engine_kwargs: Any,
    ) -> None:
        from engines.hf.generation import HFGenerationEngine

        if engine_kwargs.get("partial"):
            raise ValueError(
                "partial=True (interruptible generation) needs the engine in the caller's "
                "process: set rollout.engine_process=false with rollout.partial=true"
            )
        engine_kwargs.pop("partial", None)
        self._local: HFGenerationEngine | None = HFGenerationEngine(
            model, version=version, **engine_kwargs
        )
        child_kwargs = dict(engine_kwargs)
        dtype = child_kwargs.get("dtype")
        if isinstance(dtype, torch.dtype):
            child_kwargs["dtype"] = str(dtype).removeprefix("torch.")
        if "device" in child_kwargs:
            child_kwargs["device"] = str(child_kwargs["device"])
        self._spec = (str(model), version, threads, start_timeout_s, dict(engine_kwargs))
        self._version = version
        self.kept_tokens = 0  # never partial: no running sequence is interrupted
        self.tokens_decoded = 0
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._next_id = 0
        self._dead: EngineProcessError | None = None
        self._ready = threading.Event()
        self._switched = False
        self._route: asyncio.Lock | None = None
        ours, theirs = socket.socketpair()
        self._sock = ours
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engines.hf.process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=_child_env(),
            )
        finally:
            theirs.close()
        self._finalizer = weakref.finalize(self, _stop, self._proc, ours)
        spec = {
            "model": str(Path(model)),
            "version": version,
            "threads": threads if threads is not None else torch.get_num_threads(),
            "kwargs": child_kwargs,
        }
        self._reader = threading.Thread(
            target=self._start_and_read,
            args=(spec, start_timeout_s),
            name="hf-process-reader",
            daemon=True,
        )
        self._reader.start()

    @property
    def version(self) -> int:
        """Version of the weights in use."""
        return self._version

    @property
    def pid(self) -> int:
        """The child process's id."""
        return int(self._proc.pid)

    @property
    def initial_version(self) -> int:
        """The version of the weights it was built with (those of ``model``)."""
        return self._spec[1]

    def spawn_again(self) -> HFProcessGenerationEngine:
        """A new engine built as this one was (a new child; the weights of ``model``, at the
        initial version): what replaces this one when its child is stuck. The caller loads
        the current weights into it and closes this one (whose calls in flight then fail with
        :class:`EngineProcessError`). Blocks while the model loads in this process."""
        model, version, threads, start_timeout_s, kwargs = self._spec
        return HFProcessGenerationEngine(
            model, version=version, threads=threads, start_timeout_s=start_timeout_s, **kwargs
        )

    @property
    def in_child(self) -> bool:
        """Whether calls now run in the child process."""
        return self._switched

    def wait_ready(self, timeout: float) -> bool:
        """Block until the child answered (True) or failed / ``timeout`` passed (False)."""
        self._ready.wait(timeout)
        return self._ready.is_set() and self._dead is None

    def _start_and_read(self, spec: dict[str, Any], start_timeout_s: float) -> None:
        """Reader thread: the start handshake, then every reply to its future; on the child's
        death (or a failed start) every pending and later call fails."""
        sock = self._sock
        try:
            sock.settimeout(start_timeout_s)
            _send(sock, spec)
            reply = _recv(sock)
            if reply[0] != "ready":
                raise EngineProcessError(f"the engine failed to build: {reply[1]}")
            sock.settimeout(None)
            self._ready.set()
            while True:
                kind, call_id, payload = _recv(sock)
                with self._pending_lock:
                    fut = self._pending.pop(call_id, None)
                if fut is None or not fut.set_running_or_notify_cancel():
                    continue  # the caller gave up on it (cancelled): the reply is dropped
                if kind == "ok":
                    fut.set_result(payload)
                else:
                    fut.set_exception(EngineProcessError(payload))
        except (OSError, EOFError, pickle.UnpicklingError, EngineProcessError) as e:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            started = self._ready.is_set()
            self._dead = EngineProcessError(
                f"the generation engine's process {'is gone' if started else 'did not start'} "
                f"(exit code {code}; {e})"
            )
            if not started:
                log.warning("%s: generation goes on in this process", self._dead)
            self._ready.set()
            with self._pending_lock:
                pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(self._dead)

    def _call(self, *message: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._dead is not None:
            fut.set_exception(self._dead)
            return fut
        with self._pending_lock:
            call_id = self._next_id
            self._next_id += 1
            self._pending[call_id] = fut
        try:
            with self._send_lock:
                _send(self._sock, (message[0], call_id, *message[1:]))
        except OSError as e:
            with self._pending_lock:
                self._pending.pop(call_id, None)
            fut.set_exception(
                self._dead or EngineProcessError(f"the generation engine's process is gone: {e!r}")
            )
        return fut

    async def _load_in_child(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        packed = await asyncio.to_thread(pack_state, dict(state))
        try:
            await asyncio.wrap_future(self._call("load", packed.path, packed.layout, version))
        finally:
            packed.unlink()

    async def _use_child(self) -> bool:
        """Whether this call goes to the child; hands it this process's weights the first
        time (under the routing lock, so no update slips between)."""
        if self._switched:
            return True
        if not self._ready.is_set() or self._dead is not None:
            return False
        if self._route is None:
            self._route = asyncio.Lock()
        async with self._route:
            if not self._switched:
                local = self._local
                assert local is not None
                state, rng = await asyncio.to_thread(_state_of, local)
                await self._load_in_child(state, self._version)
                await asyncio.wrap_future(self._call("rng", rng))
                self._switched = True
                self._local = None
                local.close()
        return True

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        """Sample one response per prompt: in the child once it is ready, else here."""
        if not await self._use_child():
            assert self._local is not None
            gens = await self._local.generate(prompts, params)
            self.tokens_decoded += sum(len(g.token_ids) for g in gens)
            return gens
        flat, lengths = pack_prompts(prompts)
        reply = await asyncio.wrap_future(self._call("generate", flat, lengths, params))
        out = unpack_generations(reply)
        self.tokens_decoded += int(reply[2].sum())
        return out

    async def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state`` after the calls queued before, then adopt ``version``."""
        if self._route is None:
            self._route = asyncio.Lock()
        async with self._route:
            if self._switched:
                await self._load_in_child(state, version)
            else:
                assert self._local is not None
                await self._local.update_weights(state, version)
            self._version = version

    def kill(self) -> None:
        """Kill the child at once (a stuck one would not act on the ``close`` request: it
        would get 5 s for it) and close; its calls in flight fail with
        :class:`EngineProcessError`."""
        with contextlib.suppress(OSError):
            self._proc.kill()
        self.close()

    def close(self) -> None:
        """Stop the child and the engine in this process (idempotent)."""
        self._finalizer()
        if self._local is not None:
            self._local.close()


def _state_of(engine: Any) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """A copy of the in-process engine's weights and its seed generator's state, taken under
    its lock (no load or call in between): the child goes on with the same stream of seeds."""
    with engine._lock:
        state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
        return state, engine._rng.get_state().numpy()


def _child_env() -> dict[str, str]:
    """The child's environment: the caller's, with the caller's import path first (a
    checkout run from its root imports this package as the caller does)."""
    env = dict(os.environ)
    path = [p for p in sys.path if p]
    env["PYTHONPATH"] = os.pathsep.join(
        dict.fromkeys([*path, *env.get("PYTHONPATH", "").split(os.pathsep)]).keys()
    ).strip(os.pathsep)
    return env


def _stop(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        _send(sock, ("close", -1))
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    sock.close()


# -- the child ------------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    from engines.hf.generation import HFGenerationEngine

    spec = _recv(sock)
    torch.set_num_threads(int(spec["threads"]))
    kwargs = dict(spec["kwargs"])
    if isinstance(kwargs.get("dtype"), str):
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    try:
        engine = HFGenerationEngine(spec["model"], version=spec["version"], **kwargs)
    except Exception as e:
        _send(sock, ("failed", f"{type(e).__name__}: {e}"))
        return
    _send(sock, ("ready",))
    while True:
        try:
            message = _recv(sock)
        except EOFError:
            return
        kind, call_id = message[0], message[1]
        if kind == "close":
            return
        try:
            if kind == "generate":
                payload: Any = _generate(engine, *message[2:])
            elif kind == "rng":
                engine._rng.set_state(torch.from_numpy(message[2]))
                payload = None
            elif kind == "load":
                path, layout, version = message[2:]
                engine.load_weights(dict(unpack_state(path, layout)), version)
                payload = None
            else:
                raise ValueError(f"unknown message {kind!r}")
        except Exception as e:
            _send(sock, ("error", call_id, f"{type(e).__name__}: {e}"))
            continue
        _send(sock, ("ok", call_id, payload))


def _generate(
    engine: Any, flat: np.ndarray, lengths: np.ndarray, params: SamplingParams
) -> PackedGenerations:
    return pack_generations(engine.generate_sync(unpack_prompts(flat, lengths), params))


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
