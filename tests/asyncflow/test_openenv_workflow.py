"""Workflow runs against a real OpenEnv server (OpenEnv's own server library serving the game
of ``tests/engines/openenv_game.py`` on loopback, started and stopped by each test), on the
tiny model: multi-step episodes, the session cap counted on the server's side, and a server
killed mid-run."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import statistics
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


def _until_episodes(url: str, n: int, deadline_s: float = 120.0) -> None:
    """Wait (at most ``deadline_s``) until the server at ``url`` has served ``n`` episodes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if get(url + "/sessions")["episodes"] >= n:
                return
        time.sleep(0.05)


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
            _until_episodes(url, 24)
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


FREEZE_S = 8.0


@pytest.mark.slow
def test_a_server_frozen_mid_run_costs_timeouts_not_the_run(out_dir: Path) -> None:
    """The server process is frozen (SIGSTOP: it holds its sockets, the kernel still accepts
    connections, nothing answers) once it has served 24 episodes, for 8 s, then woken: every
    call on it (the WebSocket handshake, ``reset``, ``step``) ends at its timeout, counted as
    ``timeout``; the episodes are tried again as an ``env_error``'s are (those whose tries
    all met the freeze end ``env_error`` and their groups are dropped and refilled); the run
    takes its ten steps, every group trained or dropped once, no step 30 s over the median."""
    with serve(max_sessions=8) as (url, proc):
        frozen: dict[str, float] = {}

        def freeze_then_wake() -> None:
            _until_episodes(url, 24)
            os.kill(proc.pid, signal.SIGSTOP)
            frozen["at"] = time.monotonic()
            time.sleep(FREEZE_S)
            os.kill(proc.pid, signal.SIGCONT)
            frozen["woken"] = time.monotonic()

        freezer = threading.Thread(target=freeze_then_wake, daemon=True)
        freezer.start()
        cfg = _config(
            out_dir,
            url,
            "env.options.timeout_s=1.0",
            "env.options.connect_retries=1",
            "env.retries=2",
        )
        t0 = time.monotonic()
        try:
            result = run(cfg)  # type: ignore[arg-type]
        finally:
            freezer.join(timeout=60)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)  # (never left stopped for serve's exit)
        wall_s = time.monotonic() - t0
    assert "woken" in frozen and frozen["at"] - t0 < wall_s  # frozen while the run went on
    b, n = cfg.train.groups_per_step, cfg.rollout.group_size  # type: ignore[attr-defined]
    assert [rep.step for rep in result.reports] == list(range(STEPS))
    consumed: list[int] = []
    for rep in result.reports:
        assert rep.samples == b * n and len(rep.groups) == b  # whole groups, never partial
        consumed += rep.groups + rep.filtered
    assert sorted(consumed) == list(range(len(consumed)))  # each group once
    timeouts = sum(r["env_failures"].get("timeout", 0) for r in result.records)
    assert timeouts > 0, [r["env_failures"] for r in result.records]
    reasons = _reasons(result)
    assert set(reasons) <= {"done", "max_turns", "max_tokens", "env_error"}, reasons
    steps = [r["step_s"] for r in result.records]
    median = statistics.median(steps)
    assert max(steps) < median + 30.0, steps
    print(
        f"\nfrozen {FREEZE_S:g} s: {timeouts} timeouts, {reasons.get('env_error', 0)} env_error "
        f"episodes, {sum(r['groups_dropped'] for r in result.records)} groups dropped; "
        f"median step {median:.2f} s, worst {max(steps):.2f} s, run {wall_s:.1f} s"
    )


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
