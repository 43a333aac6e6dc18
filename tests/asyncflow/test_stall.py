"""A stage that holds work and makes no progress: a woken holder is harmless, a stall is named.

Local runs (stages as asyncio tasks in the driver) over an embedded TransferQueue; the Ray
versions (a frozen stage host found, named and replaced) are in ``test_ray_stall``.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest

from asyncflow import EngineFactories, run
from tests.asyncflow.conftest import small_config
from tests.asyncflow.faulty import StallsOnce, wrapped_generator

LOCAL = ["deploy.mode=local", "transferqueue.mode=embedded"]


def test_a_batch_whose_lease_ran_out_is_dropped_and_the_run_goes_on(
    out_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rollout's third engine call outlasts its lease (4 s over a 1.5 s lease): the
    controller hands the rows out again, and the stale holder's put fails with
    LeaseExpiredError. The rollout drops that batch (one WARNING naming the stage and the
    lease, counted in the step records) and the run completes, every group trained once."""
    cfg = small_config(out_dir, "transferqueue.lease_s=1.5", "train.max_staleness=1", *LOCAL)
    factories = EngineFactories(generator=functools.partial(wrapped_generator, StallsOnce))
    with caplog.at_level(logging.WARNING, logger="asyncflow.stage_runner"):
        result = run(cfg, factories=factories)
    b = cfg.train.groups_per_step
    trained = [g for rep in result.reports for g in rep.groups]
    assert trained == list(range(cfg.train.steps * b))  # every group once, in order
    for rep in result.reports:
        assert rep.samples == b * cfg.rollout.group_size
    drops = [r for r in caplog.records if "dropped a batch" in r.getMessage()]
    assert drops, "the stale batch's drop was not logged"
    assert all(r.levelno == logging.WARNING for r in drops)
    assert "rollout: dropped a batch of" in drops[0].getMessage()
    assert "lease" in drops[0].getMessage()
    counted = sum(
        r["stage_metrics"].get("rollout", {}).get("dropped_batches", 0) for r in result.records
    )
    assert counted == len(drops)
