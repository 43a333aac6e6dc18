"""``asyncflow status OUTPUT_DIR``: a running (or finished) run, read from its output folder.

The stall watch (:mod:`asyncflow.stall`) rewrites ``progress.json`` in the run's output folder
every second, and once more when the run ends; the step records are in ``metrics.jsonl``.
This command reads both, never the run itself (no socket, no Ray: it works on a run of any
deployment, from any shell that sees the folder), and prints one table:

| line / column | from ``progress.json`` (``metrics.jsonl``)                                 |
|---------------|----------------------------------------------------------------------------|
| head          | ``state`` (running, finished, failed), ``steps`` of ``total_steps``, the   |
|               | seconds since the last step, the view's age                                |
| last step     | the last record: its step, reward, step time, samples, staleness           |
| stalls        | every stall named so far: stage, host, seconds, replaced or not            |
| ``HOST``      | each stage host (``driver``, ``rollout/instance0``, a Ray actor's name),   |
|               | marked ``STALLED`` while the watch holds it stalled                        |
| ``PROCESS``   | its pid (and node)                                                         |
| ``SILENT``    | seconds since it last answered its progress probe                          |
| ``STAGE``     | each stage or engine on that host, its units done and median unit time     |
| ``NOW``       | what it holds (units, rows, leases, phase and for how long), else what it  |
|               | waits for and for how long                                                 |

``--watch [SECONDS]`` prints the table again every SECONDS (2 by default) until interrupted,
and stops by itself, saying why, when the run's files say it ended (``state`` finished:
exit 0; failed: exit 1), when the run's driver process is gone from this machine without
saying so (exit 1), or when ``progress.json`` has not changed for ``--stale`` seconds (60 by
default: the driver is frozen, or on a machine whose clock or files this one does not see;
exit 1). A folder without ``progress.json`` is one line ``asyncflow: no run status: ...`` and
exit status 2 (the run predates the stall watch, has not started it yet, or the folder is not
a run's ``output.dir``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from asyncflow.stall import PROGRESS_FILE

__all__ = ["STALE_S", "WATCH_S", "StatusError", "last_records", "read_view", "render", "watch"]

WATCH_S = 2.0
"""Seconds between two tables of ``--watch`` without a value."""
STALE_S = 60.0
"""``--watch`` stops once ``progress.json`` has not changed for this long."""
_TAIL_BYTES = 1 << 16
"""How much of the end of ``metrics.jsonl`` is read for its last records."""


class StatusError(ValueError):
    """The folder holds no readable run status: the message is the one line to print."""


def read_view(out_dir: Path) -> dict[str, Any]:
    """The run's last ``progress.json``; a :class:`StatusError` saying why there is none."""
    path = Path(out_dir) / PROGRESS_FILE
    if not Path(out_dir).is_dir():
        raise StatusError(f"{out_dir} is not a folder: give a run's output.dir")
    try:
        view = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusError(
            f"no {PROGRESS_FILE} in {out_dir}: a run writes it there every second once its stall "
            "watch runs (a run started by this version of asyncflow, a second after its start); "
            "is it the run's output.dir?"
        ) from None
    except (OSError, ValueError) as e:
        raise StatusError(f"{path} cannot be read as a run's status: {e}") from None
    if not isinstance(view, dict) or not isinstance(view.get("hosts"), dict):
        raise StatusError(f"{path} is not a run's status (no 'hosts' map)")
    return view


def last_records(out_dir: Path, n: int = 1) -> list[dict[str, Any]]:
    """The last ``n`` step records of ``metrics.jsonl`` (fewer, or none, where there are not
    as many; a line being written is left out)."""
    path = Path(out_dir) / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    out: list[dict[str, Any]] = []
    for line in reversed(tail.splitlines()):
        if len(out) == n:
            break
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                out.append(record)
    return out[::-1]


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _driver_gone(view: dict[str, Any]) -> bool:
    """True when the view's driver ran on this machine and its process is gone."""
    pid = view.get("pid")
    if not isinstance(pid, int) or view.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # (someone else's process: it exists)
        return False
    return False


def _head(view: dict[str, Any], now: float) -> str:
    state = view.get("state", "running")
    steps, total = view.get("steps", 0), view.get("total_steps")
    of = f" of {total}" if total is not None else ""
    age = max(0.0, now - float(view.get("time", now)))
    line = f"{state}: {steps}{of} steps"
    if state == "running":
        since = view.get("since_step_s")
        if since is not None:
            line += f", last step {_seconds(float(since) + age)} ago"
        if _driver_gone(view):
            line += f"; its driver (pid {view['pid']}) is gone: the run ended without saying so"
    line += f" (status written {_seconds(age)} ago)"
    if view.get("error"):
        line += f"\n  error: {view['error']}"
    return line


def _record_line(record: dict[str, Any]) -> str:
    parts = [f"last step {record.get('step')}"]
    if isinstance(record.get("reward"), int | float):
        parts.append(f"reward {record['reward']:.3f}")
    if isinstance(record.get("step_s"), int | float):
        parts.append(f"step {_seconds(record['step_s'])}")
    if "samples" in record:
        parts.append(f"{record['samples']} samples")
    if "staleness_max" in record:
        parts.append(f"staleness max {record['staleness_max']}")
    instances = record.get("instances")
    if isinstance(instances, dict) and instances:
        parts.append("instances " + ", ".join(f"{k} {v}" for k, v in instances.items()))
    scaled = record.get("autoscale")
    if isinstance(scaled, dict):
        parts.append(f"autoscaled rollout {scaled.get('from')} -> {scaled.get('to')}")
    failures = record.get("env_failures")
    if failures:
        parts.append("env failures " + ", ".join(f"{k} x {v}" for k, v in failures.items()))
    return ", ".join(parts)


def _stall_lines(stalls: list[dict[str, Any]]) -> list[str]:
    if not stalls:
        return ["stalls so far: none"]
    out = [f"stalls so far: {len(stalls)}"]
    for s in stalls[-5:]:
        how = "replaced" if s.get("replaced") else "not replaced"
        silent = ", silent" if s.get("silent") else ""
        out.append(
            f"  {s.get('stage')!r} on host {s.get('host')!r}: no progress for "
            f"{_seconds(s.get('seconds'))}{silent}, {how}"
        )
    if len(stalls) > 5:
        out.insert(1, f"  ({len(stalls) - 5} earlier ones left out)")
    return out


def _process(host: dict[str, Any]) -> str:
    if "pid" not in host:
        return "never answered"
    text = f"pid {host['pid']}"
    if host.get("node"):
        text += f" node {str(host['node'])[:8]}"
    return text


def _now(work: dict[str, Any]) -> str:
    """What one stage (or engine) holds and is in, else what it waits for."""
    units = work.get("holding") or []
    if units:
        rows = sum(int(u.get("rows", 0)) for u in units)
        leases = [u["lease"] for u in units if u.get("lease") is not None]
        longest = max(units, key=lambda u: u.get("held_s", 0.0))
        text = (
            f"holds {len(units)} unit(s), {rows} rows"
            + (f", lease(s) {', '.join(map(str, leases))}" if leases else "")
            + f"; {longest.get('phase')} for {_seconds(longest.get('phase_s'))}"
            + f" (held {_seconds(longest.get('held_s'))})"
        )
        return text
    if work.get("idle"):
        return f"waits for {work.get('what')} for {_seconds(work.get('idle_s'))}"
    return "between units"


def render(
    view: dict[str, Any], records: list[dict[str, Any]], out_dir: Path, now: float | None = None
) -> str:
    """The table of one view (see the module doc)."""
    now = time.time() if now is None else now
    lines = [f"asyncflow status {out_dir}: {_head(view, now)}"]
    lines += [_record_line(r) for r in records] or ["no step recorded yet"]
    lines += _stall_lines(list(view.get("stalls") or []))
    rows: list[tuple[str, ...]] = [("HOST", "PROCESS", "SILENT", "STAGE", "DONE", "NOW")]
    for name, host in view["hosts"].items():
        label = name + ("  STALLED" if host.get("stalled") else "")
        works = host.get("works") or [{}]
        for i, w in enumerate(works):
            median = w.get("median_s")
            done = (
                ""
                if not w
                else f"{w.get('done', 0)}" + ("" if median is None else f" ({median:.2f} s)")
            )
            rows.append(
                (
                    label if i == 0 else "",
                    _process(host) if i == 0 else "",
                    _seconds(host.get("silent_s")) if i == 0 else "",
                    str(w.get("name", "-")),
                    done,
                    _now(w) if w else "nothing known",
                )
            )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    lines.append("")
    for r in rows:
        cells = [cell.ljust(widths[c]) for c, cell in enumerate(r[:-1])]
        lines.append("  ".join([*cells, r[-1]]).rstrip())
    return "\n".join(lines)


def status(out_dir: Path, *, out: TextIO | None = None) -> int:
    """``asyncflow status OUTPUT_DIR``: print the table once; 0 (a StatusError is raised)."""
    out = sys.stdout if out is None else out
    view = read_view(out_dir)
    print(render(view, last_records(out_dir), out_dir), file=out)
    return 0


def watch(
    out_dir: Path,
    every_s: float = WATCH_S,
    stale_s: float = STALE_S,
    *,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``--watch``: the table every ``every_s`` until the run ends (0: finished; 1: failed,
    its driver gone, or ``progress.json`` unchanged for ``stale_s``) or Ctrl-C (0)."""
    out = sys.stdout if out is None else out
    path = Path(out_dir) / PROGRESS_FILE
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    changed_at, mtime = time.monotonic(), None
    try:
        while True:
            view = read_view(out_dir)
            seen = path.stat().st_mtime_ns
            if seen != mtime:
                changed_at, mtime = time.monotonic(), seen
            table = render(view, last_records(out_dir), out_dir)
            print(f"{clear}{table}", file=out, flush=True)
            state = view.get("state", "running")
            if state != "running":
                print(f"asyncflow: the run {state}; stopped watching", file=out)
                return 0 if state == "finished" else 1
            if _driver_gone(view):
                print(
                    f"asyncflow: the run's driver (pid {view['pid']}) is gone without saying "
                    "the run ended (killed?); stopped watching",
                    file=out,
                )
                return 1
            unchanged = time.monotonic() - changed_at
            if unchanged > stale_s:
                print(
                    f"asyncflow: {PROGRESS_FILE} has not changed for {unchanged:.0f} s "
                    f"(--stale {stale_s:g}): its driver is frozen, or gone without saying so; "
                    "stopped watching",
                    file=out,
                )
                return 1
            if not clear:
                print(file=out)
            sleep(every_s)
    except KeyboardInterrupt:
        return 0
