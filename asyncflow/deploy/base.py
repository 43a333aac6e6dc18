"""What a deployment of the workflow gives the driver.

The driver (``asyncflow.workflow``) is the run's single controller, as in LlamaRL: it owns the
prompt feeder (admission control under the staleness bound), takes the trainer's step reports
and writes the run's records. Where the stages run is the deployment's business:

| deployment          | stages                                   | registry             |
|---------------------|------------------------------------------|----------------------|
| ``local``           | asyncio tasks in the driver's process    | an object in the     |
|                     |                                          | driver               |
| ``ray``             | one Ray actor per stage instance, each   | a small coordinator  |
|                     | with the resources its config names      | actor                |

Sample data never passes through the driver in either: every stage reads and writes
TransferQueue itself. What the driver gets from a deployment is small: a TransferQueue client
(for the feeder's puts and the queue stats), the registry the feeder reads, length predictions
for the feeder when the rollout ranks prompts, and the step reports.

**Checkpoints, resume, validation** (``asyncflow.checkpoint``, ``asyncflow.evaluation``). A
deployment is constructed with ``checkpoint`` (a :class:`~asyncflow.checkpoint.CheckpointPlan`
or None) and ``resume`` (a :class:`~asyncflow.checkpoint.ResumePoint` or None) and then:

- writes the trainer's part of a checkpoint where the trainer lives, right after the optimizer
  step of every step the plan marks and after publishing its weights, *before* handing over
  that step's report (:func:`~asyncflow.checkpoint.write_trainer_part`): the driver completes
  the checkpoint once it has the report;
- on resume, restores the trainer (every rank) with
  :func:`~asyncflow.checkpoint.restore_trainer`, builds generators from the checkpoint's
  policy folder at its version (:func:`~asyncflow.checkpoint.adopt_version`, again after a
  restart of a generator host), and starts the registry at that version;
- with ``eval.every_steps``, runs the ``eval`` and ``eval/reward`` stages
  (:func:`asyncflow.graph.eval_rollout_runner`, :func:`~asyncflow.graph.eval_reward_runner`)
  on the ``val`` partition, over the same generation instances as the rollout;
- writes the trained policy when asked (:meth:`Deployment.save_policy`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from adapters import StepReport
from asyncflow.feeder import AdmissionState, Predictor
from asyncflow.metrics import Timeline
from asyncflow.registry import WeightSync
from asyncflow.stall import Probe
from engines.tasks import Task
from transferqueue import AsyncClient

__all__ = ["Deployment", "Job"]

Job = Callable[[], Coroutine[Any, Any, None]]
"""A long-running part of a run (a stage, a weight follower); the driver supervises it: if it
raises, the run stops with a :class:`~asyncflow.stage_runner.StageError` naming it."""


class Deployment(ABC):
    """Where a run's stages live. Used by the driver as ``async with``."""

    client: AsyncClient
    """The driver's TransferQueue client."""
    registry: AdmissionState
    """Generator versions for admission control."""
    timeline: Timeline
    """The run's timeline (stage hosts elsewhere merge theirs into it, see :meth:`collect`)."""
    task: Task
    tokenizer: Any
    restarts: dict[str, int]
    """Stage hosts restarted so far, by name (``ray``; always empty with ``local``)."""
    restart_times: list[tuple[str, float, float]]
    """Each restart of a stage host: (name, when its death was seen, when its replacement
    answered), on the run's timeline (``ray``; always empty with ``local``)."""

    @property
    def predict(self) -> Predictor | None:
        """Predicted response lengths for the feeder (None without a ranker)."""
        return None

    @abstractmethod
    async def open(self) -> None:
        """Start TransferQueue, the registry and every stage host (engines loaded)."""

    @abstractmethod
    def jobs(self) -> dict[str, Job]:
        """The parts the driver runs and supervises, by name (stages, followers)."""

    @abstractmethod
    async def next_report(self) -> StepReport:
        """Wait for the next finished train step (its weights already published)."""

    @abstractmethod
    async def collect(self) -> dict[str, dict[str, float]]:
        """Merge what stage hosts recorded since the last call into :attr:`timeline`; returns
        per stage the means of its adapters' metrics over that time."""

    async def weight_syncs(self) -> list[WeightSync]:
        """The generators' weight syncs since the last call, in order (for the step records:
        each sync's transfer and pause times). None by default."""
        return []

    async def progress(self) -> dict[str, Probe]:
        """Every stage host by name as last heard from: what its stages hold and have done
        (:mod:`asyncflow.progress`), for the stall watch (:mod:`asyncflow.stall`); never
        waits for a host that does not answer. None known by default."""
        return {}

    async def stacks(self, host: str, timeout_s: float) -> dict[str, Any] | None:
        """``host``'s progress with the Python stacks of its threads and of its units of work
        in hand, collected in its process; None when it does not answer within
        ``timeout_s``."""
        return None

    async def replace(self, host: str) -> bool:
        """Replace a stalled ``host``: kill it and start it again through the restart path
        (its leases handed back at once). False where it cannot be (by default)."""
        return False

    @property
    def scalable(self) -> tuple[str, ...]:
        """The stages whose instance count can change while the run goes on
        (``asyncflow scale``); none by default."""
        return ()

    def instances(self) -> dict[str, int]:
        """Instances of each stage now (every step record carries them); empty where a
        deployment does not count them."""
        return {}

    def supervise(self, spawn: Callable[[str, Job], None]) -> None:
        """Take the driver supervisor's ``spawn``, which starts a job while the run goes on
        (a deployment that replaces a preempted instance by itself); unused by default."""
        del spawn

    async def scale(self, stage: str, n: int, spawn: Callable[[str, Job], None]) -> int:
        """Give ``stage`` ``n`` instances while the run goes on; returns the count before.
        ``spawn`` starts a new instance's job under the driver's supervisor. Raises
        :class:`~asyncflow.control.ControlError` for what cannot be done."""
        from asyncflow.control import ControlError

        raise ControlError(f"this run's deployment scales no stage (stage {stage!r})")

    @abstractmethod
    async def save_policy(self, directory: Path) -> None:
        """Write the trained policy's model files into ``directory`` (an existing, empty
        folder), where the trainer lives; the driver adds the tokenizer. Called once after the
        last step. ``TypeError`` if the training engine cannot save
        (:class:`~engines.protocols.CheckpointableEngine`)."""

    @abstractmethod
    async def summary(self) -> dict[str, Any]:
        """End-of-run counters (weight updates, restarts, ...)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop every stage host and TransferQueue (idempotent)."""

    async def __aenter__(self) -> Deployment:
        try:
            await self.open()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
