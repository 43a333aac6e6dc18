"""Workflow runs against a real OpenEnv server (OpenEnv's own server library serving the game
of ``tests/engines/openenv_game.py`` on loopback, started and stopped by each test), on the
tiny model: multi-step episodes, the session cap counted on the server's side, and a server
killed mid-run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from asyncflow import RunResult, run
from tests.asyncflow.conftest import small_config
from tests.engines.openenv_game import get, serve

STEPS = 10


def _config(out: Path, url: str, *extra: str) -> object:
    return small_config(
        out,
        "task=guess_number",
        "env.name=openenv",
        f"env.options={{url: '{url}', reset_fields: [answer], max_sessions: 2}}",
        "env.timeout_s=20",
        "rollout.max_turns=3",
        "rollout.max_new_tokens=3",
        "rollout.max_episode_tokens=48",
        f"train.steps={STEPS}",
        *extra,
    )


def _reasons(result: RunResult) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for r in result.records:
        for reason, count in r["episode_end_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    return reasons


def test_a_run_plays_multi_step_episodes_on_the_server_within_its_session_cap(
    out_dir: Path,
) -> None:
    """Ten steps of episodes played on the server, each several turns on one session; the
    client's cap of 2 sessions (the server would take 8) is never exceeded, counted by the
    server's own environments."""
    with serve(max_sessions=8) as (url, _):
        cfg = _config(out_dir, url)
        result = run(cfg)  # type: ignore[arg-type]
        counts = get(url + "/sessions")
    trained = STEPS * cfg.train.groups_per_step * cfg.rollout.group_size  # type: ignore[attr-defined]
    assert [rep.step for rep in result.reports] == list(range(STEPS))
    assert sum(rep.samples for rep in result.reports) == trained
    reasons = _reasons(result)
    assert set(reasons) <= {"done", "max_turns", "max_tokens"}, reasons
    assert sum(reasons.values()) == trained
    assert sum(r["turns_mean"] for r in result.records) > len(result.records)  # multi-turn
    assert counts["open"] == 0  # every session closed
    assert counts["peak"] == 2  # the cap, reached and never exceeded
    assert counts["episodes"] >= trained


def test_a_server_killed_mid_run_costs_episodes_not_the_run(out_dir: Path) -> None:
    """The server is killed once it has served 24 episodes: the run still takes its ten
    steps; the episodes after the kill end as errors (the server unreachable)."""
    with serve(max_sessions=8) as (url, proc):
        killed = threading.Event()

        def kill_after_some_episodes() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if get(url + "/sessions")["episodes"] >= 24:
                        break
                except OSError:
                    return
                time.sleep(0.05)
            proc.kill()
            killed.set()

        killer = threading.Thread(target=kill_after_some_episodes, daemon=True)
        killer.start()
        cfg = _config(out_dir, url, "env.options.timeout_s=1.0", "env.options.connect_retries=1")
        result = run(cfg)  # type: ignore[arg-type]
        killer.join(timeout=10)
    assert killed.is_set()
    assert [rep.step for rep in result.reports] == list(range(STEPS))
    reasons = _reasons(result)
    assert reasons.get("error", 0) > 0, reasons
    assert set(reasons) <= {"done", "max_turns", "max_tokens", "error"}, reasons
    assert sum(reasons.values()) - reasons["error"] > 0, reasons  # played before the kill
