"""Run metrics: the stage timeline, per-step records, and where they go.

- :class:`Timeline`: busy intervals of every stage worker (lane), the single source of
  busy/idle fractions, samples/s and tokens/s, and of the Gantt charts of the benchmarks;
  :func:`write_timeline` saves it as ``timeline.json`` and as a Chrome trace
  (``timeline.trace.json``: open it in https://ui.perfetto.dev or chrome://tracing).
- :class:`MetricsWriter`: one JSON line per train step (``metrics.jsonl``), the same scalars to
  the experiment trackers of ``output.loggers`` (``asyncflow.loggers``: TensorBoard, W&B,
  MLflow), and a progress bar on the console.
- :func:`version_metrics`, :func:`sync_metrics`: the per-step partial-rollout figures (how
  many samples spanned versions, staleness split into generating and queued, each weight
  sync's transfer and pause times).
- :func:`plot_rewards`: the reward curve of a run (``reward.png``).
- :func:`plot_capacity`: a run's instances per stage and its throughput over time
  (``capacity.png``: where a run was scaled, by command or by its autoscaler).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow.loggers import MetricsLogger, TrackerThread, scalars
from asyncflow.registry import WeightSync

__all__ = [
    "MetricsWriter",
    "Timeline",
    "merge_intervals",
    "plot_capacity",
    "plot_rewards",
    "staleness_histogram",
    "sync_metrics",
    "version_metrics",
    "write_timeline",
]

STAGE_ORDER = ("rollout", "reward", "reference", "train")
"""The pipeline's stages in data order: the order of the trace's tracks."""


class Timeline:
    """Busy intervals per lane (``stage`` or ``stage/worker``), in seconds since the run began.

    ``origin`` is the run's start as wall-clock time (``time.time()``), shared by every process
    of a run: each process records on its own monotonic clock (``time.perf_counter``, what
    stage runners and adapters time batches with) and converts once, so the timelines of stage
    hosts in other processes merge into the driver's (:meth:`drain`, :meth:`merge`) on one
    axis. Across nodes, that axis is as good as the nodes' clock sync.
    """

    def __init__(self, origin: float | None = None) -> None:
        wall, mono = time.time(), time.perf_counter()
        self.origin = wall if origin is None else origin
        self.t0 = mono - (wall - self.origin)  # perf_counter value at the origin
        self.intervals: dict[str, list[tuple[float, float, int, int]]] = defaultdict(list)
        self._drained: dict[str, int] = {}

    def record(self, lane: str, start: float, end: float, *, samples: int, tokens: int) -> None:
        """A batch of ``samples`` (``tokens``) busy on ``lane`` from ``start`` to ``end``
        (``time.perf_counter`` seconds of this process)."""
        self.intervals[lane].append((start - self.t0, end - self.t0, samples, tokens))

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def drain(self) -> dict[str, list[tuple[float, float, int, int]]]:
        """Intervals recorded since the last drain (a stage host hands them to the driver)."""
        out = {}
        for lane, ivs in self.intervals.items():
            done = self._drained.get(lane, 0)
            if len(ivs) > done:
                out[lane] = ivs[done:]
                self._drained[lane] = len(ivs)
        return out

    def merge(self, intervals: dict[str, list[tuple[float, float, int, int]]]) -> None:
        """Add intervals drained from another process's timeline of the same run."""
        for lane, ivs in intervals.items():
            self.intervals[lane].extend((float(s), float(e), int(n), int(t)) for s, e, n, t in ivs)

    def stage_of(self, lane: str) -> str:
        return lane.split("/")[0]

    def summary(
        self, since: float = 0.0, until: float | None = None
    ) -> dict[str, dict[str, float]]:
        """Per stage, in a window: busy fraction (time any batch of a lane was in flight,
        averaged over the stage's lanes), samples/s and tokens/s."""
        until = self.now() if until is None else until
        span = max(until - since, 1e-9)
        out: dict[str, dict[str, float]] = {}
        lanes: dict[str, int] = Counter(self.stage_of(lane) for lane in self.intervals)
        for lane, ivs in self.intervals.items():
            stage = self.stage_of(lane)
            st = out.setdefault(stage, {"busy": 0.0, "samples_per_s": 0.0, "tokens_per_s": 0.0})
            for s, e, n, tok in ivs:
                lo, hi = max(s, since), min(e, until)
                if hi > lo:
                    frac = (hi - lo) / max(e - s, 1e-9)
                    st["samples_per_s"] += n * frac / span
                    st["tokens_per_s"] += tok * frac / span
            busy = sum(e - s for s, e in merge_intervals(ivs, since, until))
            st["busy"] += busy / span / lanes[stage]
        for st in out.values():
            st["idle"] = 1.0 - st["busy"]
        return out

    def to_json(self) -> dict[str, Any]:
        return {lane: [list(iv) for iv in ivs] for lane, ivs in self.intervals.items()}

    def to_chrome_trace(self, records: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
        """The timeline in Chrome's Trace Event Format (JSON object form).

        | trace          | from                                                       |
        |----------------|------------------------------------------------------------|
        | process (pid)  | a stage (``rollout``, ``reward``, ...), in pipeline order  |
        | thread (tid)   | a lane of that stage (``rollout/0``, ...)                  |
        | ``X`` event    | one busy interval; ``args``: samples, tokens               |
        | ``C`` counter  | ``reward`` of each step record, at the step's ``time_s``   |

        Times are microseconds since the timeline's start.
        """

        def stage_key(stage: str) -> tuple[int, str]:
            order = STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER)
            return order, stage

        stages = sorted({self.stage_of(lane) for lane in self.intervals}, key=stage_key)
        events: list[dict[str, Any]] = []
        for pid, stage in enumerate(stages, 1):
            events.append(_meta("process_name", pid, 0, {"name": stage}))
            events.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
            lanes = sorted(lane for lane in self.intervals if self.stage_of(lane) == stage)
            for tid, lane in enumerate(lanes, 1):
                events.append(_meta("thread_name", pid, tid, {"name": lane}))
                for start, end, samples, tokens in self.intervals[lane]:
                    events.append(
                        {
                            "ph": "X",
                            "name": stage,
                            "cat": "stage",
                            "pid": pid,
                            "tid": tid,
                            "ts": start * 1e6,
                            "dur": max(end - start, 0.0) * 1e6,
                            "args": {"samples": samples, "tokens": tokens},
                        }
                    )
        counter_pid = len(stages) + 1
        steps = [r for r in records if math.isfinite(r.get("reward", math.nan))]
        if steps:
            events.append(_meta("process_name", counter_pid, 0, {"name": "train steps"}))
        for r in steps:
            events.append(
                {
                    "ph": "C",
                    "name": "reward",
                    "pid": counter_pid,
                    "ts": r["time_s"] * 1e6,
                    "args": {"reward": r["reward"]},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def write_timeline(
    timeline: Timeline, out_dir: str | Path, records: Sequence[dict[str, Any]] = ()
) -> tuple[Path, Path]:
    """Write ``timeline.json`` (lane -> intervals) and ``timeline.trace.json`` (Chrome trace).

    Called by the workflow when a run ends; ``records`` (the step records) add a reward counter.
    """
    out = Path(out_dir)
    plain, trace = out / "timeline.json", out / "timeline.trace.json"
    plain.write_text(json.dumps(timeline.to_json()))
    trace.write_text(json.dumps(timeline.to_chrome_trace(records)))
    return plain, trace


def merge_intervals(
    ivs: list[tuple[float, float, int, int]], since: float = 0.0, until: float = math.inf
) -> list[tuple[float, float]]:
    """The union of intervals (clipped to [since, until]) as disjoint sorted (start, end)."""
    spans = sorted((max(s, since), min(e, until)) for s, e, *_ in ivs if e > since and s < until)
    merged: list[tuple[float, float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def staleness_histogram(staleness: list[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(staleness).items())}


def version_metrics(
    step: int, oldest: Sequence[int], newest: Sequence[int], ended: Sequence[int]
) -> dict[str, float]:
    """What a step's samples say about versions (per sample: its oldest and newest token's
    version, and the trainer's version when its generation ended; see ``adapters.train``).

    | key                              | what                                                 |
    |----------------------------------|------------------------------------------------------|
    | ``spanned_share``                | share of samples whose tokens come from >1 version   |
    | ``span_max``                     | largest newest - oldest                              |
    | ``staleness_gen_mean`` / ``_max``| ended - oldest: staleness gained while generating    |
    | ``staleness_queue_mean``/``_max``| step - ended: staleness gained queued for training   |

    The two parts add up to ``step - oldest``, the staleness the bound is about.
    """
    n = len(oldest)
    if n == 0:
        return {}
    spans = [b - a for a, b in zip(oldest, newest, strict=True)]
    gen = [e - a for a, e in zip(oldest, ended, strict=True)]
    queued = [step - e for e in ended]
    return {
        "spanned_share": sum(s > 0 for s in spans) / n,
        "span_max": max(spans),
        "staleness_gen_mean": sum(gen) / n,
        "staleness_gen_max": max(gen),
        "staleness_queue_mean": sum(queued) / n,
        "staleness_queue_max": max(queued),
    }


def sync_metrics(syncs: Sequence[WeightSync]) -> dict[str, Any]:
    """The weight syncs done during a step: each one (``weight_syncs``) and, over them, the
    mean and largest transfer and pause times and the tokens partial updates kept."""
    out: dict[str, Any] = {"weight_syncs": [dataclasses.asdict(s) for s in syncs]}
    if syncs:
        pause = [s.pause_s for s in syncs]
        transfer = [s.transfer_s for s in syncs]
        out.update(
            sync_pause_s_mean=sum(pause) / len(pause),
            sync_pause_s_max=max(pause),
            sync_transfer_s_mean=sum(transfer) / len(transfer),
            sync_transfer_s_max=max(transfer),
        )
    out["kept_tokens"] = sum(s.kept_tokens for s in syncs)
    return out


class MetricsWriter:
    """Writes step records to ``metrics.jsonl`` and the trackers, and drives a progress bar.

    ``loggers`` are started trackers (:func:`asyncflow.loggers.make_loggers`); the writer
    closes them in :meth:`close`. ``previous`` are the records of a resumed run up to its
    checkpoint: ``metrics.jsonl`` is rewritten with them (dropping what the interrupted run
    wrote after the checkpoint, steps that are trained again) and continues from there; the
    trackers got them when they were first written.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        total_steps: int,
        progress: bool,
        loggers: Sequence[MetricsLogger] = (),
        previous: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._jsonl = self.path.open("w")
        self.records: list[dict[str, Any]] = list(previous)
        for record in self.records:
            self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        self._jsonl.flush()
        self.loggers = list(loggers)
        self._trackers = TrackerThread(self.loggers) if self.loggers else None
        self._bar: Any = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=len(self.records),
                desc="train steps",
                unit="step",
                dynamic_ncols=True,
            )

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._jsonl.write(json.dumps(record, default=_jsonable) + "\n")
        self._jsonl.flush()
        if self._trackers is not None:  # on their own thread: never on the run's loop
            self._trackers.log(record["step"], scalars(record))
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                reward=f"{record['reward']:.3f}",
                loss=f"{record.get('loss', float('nan')):.3f}",
                stale=record.get("staleness_max", 0),
            )

    def close(self) -> None:
        """Close the file, every tracker (all of them, even if one fails) and the bar."""
        self._jsonl.close()
        if self._bar is not None:
            self._bar.close()
        if self._trackers is not None:
            self._trackers.close()


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def plot_rewards(runs: dict[str, list[dict[str, Any]]], path: str | Path, title: str) -> Path:
    """Reward per train step of one or several runs (name -> records), with a moving mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, records in runs.items():
        steps = [r["step"] for r in records]
        rewards = [r["reward"] for r in records]
        _with_mean(ax, steps, rewards, name)
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _with_mean(ax: Any, x: list[Any], y: list[float], label: str) -> None:
    """``y`` faint, and its moving mean over a tenth of the points in the same colour."""
    (line,) = ax.plot(x, y, alpha=0.35)
    w = max(1, len(y) // 10)
    smooth = [
        sum(y[max(0, i - w + 1) : i + 1]) / len(y[max(0, i - w + 1) : i + 1]) for i in range(len(y))
    ]
    ax.plot(x, smooth, color=line.get_color(), label=label)


def _save(fig: Any, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_capacity(records: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Instances per stage (the records' ``instances``, steps) and samples per second (each
    step's samples over its time, with a moving mean) against the run's time; the autoscaler's
    decisions marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    t = [float(r["time_s"]) for r in records]
    stages = sorted({s for r in records for s in r.get("instances", {})})
    for stage in stages:
        counts = [r.get("instances", {}).get(stage, 0) for r in records]
        top.step(t, counts, where="post", label=stage)
    for r in records:
        if "autoscale" in r:
            top.axvline(float(r["time_s"]), color="grey", alpha=0.4, linestyle=":")
    top.set_ylabel("instances")
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    top.set_title(title)
    rate = [r["samples"] / max(float(r["step_s"]), 1e-9) for r in records]
    _with_mean(bottom, t, rate, "samples/s")
    bottom.set_xlabel("run time (s)")
    bottom.set_ylabel("samples per second")
    bottom.grid(alpha=0.3)
    return _save(fig, path)
