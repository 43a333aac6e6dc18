"""The driver's supervisor: a run's jobs as named tasks of one ``asyncio.TaskGroup``.

A *job* is a long-running coroutine of the run (the feeder, the step recorder, a stage, a
weight follower, the evaluator's reader, the regeneration of lost groups). The supervisor runs
them all until its *main* job returns, and guarantees:

| event                                    | what happens                                      |
|------------------------------------------|---------------------------------------------------|
| the main job returns                     | every other job is cancelled and awaited; the run |
|                                          | goes on to its end                                |
| a job raises                             | every other job is cancelled and awaited; the     |
|                                          | error is raised as a :class:`StageError` naming   |
|                                          | the job (a stage's own StageError as is)          |
| every job but the main one and the       | the run fails: nothing would make progress        |
| ``background`` ones returned             | (``idle_error``)                                  |
| a cancelled job has not ended after      | an error names it in the log (a job must end on   |
| :data:`STOP_S`                           | cancellation: every job here awaits asyncio       |
|                                          | waits, which do)                                  |

No task outlives :meth:`Supervisor.run` (the task group awaits them all), and the waits of one
job on another (the recorder on the step reports) are bounded by this supervision: the job it
waits for either produces or ends the run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from asyncflow.stage_runner import StageError

__all__ = ["STOP_S", "Job", "Supervisor"]

log = logging.getLogger(__name__)

Job = Callable[[], Coroutine[Any, Any, None]]
STOP_S = 30.0
"""How long cancelled jobs may take to end before the supervisor names them in the log."""


class Supervisor:
    """Named jobs run together; see the module doc."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[Job, bool]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._progressing: set[str] = set()  # jobs not background that have not returned
        self._idle_error = ""
        self._stopped = False
        self._watchdog: asyncio.TimerHandle | None = None
        self._group: asyncio.TaskGroup | None = None

    def add(self, name: str, job: Job, *, background: bool = False) -> None:
        """Run ``job`` as ``name``; a ``background`` job (one that only reacts, such as the
        regeneration of lost groups) does not count as progress."""
        if name in self._jobs:
            raise ValueError(f"a job named {name!r} is already supervised")
        self._jobs[name] = (job, background)

    def spawn(self, name: str, job: Job) -> None:
        """Start ``job`` as ``name`` while the jobs run (an instance added to a running
        stage), supervised as the others; a background job: the run needs it for no
        progress of its own. Refused once the run stops."""
        if self._group is None or self._stopped:
            raise RuntimeError(f"cannot start job {name!r}: the jobs are not running")
        if name in self._jobs:
            raise ValueError(f"a job named {name!r} is already supervised")
        self._jobs[name] = (job, True)
        self._tasks[name] = self._group.create_task(self._guard(name, job))

    async def run(self, name: str, main: Job, *, idle_error: str) -> None:
        """Run every job and ``main`` (as ``name``) until ``main`` returns or a job fails;
        ``idle_error`` is the error when every job but ``main`` and the background ones
        returned first."""
        if name in self._jobs:
            raise ValueError(f"a job named {name!r} is already supervised")
        self._idle_error = idle_error
        self._progressing = {n for n, (_, background) in self._jobs.items() if not background}
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for job_name, (job, _) in self._jobs.items():
                    self._tasks[job_name] = group.create_task(self._guard(job_name, job))
                await self._guard(name, main)
                self._stop()  # the run is done: the jobs left end (cancelled, awaited)
        except BaseExceptionGroup as group_error:
            error = _first(group_error)
            raise error from error.__cause__  # (a StageError keeps its cause)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()

    async def _guard(self, name: str, job: Job) -> None:
        """Run one job; its failure becomes a StageError naming it and stops the run (a
        failure while the run stops, in a job's cleanup, is only logged)."""
        try:
            await job()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self._stopped:
                log.warning("job %r failed while the run stopped: %r", name, e)
                return
            self._stop()
            if isinstance(e, StageError):
                raise
            raise StageError(name, e) from e
        if name in self._progressing and not self._stopped:
            self._progressing.discard(name)
            if not self._progressing:  # (the main job is not among them)
                self._stop()
                raise RuntimeError(self._idle_error)

    def _stop(self) -> None:
        """The run stops (done, or a job failed): cancel every job, and name in the log
        those that outlive their cancellation by STOP_S."""
        if self._stopped:
            return
        self._stopped = True
        me = asyncio.current_task()
        for task in self._tasks.values():
            if task is not me:  # (a failing job ends by raising)
                task.cancel()
        self._watchdog = asyncio.get_running_loop().call_later(STOP_S, self._name_stuck)

    def _name_stuck(self) -> None:
        stuck = [n for n, t in self._tasks.items() if not t.done()]
        if stuck:
            log.error(
                "jobs %s have not ended %.0f s after they were cancelled; the run waits for them",
                stuck,
                STOP_S,
            )


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The error to raise for a failed task group: the first job's failure."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _first(error)
        return error
    return group
