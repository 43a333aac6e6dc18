"""Experiment trackers behind :class:`asyncflow.metrics.MetricsWriter`.

``metrics.jsonl`` is always written (by the writer itself); ``output.loggers`` adds trackers:

| name          | writes                                              | needs                  |
|---------------|-----------------------------------------------------|------------------------|
| ``jsonl``     | ``metrics.jsonl`` (always on; naming it is allowed) |                        |
| ``tensorboard``| ``tensorboard/`` event files                       | tensorboard (default)  |
| ``wandb``     | a Weights & Biases run (``WANDB_MODE=offline``: a   | ``asyncflow[wandb]``   |
|               | local run under ``wandb/``, sync it later)          |                        |
| ``mlflow``    | an MLflow run (default store: ``mlflow.db``, SQLite)| ``asyncflow[mlflow]``  |

Every tracker gets the same scalars per step: the step record flattened with ``/``
(``stages/rollout/busy``), numbers only, non-finite values left out; W&B and MLflow also get
the run's config (as run config / params) once at the start.
"""

from __future__ import annotations

import importlib.util
import math
import queue
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncflow.config import OutputConfig

__all__ = [
    "LOGGERS",
    "MetricsLogger",
    "MlflowLogger",
    "TensorBoardLogger",
    "TrackerThread",
    "WandbLogger",
    "flatten",
    "make_loggers",
    "scalars",
]

LOGGERS: dict[str, str | None] = {
    "jsonl": None,
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
"""Logger names and the module each needs (None: nothing more)."""
INSTALL_HINTS = {
    "tensorboard": "pip install tensorboard",
    "wandb": "pip install 'asyncflow[wandb]'",
    "mlflow": "pip install 'asyncflow[mlflow]'",
}


class MetricsLogger(Protocol):
    """One experiment tracker.

    :class:`asyncflow.metrics.MetricsWriter` has ``log`` called once per train step, in step
    order, after the step's JSONL line is written, and ``close`` once when the run ends (also
    when it fails); both on the trackers' own thread (:class:`TrackerThread`), never on the
    run's event loop.
    """

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record the step's scalars (flattened names, finite numbers)."""
        ...

    def close(self) -> None:
        """Flush and end the tracker's run."""
        ...


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}`` (``sep="."``: ``{"a.b": 1}``, config keys)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + sep, sep))
        else:
            out[key] = v
    return out


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars every tracker records for a step record: finite numbers, flattened."""
    out: dict[str, float] = {}
    for key, value in flatten(record).items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if number and math.isfinite(value):
            out[key] = value
    return out


class TensorBoardLogger:
    """``tensorboard/`` under the run's output folder (torch's ``SummaryWriter``): one event
    per step holding all of its scalars (a scalar per event costs a protobuf and a queue
    hand-off each, ~100 per step)."""

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(
            value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        )
        self._writer._get_file_writer().add_summary(summary, step)

    def close(self) -> None:
        self._writer.close()


class TrackerThread:
    """Feeds the trackers from a thread of their own, so that a tracker's work (protobufs and
    file writes, a W&B or MLflow request) never runs on, or blocks, the run's event loop.

    :class:`asyncflow.metrics.MetricsWriter` calls :meth:`log` per step (it returns at once;
    the steps queue up, at most ``max_pending``, in order) and :meth:`close` at the end: the
    queue drains within ``close_timeout_s``, then every tracker is closed. A tracker's error
    is raised by the next :meth:`log` or by :meth:`close` (the thread stops logging then).
    """

    def __init__(
        self,
        loggers: list[MetricsLogger],
        *,
        max_pending: int = 1024,
        close_timeout_s: float = 120.0,
    ) -> None:
        self.loggers = loggers
        self.close_timeout_s = close_timeout_s
        self._queue: queue.Queue[tuple[int, Mapping[str, float]] | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncflow-trackers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drained, not logged: the error is raised to the writer
            try:
                for logger in self.loggers:
                    logger.log(*item)
            except BaseException as e:  # raised by the writer's next call
                self._error = e

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Queue the step's scalars (blocks only when ``max_pending`` steps wait, up to
        ``close_timeout_s``)."""
        if self._error is not None:
            raise self._error
        try:
            self._queue.put((step, values), timeout=self.close_timeout_s)
        except queue.Full:
            raise RuntimeError(
                f"the experiment trackers fell {self._queue.maxsize} steps behind for "
                f"{self.close_timeout_s:.0f} s: a tracker hangs (its server or disk); "
                "drop it from output.loggers"
            ) from None

    def close(self) -> None:
        """Drain the queue, then close every tracker (all of them, even if one fails)."""
        errors: list[BaseException] = []
        try:
            self._queue.put(None, timeout=self.close_timeout_s)
        except queue.Full:
            errors.append(RuntimeError("the experiment trackers' queue did not drain"))
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            errors.append(
                RuntimeError(
                    f"the experiment trackers did not finish within {self.close_timeout_s:.0f}"
                    " s of the run's end: a tracker hangs (its server or disk)"
                )
            )
        if self._error is not None:
            errors.append(self._error)
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # the other trackers still get their runs ended
                errors.append(e)
        if errors:
            raise errors[0]


class WandbLogger:
    """A W&B run; its files go under ``<output.dir>/wandb``. Mode, API key and entity come
    from W&B's own settings (``WANDB_MODE=offline`` runs with no account or network)."""

    def __init__(self, out_dir: Path, *, project: str, name: str, config: Mapping[str, Any]):
        import wandb

        try:
            self._run = wandb.init(
                project=project, name=name, dir=str(out_dir), config=dict(config)
            )
        except Exception as e:  # e.g. no API key: say how to run without one
            raise RuntimeError(
                f"output.loggers=wandb: wandb.init failed ({type(e).__name__}: {e}); log in "
                "with `wandb login`, or set WANDB_MODE=offline to write a local run"
            ) from e

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


_MLFLOW_KEY = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in metric and param names
_MLFLOW_BATCH = 100  # params per log_batch request (MLflow's limit)


class MlflowLogger:
    """An MLflow run in experiment ``project`` (created if missing) at ``tracking_uri``.

    The default store is MLflow's own default kind, SQLite, in the run's folder
    (``sqlite:///<output.dir>/mlflow.db``; ``mlflow ui --backend-store-uri`` that URI shows
    it). A ``file:`` store works too, but MLflow 3 keeps it in maintenance mode and refuses it
    unless ``MLFLOW_ALLOW_FILE_STORE=true`` is set.
    """

    def __init__(
        self, tracking_uri: str, *, project: str, name: str, config: Mapping[str, Any]
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        try:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self._client.create_experiment(project)
            )
            self.run_id: str = self._client.create_run(experiment_id, run_name=name).info.run_id
        except Exception as e:  # e.g. a refused file store: one line saying what to change
            message = " ".join(str(e).split())[:300]
            raise RuntimeError(
                f"output.loggers=mlflow: cannot start a run at {tracking_uri!r} "
                f"({type(e).__name__}: {message}); fix output.mlflow_uri"
            ) from e
        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in flatten(config, sep=".").items()]
        for i in range(0, len(params), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, params=params[i : i + _MLFLOW_BATCH])

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), float(v), now_ms, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    return _MLFLOW_KEY.sub("_", key)


def missing_packages(names: list[str]) -> dict[str, str]:
    """Loggers in ``names`` whose package is not installed, with the command that installs it."""
    return {
        name: INSTALL_HINTS[name]
        for name in names
        if (module := LOGGERS.get(name)) and importlib.util.find_spec(module) is None
    }


def make_loggers(output: OutputConfig, config: Mapping[str, Any]) -> list[MetricsLogger]:
    """The trackers ``output.loggers`` names (beyond the always-on JSONL), started.

    Called by the workflow when a run starts; ``config`` (the run's config as a dict) is
    recorded by the trackers that keep one.
    """
    out_dir = Path(output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = output.run_name or out_dir.resolve().name
    loggers: list[MetricsLogger] = []
    try:
        for logger in dict.fromkeys(output.loggers):
            if logger == "tensorboard":
                loggers.append(TensorBoardLogger(out_dir))
            elif logger == "wandb":
                loggers.append(
                    WandbLogger(out_dir, project=output.project, name=name, config=config)
                )
            elif logger == "mlflow":
                uri = output.mlflow_uri or f"sqlite:///{out_dir.resolve() / 'mlflow.db'}"
                loggers.append(MlflowLogger(uri, project=output.project, name=name, config=config))
    except BaseException:
        for started in loggers:
            started.close()
        raise
    return loggers
