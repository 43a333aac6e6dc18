"""Workflow runs against a real OpenEnv server (OpenEnv's own server library serving the game
of ``tests/engines/openenv_game.py`` on loopback, started and stopped by each test), on the
tiny model: multi-step episodes, the session cap counted on the server's side, and a server
killed mid-run."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import pytest

from asyncflow import RunResult, run
from tests.asyncflow.conftest import small_config
from tests.engines.openenv_game import free_port, get, serve

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
    """The server is killed once it has served 24 episodes and comes back on its port a few
    seconds later (as a container restarted by its orchestrator): the episodes that met the
    dead server end ``env_error`` once their retry is spent (the server unreachable is the
    environment's failure, not the policy's) and their groups are dropped whole and refilled
    from new prompts; every step still trains whole groups, each group once, and the run
    takes its ten steps."""
    with contextlib.ExitStack() as stack:
        url, proc = stack.enter_context(serve(max_sessions=8))
        port = int(url.rsplit(":", 1)[1])
        killed, back = threading.Event(), threading.Event()

        def kill_then_restart() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    if get(url + "/sessions")["episodes"] >= 24:
                        break
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            killed.set()
            time.sleep(3.0)  # down long enough for episodes to spend their retry
            stack.enter_context(serve(max_sessions=8, port=port))
            back.set()

        killer = threading.Thread(target=kill_then_restart, daemon=True)
        killer.start()
        cfg = _config(
            out_dir,
            url,
            "env.options.timeout_s=1.0",
            "env.options.connect_retries=1",
            "env.retries=1",
        )
        result = run(cfg)  # type: ignore[arg-type]
        killer.join(timeout=60)
    assert killed.is_set() and back.is_set()
    b, n = cfg.train.groups_per_step, cfg.rollout.group_size  # type: ignore[attr-defined]
    assert [rep.step for rep in result.reports] == list(range(STEPS))
    consumed: list[int] = []
    for rep in result.reports:
        assert rep.samples == b * n and len(rep.groups) == b  # whole groups, never partial
        assert set(rep.dropped) <= set(rep.filtered) and not set(rep.groups) & set(rep.filtered)
        consumed += rep.groups + rep.filtered
    assert sorted(consumed) == list(range(len(consumed)))  # each group once: no sample twice
    reasons = _reasons(result)
    dropped = sum(r["groups_dropped"] for r in result.records)
    assert reasons.get("env_error", 0) > 0 and dropped > 0, (reasons, dropped)
    assert reasons["env_error"] <= dropped * n  # every env_error episode in a dropped group
    assert set(reasons) <= {"done", "max_turns", "max_tokens", "env_error"}, reasons
    assert sum(reasons.values()) == len(consumed) * n


def test_a_server_that_is_not_there_is_named_with_its_cause(
    out_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens at the URL: the first failed try is logged at WARNING with its cause
    and the URL as soon as it happens (the CLI shows WARNING and above), later ones are
    rate-limited, and the run's final error names the cause with its count and message."""
    url = f"http://127.0.0.1:{free_port()}"
    cfg = small_config(
        out_dir,
        "task=guess_number",
        "env.name=openenv",
        f"env.options={{url: '{url}', connect_retries: 0, timeout_s: 1.0}}",
        "env.retries=1",
        "train.steps=2",
    )
    t0 = time.time()  # the clock of the log records' ``created``
    with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError) as failed:
        run(cfg)
    port = url.rsplit(":", 1)[1]
    first = [
        r
        for r in caplog.records
        if r.levelno == logging.WARNING and "(connection_refused)" in r.getMessage()
    ]
    assert first, [r.getMessage() for r in caplog.records]
    assert f"127.0.0.1:{port}" in first[0].getMessage()
    assert "ConnectionRefusedError" in first[0].getMessage()
    assert first[0].created - t0 < 30  # within the first step's time, not at the end
    assert len(first) <= 2  # rate-limited: one per rollout stage, not one per try
    message = str(failed.value)
    assert "dropped" in message and "failed tries by cause: connection_refused x " in message
    assert f"127.0.0.1:{port}" in message and "is the server running?" in message, message
