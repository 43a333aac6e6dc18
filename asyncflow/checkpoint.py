"""Checkpoints: what one holds, who writes which part, when it counts as written, resuming.

A checkpoint after ``s`` optimizer steps is the folder ``<checkpoint.dir>/step-{s:06d}``:

| path               | written by                        | content                              |
|--------------------|-----------------------------------|--------------------------------------|
| ``policy/``        | the trainer (``engine.save``), the| the policy as a Hugging Face folder  |
|                    | driver adds the tokenizer         | (safetensors) with its tokenizer     |
| ``trainer_state.pt``| the trainer (``engine.save``)    | optimizer (and scheduler) state,     |
|                    |                                   | the policy version                   |
| ``sharded/``       | every trainer rank (``fsdp``)     | each rank's shard of the weights and |
|                    |                                   | of the optimizer state               |
| ``rng.pt``         | the trainer's process (rank 0)    | python, numpy and torch RNG states   |
| ``driver.json``    | the driver                        | steps, version, the feeder's next    |
|                    |                                   | group and admission log, the groups  |
|                    |                                   | dynamic sampling filtered, run time  |
| ``records.jsonl``  | the driver                        | the step records so far              |
| ``config.yaml``    | the driver                        | the run's config                     |

**Who writes when.** The state lives in two places: the trainer holds the weights and the
optimizer (in the driver's process with ``deploy=local``, in trainer rank 0's actor with
``deploy=ray``; data-parallel ranks are identical, rank 0 writes; with ``train.strategy=fsdp``
each rank writes its shards beside it), the driver holds the feeder
and the records. The trainer runs ahead of the driver, so the driver cannot ask it for "the
state after step t" later: the trainer writes its part itself, right after the optimizer step
of a checkpoint's last step and after publishing that step's weights (so generators already
hold them and keep generating; only the train stage waits for the save), into
``step-{s:06d}.tmp``, and then reports the step. The driver writes its part into the same
folder once the step's record is final (after the step's evaluation, when one is due),
fsyncs every file and folder, and renames ``.tmp`` to the final name: a checkpoint exists
exactly when that rename happened, and a ``.tmp`` folder (a crash, a kill mid-save) is never
picked up, only deleted later. Then checkpoints beyond ``keep_last`` are deleted, oldest first.

**Resuming** (:func:`find_checkpoint`: the newest complete one under the folder given) starts
a fresh TransferQueue (empty) and engines from the checkpoint: the trainer loads its state
(``engine.load``, RNG states), generators start from ``policy/`` at the checkpoint's version,
the registry at that version, and the feeder and the train stage's window at the first
group no step consumed (``s * B``; later with dynamic sampling, whose filtered groups the
checkpoint lists: they count as consumed, and admission goes on counting without them), with
the admission log of the consumed groups. Groups admitted but not consumed before the crash
are admitted again, under the restored weights, so the staleness bound holds across the
restart and no group is trained twice or skipped. The records continue the same
``metrics.jsonl`` (rewritten up to the checkpoint, then appended), and the timeline's clock
continues from the checkpoint's run time. The reference policy (never trained) is built
from the original model, as at the start.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from engines.protocols import CheckpointableEngine, GenerationEngine

__all__ = [
    "CheckpointPlan",
    "DriverState",
    "ResumePoint",
    "adopt_version",
    "check_checkpointable",
    "commit",
    "find_checkpoint",
    "finish_policy",
    "read_driver_state",
    "restore_trainer",
    "resume_problems",
    "rng_state",
    "set_rng_state",
    "staging_dir",
    "write_trainer_part",
]

FORMAT = 1
"""Version of ``driver.json``'s layout."""
STEP_DIR = re.compile(r"^step-(\d{6,})$")
RESUME_FIXED = (
    "task.name",
    "task.options",
    "task.seed",
    "model.name",
    "rollout.group_size",
    "train.groups_per_step",
)
"""Config keys a resumed run must share with its checkpoint: they decide which prompt group
``j`` is and which groups a step trains."""


@dataclass(frozen=True)
class CheckpointPlan:
    """When and where checkpoints are written (picklable: it travels to trainer actors)."""

    root: str
    """Absolute folder of the checkpoints (actors may run in another working directory)."""
    every_steps: int
    total_steps: int
    keep_last: int = 0

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint follows the step that made ``steps_done`` steps."""
        if self.every_steps <= 0:
            return False
        return steps_done % self.every_steps == 0 or steps_done == self.total_steps

    def final(self, steps_done: int) -> Path:
        return Path(self.root) / f"step-{steps_done:06d}"

    def staging(self, steps_done: int) -> Path:
        return Path(self.root) / f"step-{steps_done:06d}.tmp"

    @classmethod
    def of(cls, cfg: Any) -> CheckpointPlan | None:
        """The plan of a :class:`~asyncflow.config.RunConfig` (None: checkpoints off)."""
        c = cfg.checkpoint
        if c.every_steps <= 0:
            return None
        root = Path(c.dir) if c.dir is not None else Path(cfg.output.dir) / "checkpoints"
        return cls(str(root.resolve()), c.every_steps, cfg.train.steps, c.keep_last)


@dataclass(frozen=True)
class ResumePoint:
    """Where a deployment's engines start from on resume (picklable)."""

    directory: str
    """The checkpoint folder (absolute)."""
    version: int
    """The policy version of its weights (= steps trained)."""
    next_group: int | None = None
    """The first group no step consumed: where the train stage's window starts (None:
    ``version * groups_per_step``)."""

    @property
    def policy(self) -> Path:
        return Path(self.directory) / "policy"


@dataclass
class DriverState:
    """The driver's part of a checkpoint."""

    steps: int
    version: int
    next_group: int
    """The feeder's first group to admit on resume (the first one no step consumed)."""
    admission: list[tuple[int, int]]
    """(group, generator version at admission) of every consumed group."""
    elapsed_s: float
    """Run time at the checkpoint (the resumed timeline continues from it)."""
    records: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    filtered: list[int] = field(default_factory=list)
    """Groups before ``next_group`` that dynamic sampling filtered (consumed, never trained)."""


# -- the trainer's part ------------------------------------------------------------------------
def check_checkpointable(engine: object, why: str) -> CheckpointableEngine:
    """``engine`` as a :class:`CheckpointableEngine`, or a ``TypeError`` saying what needs it."""
    if not isinstance(engine, CheckpointableEngine):
        raise TypeError(
            f"{why} needs a training engine with save, load and save_policy "
            f"(engines.protocols.CheckpointableEngine); {type(engine).__name__} lacks them"
        )
    return engine


def rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU and CUDA) RNG states, as plain lists and
    tensors (``torch.load(weights_only=True)`` reads them back)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_trainer_part(engine: object, staging: Path) -> float:
    """The trainer's part of a checkpoint into ``staging`` (a stale one is replaced), fsynced;
    returns the seconds it took. Runs in the trainer's process, between steps."""
    t0 = time.perf_counter()
    ckpt = check_checkpointable(engine, "checkpoint.every_steps")
    if staging.exists():
        shutil.rmtree(staging)  # left by a run that died mid-save
    staging.mkdir(parents=True)
    ckpt.save(staging)
    torch.save(rng_state(), staging / "rng.pt")
    _fsync_tree(staging)
    return time.perf_counter() - t0


def restore_trainer(engine: object, directory: str | Path) -> None:
    """Load a checkpoint's trainer part into ``engine`` and this process's RNGs (every
    data-parallel rank loads rank 0's: they are identical)."""
    ckpt = check_checkpointable(engine, "resume")
    ckpt.load(directory)
    set_rng_state(torch.load(Path(directory) / "rng.pt", weights_only=True))


async def adopt_version(engine: GenerationEngine, policy: Path, version: int) -> None:
    """Make a generator built from a checkpoint's ``policy`` folder hold ``version``: engines
    are built at version 0, and ``update_weights`` (the one way the protocol sets a version)
    loads the folder's weights again under the checkpoint's version."""
    if engine.version == version:
        return
    from engines.hf.loading import read_folder_state  # (transformers' model code)

    state = await asyncio.to_thread(read_folder_state, policy)
    await engine.update_weights(state, version)


# -- the driver's part -------------------------------------------------------------------------
def commit(
    plan: CheckpointPlan, state: DriverState, tokenizer: Any, config: dict[str, Any]
) -> Path:
    """Complete the checkpoint after ``state.steps`` steps whose trainer part is staged:
    write the driver's part, fsync, rename to the final name, prune. Returns its folder."""
    staging, final = plan.staging(state.steps), plan.final(state.steps)
    if not (staging / "trainer_state.pt").is_file():
        raise FileNotFoundError(
            f"{staging} lacks the trainer's part (trainer_state.pt): the trainer did not "
            "save this step"
        )
    tokenizer.save_pretrained(staging / "policy")
    _write_json(staging / "policy" / "asyncflow.json", {"version": state.version})
    driver = {
        "format": FORMAT,
        "steps": state.steps,
        "version": state.version,
        "next_group": state.next_group,
        "admission": [list(a) for a in state.admission],
        "filtered": list(state.filtered),
        "elapsed_s": state.elapsed_s,
    }
    _write_json(staging / "driver.json", driver)
    with (staging / "records.jsonl").open("w") as f:
        for r in state.records:
            f.write(json.dumps(r, default=str) + "\n")
    (staging / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    _fsync_tree(staging)
    _replace_dir(staging, final)
    _prune(Path(plan.root), plan.keep_last, state.steps)
    return final


def staging_dir(directory: Path) -> Path:
    """An empty folder beside ``directory`` to write its next content into (then
    :func:`finish_policy`), so that ``directory`` is replaced whole or not at all."""
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finish_policy(tmp: Path, directory: Path, tokenizer: Any, version: int) -> Path:
    """Complete a policy folder the trainer wrote into ``tmp`` (the tokenizer, the version),
    fsync it and rename it to ``directory`` (replacing the previous one)."""
    tokenizer.save_pretrained(tmp)
    _write_json(tmp / "asyncflow.json", {"version": version})
    _fsync_tree(tmp)
    _replace_dir(tmp, directory)
    return directory


def find_checkpoint(path: str | Path) -> Path:
    """The newest complete checkpoint at ``path``: the checkpoint itself, or the newest
    ``step-NNNNNN`` folder in ``path`` or ``path/checkpoints`` (or the ``checkpoint.dir`` that
    ``path/config.yaml`` names). ``.tmp`` folders are never complete."""
    p = Path(path)
    if _complete(p):
        return p.resolve()
    roots = [p, p / "checkpoints"]
    saved = p / "config.yaml"
    if saved.is_file():
        with_dir = (yaml.safe_load(saved.read_text()) or {}).get("checkpoint") or {}
        if with_dir.get("dir"):
            roots.append(Path(with_dir["dir"]))
    found = [c for root in roots if root.is_dir() for c in root.iterdir() if _complete(c)]
    if not found:
        raise FileNotFoundError(
            f"resume={str(path)!r}: no complete checkpoint (a step-NNNNNN folder with "
            f"driver.json) in {p} or {p / 'checkpoints'}; a run writes them with "
            "checkpoint.every_steps > 0"
        )
    return max(found, key=_steps).resolve()


def read_driver_state(directory: str | Path) -> DriverState:
    root = Path(directory)
    d = json.loads((root / "driver.json").read_text())
    if d.get("format") != FORMAT:
        raise ValueError(f"{root / 'driver.json'}: format {d.get('format')!r}, expected {FORMAT}")
    records = [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]
    config = yaml.safe_load((root / "config.yaml").read_text()) or {}
    return DriverState(
        steps=int(d["steps"]),
        version=int(d["version"]),
        next_group=int(d["next_group"]),
        admission=[(int(j), int(v)) for j, v in d["admission"]],
        elapsed_s=float(d["elapsed_s"]),
        records=records,
        config=config,
        filtered=[int(g) for g in d.get("filtered", [])],  # absent: written before filtering
    )


def resume_problems(config: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """What in ``config`` (a run's, as a dict) differs from a checkpoint's ``saved`` config in
    the keys a resumed run must keep (:data:`RESUME_FIXED`)."""
    problems = []
    for key in RESUME_FIXED:
        now, then = _get(config, key), _get(saved, key)
        if now != then:
            problems.append(f"{key}={now!r} (the checkpoint's run had {then!r})")
    return problems


def check_resumable(config: dict[str, Any], resume: str, found: Path, state: DriverState) -> None:
    """Raise ``ValueError`` (one line: what and the fix) if a run with ``config`` (as a dict)
    cannot continue the checkpoint ``found`` (named by ``resume``) whose driver saved
    ``state``: a key it must keep changed, or it already trained ``train.steps``."""
    problems = resume_problems(config, state.config)
    if problems:
        raise ValueError(
            f"resume={resume}: {'; '.join(problems)}; a resumed run keeps these (they decide "
            "which prompts each step trains): drop those overrides"
        )
    steps = int(_get(config, "train.steps"))
    if state.steps >= steps:
        raise ValueError(
            f"resume={resume}: the checkpoint {found.name} has trained {state.steps} steps "
            f"of train.steps={steps}; set train.steps > {state.steps} to train further"
        )


# -- files -------------------------------------------------------------------------------------
def _complete(p: Path) -> bool:
    return bool(STEP_DIR.match(p.name)) and (p / "driver.json").is_file()


def _steps(p: Path) -> int:
    m = STEP_DIR.match(p.name)
    assert m is not None
    return int(m.group(1))


def _get(d: dict[str, Any], key: str) -> Any:
    node: Any = d
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under ``root`` (and ``root``): what the rename commits
    must be on disk before it."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (a folder already there is moved aside first and deleted
    after), then fsync the parent so the rename itself is durable."""
    old = None
    if dst.exists():
        old = dst.with_name(f"{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync_dir(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int, newest: int) -> None:
    """Delete complete checkpoints beyond the newest ``keep_last`` (0: keep all), and staging
    folders of steps up to ``newest`` (left by a run that died; later ones may be in
    progress)."""
    complete = sorted((c for c in root.iterdir() if _complete(c)), key=_steps)
    doomed: Sequence[Path] = complete[:-keep_last] if keep_last else []
    for c in root.iterdir():
        stale = re.match(r"^step-(\d{6,})\.(tmp|old-\w+)$", c.name)
        if stale and int(stale.group(1)) <= newest:
            doomed = [*doomed, c]
    for c in doomed:
        shutil.rmtree(c, ignore_errors=True)
