"""The stall watch: a stage alive but making no progress is named within seconds, and replaced.

A background job of the driver's supervisor. Every :data:`PERIOD_S` it asks the deployment
for each stage host's last answer to its progress probe (:mod:`asyncflow.progress`: what
each stage or engine holds, the phase it is in, and since when) and how long the host has been
silent, and judges:

| the host                                 | is stalled when                                |
|------------------------------------------|------------------------------------------------|
| answers                                  | a unit of work (a batch, an engine call) has   |
|                                          | been in its hands longer than its stage's bound|
| does not answer (frozen: SIGSTOP, a      | it has been silent longer than the smallest    |
| swapping host, every thread blocked)     | bound of its stages                            |

The bound is ``deploy.stall_timeout_s`` when set; else (``null``) it is per stage:

| criterion | automatic bound                                    | before the stage's first unit |
|-----------|----------------------------------------------------|-------------------------------|
| silent    | :data:`AUTO_FACTOR` x its median unit of work,     | :data:`AUTO_MAX_S`            |
|           | within [:data:`AUTO_MIN_S`, :data:`AUTO_MAX_S`]    |                               |
| holding   | :data:`AUTO_FACTOR` x its median unit of work,     | :data:`FIRST_UNIT_S` (a first |
|           | within [:data:`AUTO_MIN_S`, :data:`HELD_MAX_S`]    | call may compile, warm up)    |

A live host answers its probe within milliseconds however long its calls are, so silence gets
the short bound; a unit in hand gets one that scales with the stage's own calls (a stage whose
batches of long generations take minutes is not taken for stuck after 60 s).

A stalled host gets ONE WARNING (until it makes progress again, or is replaced): the stage,
the host (its Ray actor, pid, node), what it holds (rows, leases) and in which phase, for how
long, and the Python stacks of its threads and of its units in hand, collected in the process
over the probe's own channel (a host that does not answer is said not to). Then the deployment
replaces it where it can (``deploy=ray``: the actor is killed and Ray restarts it through the
restart path, its replacement handing its leases back at once; ``local``: an engine in a
process of its own is replaced, its calls in flight retried as a lost instance's). A stall
that is not replaced (a trainer rank that cannot recover, stages and engines in the driver's
process, a failed replacement) fails the run with a :class:`StallError` naming it once it lasts
:func:`give_up_s` (:data:`GIVE_UP_FACTOR` x its bound, at least :data:`GIVE_UP_MIN_S`): no run
waits without bound.

This is also the bound of an engine call that never returns: the engine's host holds that
call as a unit of work, so the same bound names it and replaces the engine (its batch
generated again, as a lost instance's), or fails the run where it cannot be replaced; there
is no second, per-call timeout to configure. A run with no train step for
:data:`NO_STEP_FACTOR` times its median step (at least :data:`AUTO_MIN_S`) logs what every
stage waits for, once per such gap. Every round the
same view (what each host holds and waits for, how long it has been silent, the stalls so far)
is written to the run's ``progress.json``, and once more when the run ends (finished or failed),
for a look at a run from outside (``asyncflow status OUTPUT_DIR``, :mod:`asyncflow.status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from transferqueue.aio import within

__all__ = [
    "AUTO_FACTOR",
    "AUTO_MAX_S",
    "AUTO_MIN_S",
    "FIRST_UNIT_S",
    "GIVE_UP_FACTOR",
    "GIVE_UP_MIN_S",
    "HELD_MAX_S",
    "NO_STEP_FACTOR",
    "PERIOD_S",
    "PROGRESS_FILE",
    "Probe",
    "StallError",
    "StallWatch",
    "Watched",
    "give_up_s",
    "stall_bound",
]

log = logging.getLogger(__name__)

AUTO_FACTOR = 10.0
"""The automatic bound: this many times a stage's median unit of work..."""
AUTO_MIN_S = 10.0
"""...but at least this (a probe's round trip on a loaded machine stays far below it)..."""
AUTO_MAX_S = 60.0
"""...and at most this for a silent host (also its bound before its first unit is done)..."""
HELD_MAX_S = 600.0
"""...and at most this for a unit of work in hand..."""
FIRST_UNIT_S = 300.0
"""...which before the stage's first unit is done gets this."""
NO_STEP_FACTOR = 5.0
"""A run with no train step for this many times its median step says what every stage waits
for."""
PERIOD_S = 1.0
PROGRESS_FILE = "progress.json"
"""The live view in a run's output folder (see :meth:`StallWatch.finish` and
:mod:`asyncflow.status`)."""
"""How often the watch judges the hosts' last answers."""
QUIET_ROUNDS = 3
"""A host silent this many rounds has its verdict before any unit in hand elsewhere."""
STACKS_WAIT_S = 5.0
"""How long the watch waits for a stalled host's stacks."""


def stall_bound(configured: float | None, median_s: float | None, *, held: bool = False) -> float:
    """The seconds a stage's host may stay silent, or (``held``) a stage may hold a unit of
    work: ``configured`` (``deploy.stall_timeout_s``) when set, else the automatic rule
    (module doc)."""
    if configured is not None:
        return configured
    if median_s is None:
        return FIRST_UNIT_S if held else AUTO_MAX_S
    return min(HELD_MAX_S if held else AUTO_MAX_S, max(AUTO_MIN_S, AUTO_FACTOR * median_s))


@dataclass
class Probe:
    """A stage host as the watch sees it."""

    answer: dict[str, Any] | None
    """Its last answer (:func:`asyncflow.progress.host_answer`; None: none yet)."""
    silent_s: float
    """Seconds since that answer (or since the host was first probed)."""
    replaceable: bool
    """Whether the deployment can replace it (:meth:`Watched.replace`)."""


class Watched(Protocol):
    """The deployment's side of the watch (``asyncflow.deploy.base.Deployment``)."""

    async def progress(self) -> dict[str, Probe]:
        """Every stage host by name, as last heard (never waits for a silent host)."""
        ...

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        """``host``'s answer with its stacks; None when it does not answer in ``timeout_s``."""
        ...

    async def replace(self, host: str) -> bool:
        """Replace a stalled ``host`` (its leases handed back); False where it cannot be."""
        ...


class StallWatch:
    """Judges the hosts' progress (see the module doc)."""

    def __init__(
        self,
        deployment: Watched,
        configured_s: float | None,
        steps_done: Callable[[], int],
        *,
        period_s: float = PERIOD_S,
        live: Path | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.deployment = deployment
        self.live = live
        """A JSON file rewritten every round with what every host holds and waits for (the
        run's ``progress.json``: ``asyncflow status OUTPUT_DIR`` reads it, see
        :mod:`asyncflow.status`)."""
        self.total_steps = total_steps
        self._probes: dict[str, Probe] = {}
        self.configured_s = configured_s
        self.steps_done = steps_done
        self.period_s = period_s
        self.stalls: list[dict[str, Any]] = []
        """Every stall named: host, stage, seconds, when (monotonic), replaced."""
        self._flagged: set[str] = set()
        self._away: dict[str, bool] = {}  # replaced, not heard from since: seen gone
        self._pace: float | None = None  # the smallest silent bound of a stage, this round
        self._unreplaced: set[str] = set()  # told, not replaced: failing the run past give_up_s
        self._steps = 0
        self._step_at = time.monotonic()
        self._step_times: list[float] = []
        self._gap_told = False
        self._told_at = -float("inf")

    async def run(self) -> None:
        """Judge every ``period_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.check()
            except StallError:
                raise  # (nothing can recover that stall: the run fails with its diagnosis)
            except Exception as e:  # the watch never ends a run; it says why it is blind
                log.warning("the stall watch could not judge the stage hosts this time: %r", e)

    async def check(self) -> None:
        """One round: name and replace new stalls, tell a run without steps what stages wait
        for; raise :class:`StallError` for a stall that was not replaced and outlasted
        :func:`give_up_s`."""
        probes = await self.deployment.progress()
        stalled = []
        hopeless = None
        self._pace = min(
            (
                self._bound(w)
                for p in probes.values()
                if p.answer is not None
                for w in p.answer["works"]
                if w.get("median_s") is not None
            ),
            default=None,
        )
        for host, probe in probes.items():
            why = self._stalled(host, probe)
            if why is None:
                if probe.silent_s < self.period_s * 3:
                    self._flagged.discard(host)  # (progress again: a new stall is told again)
                    self._unreplaced.discard(host)
            elif host not in self._flagged:
                stalled.append((host, probe, why))
            elif host in self._unreplaced and why[1] > give_up_s(why[2]):
                hopeless = (host, probe, why)
        self._probes = probes
        if self.live is not None:
            self._write_live(probes, "running")
        if hopeless is not None:
            raise StallError(_give_up(*hopeless))
        # The cause first: a silent host, then an engine (its calls hold no lease), then the
        # stages that wait on them; after a stall is told (and its host replaced), the others
        # get their bound to move again before they are judged themselves, counted from the
        # replacement's first answer: until then a unit in hand may wait on it (a stage's
        # call to the engine being restarted), and only silence is judged.
        for host, gone in list(self._away.items()):
            if host not in probes or probes[host].answer is None:
                self._away[host] = True
            else:  # (answering: back, or never gone)
                del self._away[host]
                if gone:
                    self._told_at = time.monotonic()
        # A host silent for a few rounds and not told yet is the likely cause of the others'
        # waits (a frozen trainer rank holds its peers in the step's collective): its own
        # verdict comes first.
        quiet = any(
            p.silent_s > QUIET_ROUNDS * self.period_s and h not in self._flagged
            for h, p in probes.items()
        )
        stalled.sort(key=lambda s: (s[1].silent_s <= s[2][2], _holds_leases(s[1])))
        for host, probe, why in stalled:
            if time.monotonic() - self._told_at < why[2]:
                break
            if (self._away or quiet) and probe.silent_s <= why[2]:
                continue
            self._flagged.add(host)
            if await self._tell(host, probe, *why):
                self._away[host] = False
            else:
                self._unreplaced.add(host)
            self._told_at = time.monotonic()
        self._check_steps(probes)

    async def finish(self, state: str, error: str | None = None) -> None:
        """The run ended (``state``: ``finished`` or ``failed``, with its ``error``): the last
        ``progress.json`` says so, for a reader to stop watching (the hosts as last heard, or
        asked once more when they answer within a second)."""
        if self.live is None:
            return
        probes = self._probes
        with contextlib.suppress(Exception):  # (a broken deployment: the last view's hosts)
            probes = await within(self.deployment.progress(), 1.0)
        try:
            self._write_live(probes, state, error)
        except OSError as e:  # the run's outcome stands; the view is only a view
            log.warning("could not write %s: %r", self.live, e)

    def _write_live(self, probes: dict[str, Probe], state: str, error: str | None = None) -> None:
        assert self.live is not None
        view = {
            "state": state,
            "error": error,
            "time": time.time(),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "period_s": self.period_s,
            "total_steps": self.total_steps,
            "steps": self.steps_done(),
            "since_step_s": time.monotonic() - self._step_at,
            "hosts": {
                host: {
                    "silent_s": round(p.silent_s, 2),
                    "stalled": host in self._flagged,
                    **(
                        {}
                        if p.answer is None
                        else {k: v for k, v in p.answer.items() if k != "stacks"}
                    ),
                }
                for host, p in probes.items()
            },
            "stalls": self.stalls,
        }
        tmp = self.live.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(view, indent=1, default=str))
        os.replace(tmp, self.live)  # (a reader never sees half a file)

    def _bound(self, work: dict[str, Any], *, held: bool = False) -> float:
        return stall_bound(self.configured_s, work.get("median_s"), held=held)

    def _stalled(self, host: str, probe: Probe) -> tuple[str, float, float] | None:
        """(stage, seconds, bound) of the stall of a host, or None (a host never heard from
        is named by its stage: a host's name begins with it, ``reward/1``)."""
        works = [] if probe.answer is None else probe.answer["works"]
        # (a host that answered but runs no stage of its own, a trainer rank past 0: the
        # run's pace, the smallest silent bound of the stages that have one)
        alone = self._pace if probe.answer is not None else None
        bounds = [self._bound(w) for w in works] or [alone or stall_bound(self.configured_s, None)]
        if probe.silent_s > min(bounds):
            stage = ", ".join(w["name"] for w in works) or host.split("/", 1)[0]
            return stage, probe.silent_s, min(bounds)
        for w in works:
            for u in w["holding"]:  # (a unit in a bounded wait of its own: by that bound)
                quiet = u.get("quiet_s", u["held_s"])
                bound = u.get("bound_s") or self._bound(w, held=True)
                if quiet > bound:
                    return w["name"], quiet, bound
        return None

    async def _tell(
        self, host: str, probe: Probe, stage: str, seconds: float, bound: float
    ) -> bool:
        """Name the stall in one WARNING and replace the host where the deployment can;
        True when it was replaced."""
        answer = probe.answer
        silent = probe.silent_s > bound
        fresh = None if silent else await self.deployment.stacks(host, STACKS_WAIT_S)
        where = _process(answer)
        lines = [
            f"stage {stage!r} made no progress for {seconds:.1f} s (bound {bound:.1f} s, "
            f"{self._rule()}): host {host!r} ({where})"
        ]
        if silent:
            lines.append(
                f"the host did not answer its progress probe for {probe.silent_s:.1f} s: its "
                "process is frozen (SIGSTOP, swapping) or blocks every thread, so its stacks "
                "could not be collected in-process; last heard:"
            )
        shown = fresh if fresh is not None else answer
        lines += _holding(shown)
        if fresh is not None:
            for w in fresh["works"]:
                for u in w["holding"]:
                    if u.get("stack"):
                        lines.append(
                            f"{w['name']} unit of {u['rows']} rows, its stack:\n{u['stack']}"
                        )
            if fresh.get("stacks"):
                lines.append(f"threads of pid {fresh['pid']}:\n{fresh['stacks']}")
        elif not silent:
            lines.append(f"its stacks: no answer within {STACKS_WAIT_S:.0f} s")
        replaced = probe.replaceable
        lines.append(
            "it is killed and replaced through the restart path (its leases handed back at once)"
            if replaced
            else "it is not replaced here (a trainer rank that cannot recover, or a stage or "
            f"engine in the driver's process): the run fails if it makes no progress for "
            f"{give_up_s(bound):.0f} s"
        )
        log.warning("stall: %s", "\n  ".join(lines))
        if replaced:
            replaced = await self.deployment.replace(host)
        self.stalls.append(
            {
                "host": host,
                "stage": stage,
                "seconds": seconds,
                "at": time.monotonic(),
                "replaced": replaced,
                "silent": silent,
            }
        )
        return replaced

    def _rule(self) -> str:
        if self.configured_s is not None:
            return "deploy.stall_timeout_s"
        return (
            f"deploy.stall_timeout_s=null: {AUTO_FACTOR:g} x the stage's median unit of work "
            f"within {AUTO_MIN_S:g}..{AUTO_MAX_S:g} s for a silent host, "
            f"{AUTO_MIN_S:g}..{HELD_MAX_S:g} s for a unit in hand"
        )

    def _check_steps(self, probes: dict[str, Probe]) -> None:
        now = time.monotonic()
        steps = self.steps_done()
        if steps != self._steps:
            if steps > self._steps:
                self._step_times.append((now - self._step_at) / (steps - self._steps))
            self._steps, self._step_at, self._gap_told = steps, now, False
            return
        if len(self._step_times) < 3 or self._gap_told:
            return
        median = statistics.median(self._step_times[-WINDOW_STEPS:])
        gap = max(NO_STEP_FACTOR * median, AUTO_MIN_S)
        if now - self._step_at <= gap:
            return
        self._gap_told = True
        lines = [
            f"no train step for {now - self._step_at:.1f} s (bound: {NO_STEP_FACTOR:g} x the "
            f"median step of {median:.2f} s, at least {AUTO_MIN_S:g} s); what every stage "
            "waits for:"
        ]
        for host, p in probes.items():
            head = f"{host} ({_process(p.answer)})"
            if p.silent_s > 3 * self.period_s:
                head += f", silent for {p.silent_s:.1f} s"
            lines.append(head + ":")
            lines += ["  " + line for line in _holding(p.answer)]
        log.warning("%s", "\n  ".join(lines))


class StallError(RuntimeError):
    """A stall that nothing here can work around (its host cannot be replaced, or its
    replacement failed) outlasted :func:`give_up_s`: the run fails with the diagnosis rather
    than wait without bound."""


GIVE_UP_FACTOR = 5.0
"""A stall that is not worked around fails the run once it lasts this many times its bound..."""
GIVE_UP_MIN_S = 120.0
"""...and at least this long (a stage's rare long unit, e.g. a checkpoint's write, is waited
for)."""


def give_up_s(bound: float) -> float:
    """How long a stall of bound ``bound`` that was not replaced may last before the run
    fails: :data:`GIVE_UP_FACTOR` x ``bound``, at least :data:`GIVE_UP_MIN_S`."""
    return max(GIVE_UP_FACTOR * bound, GIVE_UP_MIN_S)


def _give_up(host: str, probe: Probe, why: tuple[str, float, float]) -> str:
    stage, seconds, bound = why
    holding = "; ".join(_holding(probe.answer))
    return (
        f"stage {stage!r} on host {host!r} ({_process(probe.answer)}) made no progress for "
        f"{seconds:.1f} s, past {give_up_s(bound):.0f} s ({GIVE_UP_FACTOR:g} x its stall bound "
        f"of {bound:.1f} s, at least {GIVE_UP_MIN_S:g} s), and nothing here can replace it: "
        f"{holding}. Its stacks are in the stall WARNING above. A stuck engine is replaced "
        "under deploy.mode=ray or with rollout.engine_process=true (deploy=local, engine=hf); "
        "raise deploy.stall_timeout_s if such a call is legitimate"
    )


def _holds_leases(probe: Probe) -> bool:
    works = [] if probe.answer is None else probe.answer["works"]
    return any(u["lease"] is not None for w in works for u in w["holding"])


WINDOW_STEPS = 20
"""Steps the median step time is taken over."""


def _process(answer: dict[str, Any] | None) -> str:
    if answer is None:
        return "never answered"
    parts = [f"pid {answer['pid']}"]
    if answer.get("actor"):
        parts.insert(0, f"Ray actor {answer['actor']}")
    if answer.get("node"):
        parts.append(f"node {str(answer['node'])[:12]}")
    return ", ".join(parts)


def _holding(answer: dict[str, Any] | None) -> list[str]:
    """One line per stage of a host: what it holds and is in, or what it waits for."""
    if answer is None:
        return ["nothing known"]
    out = []
    for w in answer["works"]:
        units = w["holding"]
        median = w.get("median_s")
        done = f"{w['done']} done" + ("" if median is None else f", median {median:.2f} s")
        if units:
            rows = sum(u["rows"] for u in units)
            leases = [u["lease"] for u in units if u["lease"] is not None]
            phases = ", ".join(
                f"{u['phase']} for {u['phase_s']:.1f} s (held {u['held_s']:.1f} s)" for u in units
            )
            lease = f", leases {leases}" if leases else ""
            out.append(
                f"{w['name']}: holds {len(units)} unit(s), {rows} rows{lease}: in {phases}; {done}"
            )
        elif w["idle"]:
            out.append(f"{w['name']}: waits for {w['what']} for {w['idle_s']:.1f} s; {done}")
        else:
            out.append(f"{w['name']}: between units; {done}")
    return out or ["no stage"]
