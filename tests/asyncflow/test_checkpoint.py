"""Checkpoints and resume: atomic checkpoints, and runs killed with SIGKILL that resume.

The kill tests run the workflow as ``python -m asyncflow.cli run ...`` in a process of its own
(its own session, so that SIGKILL reaches everything it started), kill it once a checkpoint
exists, resume it with ``--resume`` and check the run as a whole: steps and versions continue,
every prompt group is trained exactly once and in the step an uninterrupted run trains it, the
staleness bound holds for every trained sample, and the policy folder loads.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from asyncflow import checkpoint, run
from asyncflow.checkpoint import CheckpointPlan, DriverState
from asyncflow.cli import main
from asyncflow.config.load import config_to_dict, load_config
from tests.asyncflow.conftest import small_config
from tests.asyncflow.tie_rewards import REWARD, check_filtered_run

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "output.progress=false",
    "output.loggers=[jsonl]",
    "output.plot=false",
    "train.groups_per_step=2",
    "rollout.group_size=4",
    "rollout.micro_batch_groups=1",
    "rollout.max_new_tokens=4",
    "model.warm_start_steps=0",
]
KILL_WAIT_S = 600.0  # generous: a loaded 2-core machine, Ray starting its actors


# -- atomicity, pruning, finding ---------------------------------------------------------------
def test_plan_marks_every_nth_step_and_the_last() -> None:
    plan = CheckpointPlan("/x", every_steps=3, total_steps=10)
    assert [s for s in range(1, 11) if plan.due(s)] == [3, 6, 9, 10]
    assert not any(CheckpointPlan("/x", 0, 10).due(s) for s in range(1, 11))
    assert plan.staging(3).name == "step-000003.tmp" and plan.final(3).name == "step-000003"


def _staged(plan: CheckpointPlan, steps: int) -> None:
    """A trainer part, as a trainer leaves it in the staging folder."""
    staging = plan.staging(steps)
    (staging / "policy").mkdir(parents=True)
    torch.save({"version": steps}, staging / "trainer_state.pt")


class _Tokenizer:
    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


def _state(steps: int) -> DriverState:
    return DriverState(
        steps=steps,
        version=steps,
        next_group=2 * steps,
        admission=[(j, 0) for j in range(2 * steps)],
        elapsed_s=float(steps),
        records=[{"step": s, "reward": 0.5} for s in range(steps)],
    )


def test_commit_renames_a_complete_checkpoint_and_prunes(tmp_path: Path) -> None:
    plan = CheckpointPlan(str(tmp_path), every_steps=2, total_steps=8, keep_last=2)
    plan.staging(1).mkdir()  # a stale partial one of an earlier, killed run
    for steps in (2, 4, 6):
        _staged(plan, steps)
        assert checkpoint.commit(plan, _state(steps), _Tokenizer(), {"a": 1}) == plan.final(steps)
    _staged(plan, 8)  # staged by the trainer, not yet committed by the driver
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000004", "step-000006", "step-000008.tmp"]
    state = checkpoint.read_driver_state(plan.final(6))
    assert (state.steps, state.version, state.next_group) == (6, 6, 12)
    assert state.records == _state(6).records and state.config == {"a": 1}
    # a step whose trainer part is missing is refused, nothing renamed
    with pytest.raises(FileNotFoundError, match="lacks the trainer's part"):
        checkpoint.commit(plan, _state(10), _Tokenizer(), {})


def test_the_filtered_groups_round_trip(tmp_path: Path) -> None:
    """A checkpoint of a run with dynamic sampling lists the groups it filtered before its
    next group; one written before the list existed reads as none filtered."""
    plan = CheckpointPlan(str(tmp_path), every_steps=2, total_steps=8)
    _staged(plan, 2)
    state = _state(2)
    state.next_group, state.filtered = 7, [1, 4, 5]
    checkpoint.commit(plan, state, _Tokenizer(), {})
    back = checkpoint.read_driver_state(plan.final(2))
    assert (back.next_group, back.filtered) == (7, [1, 4, 5])
    driver = plan.final(2) / "driver.json"
    old = json.loads(driver.read_text())
    del old["filtered"]
    driver.write_text(json.dumps(old))
    assert checkpoint.read_driver_state(plan.final(2)).filtered == []


def test_a_tmp_checkpoint_is_never_picked_up(tmp_path: Path) -> None:
    plan = CheckpointPlan(str(tmp_path / "checkpoints"), every_steps=2, total_steps=8)
    _staged(plan, 2)
    checkpoint.commit(plan, _state(2), _Tokenizer(), {})
    # newer, but partial: a staging folder (even with every file in it) and a bare folder
    _staged(plan, 4)
    (plan.staging(4) / "driver.json").write_text("{}")
    plan.final(6).mkdir()
    assert checkpoint.find_checkpoint(tmp_path) == plan.final(2)  # an output dir
    assert checkpoint.find_checkpoint(tmp_path / "checkpoints") == plan.final(2)
    assert checkpoint.find_checkpoint(plan.final(2)) == plan.final(2)  # the checkpoint itself
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoint.find_checkpoint(plan.staging(4))


def test_rng_states_round_trip() -> None:
    state = checkpoint.rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.random(), np.random.rand(), torch.rand(1)
    checkpoint.set_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


# -- resume config -----------------------------------------------------------------------------
def _fake_checkpoint(out: Path, steps: int, *overrides: str) -> Path:
    """A checkpoint's driver side (what resolving a resumed config reads)."""
    cfg = load_config(overrides=[f"output.dir={out}", *overrides])
    ckpt = out / "checkpoints" / f"step-{steps:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    (ckpt / "records.jsonl").write_text("")
    d = {"format": 1, "steps": steps, "version": steps, "next_group": 0, "admission": []}
    (ckpt / "driver.json").write_text(json.dumps({**d, "elapsed_s": 1.0}))
    return ckpt


def test_resume_takes_the_checkpoints_config_and_refuses_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    _fake_checkpoint(out, 4, "train.steps=10", "train.lr=0.001", "rollout.group_size=4")
    assert main(["config", "--resume", str(out), "train.steps=12"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["train"]["lr"] == 0.001 and resolved["train"]["steps"] == 12
    assert resolved["rollout"]["group_size"] == 4 and resolved["resume"] == str(out)
    cases = {
        ("rollout.group_size=8",): r"rollout\.group_size=8 \(the checkpoint's run had 4\)",
        ("task.seed=3",): r"task\.seed=3 \(the checkpoint's run had 0\)",
        ("train.steps=4",): r"has trained 4 steps of train\.steps=4; set train\.steps > 4",
    }
    for overrides, message in cases.items():
        for command in ("config", "run"):
            assert main([command, "--resume", str(out), *overrides]) == 2
            err = capsys.readouterr().err
            assert err.startswith("asyncflow: bad config: resume=") and err.count("\n") == 1
            assert re.search(message, err), err
    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


# -- kill and resume ---------------------------------------------------------------------------
def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }


_STARTED: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_run_left_behind() -> Iterator[None]:
    """A run a failing test leaves behind is killed with everything it started."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)


def _cli(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncflow.cli", "run", *args],
            cwd=ROOT,
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kill reaches its children
        )
    _STARTED.append(proc)
    return proc


def _kill_after_checkpoint(proc: subprocess.Popen[bytes], ckpt: Path, log: Path) -> None:
    deadline = time.monotonic() + KILL_WAIT_S
    while not ckpt.is_dir():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before {ckpt}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no {ckpt} within {KILL_WAIT_S} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _check_resumed_run(out: Path, steps: int, b: int, k: int, kept: list[dict[str, Any]]) -> None:
    """The invariants of a run killed after a checkpoint and resumed, from what it wrote."""
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))  # each step once, in order
    assert [r["version"] for r in records] == [s + 1 for s in range(steps)]  # versions go on
    assert records[: len(kept)] == kept  # metrics.jsonl continues the checkpoint's records
    trained = [g for r in records for g in r["groups"]]
    assert len(trained) == len(set(trained))  # no group twice
    for r in records:  # each step trains its window: the groups an uninterrupted run trains
        assert r["groups"] == list(range(r["step"] * b, (r["step"] + 1) * b))
        assert r["staleness_max"] <= k and all(int(s) <= k for s in r["staleness_hist"])
    final = checkpoint.read_driver_state(checkpoint.find_checkpoint(out))
    assert final.steps == steps and final.version == steps
    admitted = [j for j, _ in final.admission]
    assert sorted(admitted) == list(range(steps * b)) == sorted(trained)
    prefetch = 1 if k == 0 else 0  # (train.prefetch_steps: a synchronous run's next step)
    for j, v in final.admission:  # admission control held across the restart
        assert j < (v + k + 1 + prefetch) * b
    assert json.loads((out / "policy" / "asyncflow.json").read_text()) == {"version": steps}
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    last = AutoModelForCausalLM.from_pretrained(checkpoint.find_checkpoint(out) / "policy")
    for (name, a), b_ in zip(policy.state_dict().items(), last.state_dict().values(), strict=True):
        assert torch.equal(a, b_), name  # the saved policy is the final version's


def _kill_and_resume(tmp_path: Path, overrides: list[str], steps: int, every: int) -> Path:
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    args = [*SMALL, f"output.dir={out}", f"train.steps={steps}"]
    args += [f"checkpoint.every_steps={every}", *overrides]
    _kill_after_checkpoint(_cli(args, log), out / "checkpoints" / f"step-{every:06d}", log)
    assert not (out / "policy").exists()  # killed before its end
    resumed_from = checkpoint.find_checkpoint(out)
    kept = _lines(resumed_from / "records.jsonl")
    assert len(kept) == checkpoint.read_driver_state(resumed_from).steps >= every
    resume = _cli(["--resume", str(out)], log)  # nothing else: the checkpoint's config
    assert resume.wait(KILL_WAIT_S) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert f"AutoModelForCausalLM.from_pretrained('{out / 'policy'}')" in text
    b, k = 2, load_config(overrides=overrides).train.max_staleness
    _check_resumed_run(out, steps, b, k, kept)
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", [0, 1])
def test_killed_local_run_resumes_as_if_never_stopped(tmp_path: Path, k: int) -> None:
    steps = 14
    out = _kill_and_resume(tmp_path, [f"train.max_staleness={k}"], steps, every=3)
    # an uninterrupted run with the same seed trains the same groups in the same steps
    straight = run(
        small_config(tmp_path / "straight", f"train.steps={steps}", f"train.max_staleness={k}")
    )
    assert [r["groups"] for r in straight.records] == [
        r["groups"] for r in _lines(out / "metrics.jsonl")
    ]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two runs, each starting a Ray instance of its own
def test_killed_ray_run_resumes_as_if_never_stopped(tmp_path: Path) -> None:
    """deploy=ray with two generators and two FSDP trainer ranks (every rank writes its
    shards and reads them back): the driver (and the Ray instance it started) killed after a
    checkpoint, the run resumed. (Whole data-parallel replicas on Ray:
    :func:`test_killed_ray_run_with_dynamic_sampling_resumes_without_a_group_twice`.)"""
    pytest.importorskip("ray")
    overrides = [
        "deploy.mode=ray",
        "deploy.num_cpus=8",
        "deploy.start_timeout_s=600",
        "rollout.instances=2",
        "train.dp_size=2",
        "train.strategy=fsdp",
    ]
    out = _kill_and_resume(tmp_path, overrides, steps=10, every=2)
    last = checkpoint.find_checkpoint(out)
    shards = sorted(p.name for p in (last / "sharded").glob("*.distcp"))
    assert len(shards) == 2, shards
    records = _lines(out / "metrics.jsonl")
    assert all(r["weights_transfer_s"] >= 0 for r in records), records[-1]


FILTERING = [
    REWARD,
    "train.dynamic_sampling=true",
    "train.loss=decoupled",
    "train.prox_logp=interpolate",
    "train.max_tokens_per_micro_batch=48",
]
"""A run that filters a third of its groups (tied rewards), with the decoupled objective and
a token budget."""


def _kill_and_resume_filtering(tmp_path: Path, overrides: list[str], steps: int) -> None:
    """Killed after its checkpoint of step 3, resumed: the records go on in order, no group is
    trained twice or after it was filtered, every window follows the last, and the
    checkpoints list the groups filtered before their next group."""
    out, log, every = tmp_path / "run", tmp_path / "run.log", 3
    args = [*SMALL, f"output.dir={out}", f"train.steps={steps}", *FILTERING, *overrides]
    args.append(f"checkpoint.every_steps={every}")
    _kill_after_checkpoint(_cli(args, log), out / "checkpoints" / f"step-{every:06d}", log)
    resumed_from = checkpoint.find_checkpoint(out)
    state = checkpoint.read_driver_state(resumed_from)
    kept = _lines(resumed_from / "records.jsonl")
    assert state.filtered == [g for r in kept for g in r["filtered"]]  # it knows them
    assert state.next_group == max(g for r in kept for g in r["groups"] + r["filtered"]) + 1
    resume = _cli(["--resume", str(out)], log)
    assert resume.wait(KILL_WAIT_S) == 0, log.read_text()[-4000:]
    records = _lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    assert [r["version"] for r in records] == [s + 1 for s in range(steps)]
    assert records[: len(kept)] == kept
    cfg = load_config(overrides=[*SMALL, *FILTERING, *overrides])
    filtered = check_filtered_run(records, cfg)
    final = checkpoint.read_driver_state(checkpoint.find_checkpoint(out))
    assert final.steps == steps and final.filtered == filtered
    consumed = final.next_group
    assert sorted(j for j, _ in final.admission) == list(range(consumed))
    assert sorted(filtered + [g for r in records for g in r["groups"]]) == list(range(consumed))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_local_run_with_dynamic_sampling_resumes_without_a_group_twice(
    tmp_path: Path,
) -> None:
    """With partial rollouts too: all three of issue 39's options on."""
    _kill_and_resume_filtering(
        tmp_path, ["train.max_staleness=1", "rollout.partial=true"], steps=10
    )


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killed_ray_run_with_dynamic_sampling_resumes_without_a_group_twice(
    tmp_path: Path,
) -> None:
    """The same with deploy=ray, two generators and two data-parallel trainer ranks (whole
    replicas: rank 0 writes the trainer's part)."""
    pytest.importorskip("ray")
    overrides = [
        "train.max_staleness=1",
        "rollout.partial=true",
        "deploy.mode=ray",
        "deploy.num_cpus=8",
        "deploy.start_timeout_s=600",
        "rollout.instances=2",
        "train.dp_size=2",
    ]
    _kill_and_resume_filtering(tmp_path, overrides, steps=8)
