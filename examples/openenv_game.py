"""GRPO against an OpenEnv server: the tiny model learns a guessing game served over OpenEnv's
WebSocket session protocol.

    pip install 'asyncflow[openenv-server]'     # OpenEnv's server library (the client needs
    python examples/openenv_game.py --output-dir runs/openenv_game    # only asyncflow[openenv])

The example defines a game with OpenEnv's own server library (an ``Environment`` subclass,
``create_fastapi_app``) and serves it with uvicorn on a loopback port in this process; the run
then plays every episode on that server (``env.name=openenv``, ``engines/envs/openenv.py``),
one WebSocket session per episode, at most ``max_sessions`` open at once. The game is
``guess_number``'s, played server-side: the row's secret goes to the server in ``reset``
(``reset_fields: [answer]``), each model turn is a guess (the action's ``message``), the server
answers ``higher``/``lower``; a right guess on turn t earns max(0.1, 1 - 0.1 (t - 1)). The tiny
model is warm-started on binary-search episodes, then trained with asynchronous GRPO.

What it measures: the mean reward of the first 10% of steps against the last 10%, turns per
episode, and, counted by the server itself, the episodes it served and the most sessions it
ever had open (never above ``max_sessions``). Writes what the other examples write
(``metrics.jsonl``, ``reward.png``, ``timeline.json``, the trained ``policy/``) plus, in every
step's record, ``turns_mean`` and ``episode_end_reasons``. To train against a server of your own
(e.g. in a container), skip this file: ``docs/environments-external.md``.

Measured on the 2-core reference machine (shared with other jobs), defaults: 120 steps in
209 s (220 s for the command: OpenEnv's server imports and the warm start), 7,680 episodes
played on the server, at most 8 sessions at once (max_sessions=8); mean reward 0.212 over the
first 10% of steps -> 0.283 over the last 10%, turns per episode 3.57 -> 3.39 (right guesses
come sooner). The same recipe with the game in-process (``env.name=guess_number``, its
built-in twin, through ``grpo_tool_use.py`` with this file's settings): 120 steps in 193 s,
0.221 -> 0.305. An earlier recipe (60 warm-start steps, 40 steps) stayed flat on both
(0.570 -> 0.462 served, 0.555 -> 0.485 in-process).
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import threading
import time
from typing import Any

from asyncflow import load_config, run

DEFAULTS = [
    "task.name=guess_number",
    "env.name=openenv",
    "model.warm_start_steps=30",
    "rollout.max_new_tokens=4",
    "rollout.max_turns=4",
    "rollout.max_episode_tokens=64",
    "env.timeout_s=30",
    "train.steps=120",
    "train.max_staleness=1",
]
"""The recipe (over the config's defaults; the command line's overrides win)."""


class Counts:
    """Sessions of the server, counted on its side (constructed .. closed environments)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = self.peak = self.episodes = 0

    def opened(self) -> None:
        with self.lock:
            self.open += 1
            self.peak = max(self.peak, self.open)

    def closed(self) -> None:
        with self.lock:
            self.open -= 1


def game_app(counts: Counts, max_sessions: int) -> Any:
    """The guessing game as an OpenEnv server app (OpenEnv's server library)."""
    # The web UI is off (ENABLE_WEB_INTERFACE unset), and OpenEnv's server imports gradio only
    # if it can: keeping it out saves seconds of start-up.
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

    class Guess(Action):
        message: str

    class Answer(Observation):
        text: str = ""

    class GuessGame(Environment):  # type: ignore[misc]
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            counts.opened()
            self._open = True
            self._secret = 0
            self._state = State(step_count=0)

        def reset(self, seed: Any = None, episode_id: Any = None, **kw: Any) -> Answer:
            self._secret = int(kw["answer"])
            self._state = State(episode_id=episode_id, step_count=0)
            with counts.lock:
                counts.episodes += 1
            return Answer()  # nothing to add to the prompt

        def step(self, action: Guess, timeout_s: Any = None, **kw: Any) -> Answer:
            self._state.step_count += 1
            numbers = re.findall(r"-?\d+", action.message)
            if not numbers:
                return Answer(text="say a number")
            guess = int(numbers[-1])
            if guess == self._secret:
                reward = max(0.1, 1.0 - 0.1 * (self._state.step_count - 1))
                return Answer(text="right", reward=reward, done=True)
            return Answer(text="higher" if guess < self._secret else "lower")

        @property
        def state(self) -> State:
            return self._state

        def close(self) -> None:
            if self._open:
                self._open = False
                counts.closed()

    return create_fastapi_app(GuessGame, Guess, Answer, max_concurrent_envs=max_sessions)


class Server:
    """uvicorn serving ``app`` on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="openenv", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the OpenEnv server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--output-dir", default="runs/openenv_game", help="where metrics go")
    ap.add_argument("--config", default=None, help="a YAML config (defaults otherwise)")
    ap.add_argument("--max-sessions", type=int, default=8, help="sessions open at once")
    ap.add_argument("overrides", nargs="*", help="section.field=value ...")
    args = ap.parse_args()
    counts = Counts()
    with Server(game_app(counts, max_sessions=16)) as url:
        options = (
            f"env.options={{url: '{url}', reset_fields: [answer], "
            f"max_sessions: {args.max_sessions}}}"
        )
        cfg = load_config(
            args.config, [*DEFAULTS, options, *args.overrides, f"output.dir={args.output_dir}"]
        )
        result = run(cfg)
    first, last = result.reward_first_last(0.1)
    records = result.records
    k = max(1, len(records) // 10)
    turns = [r["turns_mean"] for r in records]
    print(
        f"{len(records)} steps in {result.wall_s:.0f} s: mean reward {first:.3f} (first 10% of "
        f"steps) -> {last:.3f} (last 10%); turns {sum(turns[:k]) / k:.2f} -> "
        f"{sum(turns[-k:]) / k:.2f}; the server served {counts.episodes} episodes, at most "
        f"{counts.peak} sessions at once (max_sessions={args.max_sessions}); end reasons of the "
        f"last step {records[-1]['episode_end_reasons']}; metrics in "
        f"{result.output_dir / 'metrics.jsonl'}"
    )


if __name__ == "__main__":
    main()
