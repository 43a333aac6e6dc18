"""A guessing game served by OpenEnv's own server library, on loopback, for the tests.

``python -m tests.engines.openenv_game --port P --max-sessions N`` serves it (create_fastapi_app
with uvicorn); :func:`serve` starts that process and waits for ``/health``. The server counts
its environments on its own side: ``GET /sessions`` answers ``{"open": ..., "peak": ...,
"episodes": ...}`` (an environment is counted from its construction to its ``close``, which the
server calls when a session ends).

The game: ``reset(answer=secret)``; each step's ``message`` is a guess; the answer is
``higher``/``lower``/``say a number`` until the guess is right (reward 1, done).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _app(max_sessions: int) -> Any:
    # The web UI is off (ENABLE_WEB_INTERFACE unset) and gradio is optional in OpenEnv's
    # server (it imports it in a try): keeping it out saves seconds of imports per server.
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

    lock = threading.Lock()
    counts = {"open": 0, "peak": 0, "episodes": 0}

    class GuessAction(Action):
        message: str

    class GuessObservation(Observation):
        text: str = ""

    class GuessGame(Environment):  # type: ignore[misc]
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            with lock:
                counts["open"] += 1
                counts["peak"] = max(counts["peak"], counts["open"])
            self._closed = False
            self._secret = 0
            self._state = State(step_count=0)

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, **kw: Any
        ) -> GuessObservation:
            self._secret = int(kw.get("answer", 7))
            self._state = State(episode_id=episode_id, step_count=0)
            with lock:
                counts["episodes"] += 1
            return GuessObservation(text="Your guess?")

        def step(self, action: GuessAction, timeout_s: float | None = None, **kw: Any) -> Any:
            self._state.step_count += 1
            numbers = re.findall(r"-?\d+", action.message)
            if not numbers:
                return GuessObservation(text="say a number", metadata={"no_number": 1})
            guess = int(numbers[-1])
            if guess == self._secret:
                return GuessObservation(text="right", reward=1.0, done=True)
            return GuessObservation(text="higher" if guess < self._secret else "lower")

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            if not self._closed:
                self._closed = True
                with lock:
                    counts["open"] -= 1

    app = create_fastapi_app(
        GuessGame, GuessAction, GuessObservation, max_concurrent_envs=max_sessions
    )

    @app.get("/sessions")
    def sessions() -> dict[str, int]:
        with lock:
            return dict(counts)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def serve(
    max_sessions: int = 8, timeout_s: float = 60.0, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """The game's server in a process of its own on loopback (``port``, or a free one):
    ``(url, process)``; stopped (killed if need be) on exit."""
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tempfile.TemporaryFile()  # noqa: SIM115  (closed in the finally below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.engines.openenv_game", "--port", str(port),
         "--max-sessions", str(max_sessions)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the OpenEnv server exited: {log.read()[-2000:]!r}")
            with contextlib.suppress(OSError):
                get(url + "/health")
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenEnv server did not answer in {timeout_s} s")
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-sessions", type=int, default=8)
    args = parser.parse_args()
    uvicorn.run(_app(args.max_sessions), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
