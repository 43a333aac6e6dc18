"""Which trainer ranks a ``deploy=ray`` run replaces, the error of one it cannot (the reason
and the command that resumes the run: ``asyncflow.deploy.ray_ranks.trainer_lost``), and what
a replaced rank 0 relies on in the coordinator (its position; a step, a version, a filtered
group told twice counted once). No cluster needed; the deaths themselves are in
``test_ray_workflow.py``."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import pytest

from asyncflow import RunConfig, load_config
from asyncflow.deploy.coordinator import Coordinator
from asyncflow.deploy.ray_ranks import TrainerLostError, ranks_restartable, trainer_lost

RAY = ["deploy.mode=ray"]


def _cfg(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config(overrides=[*RAY, f"output.dir={tmp_path}", *overrides])


@pytest.mark.parametrize(
    ("overrides", "rank", "why"),
    [
        (["train.dp_size=1"], 0, "a single-rank trainer holds the only copy"),
        (["train.dp_size=2", "train.strategy=fsdp"], 1, "each rank holds only its shards"),
        (["train.dp_size=2", "train.strategy=fsdp"], 0, "each rank holds only its shards"),
        (["train.dp_size=2", "deploy.max_restarts=0"], 0, "deploy.max_restarts=0"),
        (["train.dp_size=2", "deploy.max_restarts=0"], 1, "deploy.max_restarts=0"),
        (["train.dp_size=2", "deploy.max_restarts=2"], 0, "restarts are spent"),
        (["train.dp_size=2", "deploy.max_restarts=2"], 1, "restarts are spent"),
    ],
)
def test_a_trainer_rank_the_run_cannot_replace_names_why_and_the_resume_command(
    tmp_path: Path, overrides: list[str], rank: int, why: str
) -> None:
    cfg = _cfg(tmp_path, "checkpoint.every_steps=5", *overrides)
    err = trainer_lost(rank, cfg, "the actor died unexpectedly")
    assert isinstance(err, TrainerLostError)
    text = str(err)
    assert text.startswith(f"trainer rank {rank} died (the actor died unexpectedly); ")
    assert why in text
    assert text.endswith(f"asyncflow run --resume {tmp_path}")


def test_without_checkpoints_the_error_says_how_to_have_one(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "train.dp_size=2")
    text = str(trainer_lost(0, cfg, "killed"))
    assert "this run writes no checkpoints (checkpoint.every_steps=0)" in text
    assert "checkpoint.every_steps=N" in text and "asyncflow run --resume DIR" in text
    elsewhere = tmp_path / "ck"
    cfg = _cfg(
        tmp_path, "train.dp_size=2", "checkpoint.every_steps=1", f"checkpoint.dir={elsewhere}"
    )
    assert str(trainer_lost(0, cfg, "killed")).endswith(f"asyncflow run --resume {elsewhere}")


def test_the_ranks_of_a_ddp_group_of_two_or_more_are_replaced(tmp_path: Path) -> None:
    assert ranks_restartable(_cfg(tmp_path, "train.dp_size=2"))
    assert not ranks_restartable(_cfg(tmp_path, "train.dp_size=1"))
    assert not ranks_restartable(_cfg(tmp_path, "train.dp_size=2", "train.strategy=fsdp"))
    assert not ranks_restartable(_cfg(tmp_path, "train.dp_size=2", "deploy.max_restarts=0"))


def test_the_coordinator_keeps_where_rank_0_goes_on_and_takes_each_step_once() -> None:
    async def go() -> None:
        coord = Coordinator(3, first_group=12)  # a run resumed at version 3, group 12
        assert (await coord.stats())["train_position"] == (3, 12)
        await coord.step_done(pickle.dumps("step 3"), 3, 16)
        assert (await coord.stats())["train_position"] == (4, 16)
        await coord.step_done(pickle.dumps("step 3 again"), 3, 16)  # a replaced rank 0
        await coord.step_done(pickle.dumps("step 4"), 4, 20)
        assert (await coord.stats())["train_position"] == (5, 20)
        reports = [(await coord.next_report(1.0, 0))[0] for _ in range(2)]
        assert [pickle.loads(r) for r in reports if r] == ["step 3", "step 4"]
        assert (await coord.next_report(0.05, 0))[0] is None
        await coord.publish(4)
        await coord.publish(4)  # the step taken over, published again: taken once
        with pytest.raises(ValueError, match="not newer"):
            await coord.publish(3)
        await coord.filter_groups([5, 6])
        await coord.filter_groups([6, 7])  # 6 told again by a replaced rank 0
        assert await coord.filtered_count() == 3

    asyncio.run(go())
