"""A stage's batch never waits for more rows than a step admits: with ``max_staleness=0`` only
``groups_per_step`` groups are in flight, and a larger batch would wait out the stage's poll
(0.5 s) at every step."""

from __future__ import annotations

from typing import Any

import pytest

from asyncflow import graph, load_config


class Capture:
    """Stands in for an adapter class: keeps what the builder passes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.mark.parametrize(
    ("overrides", "rollout_rows", "reward_rows", "reference_rows"),
    [
        ([], 64, 64, 16),  # the defaults: a step of 8 groups of 8
        (["train.groups_per_step=2"], 16, 16, 16),
        (["train.groups_per_step=2", "rollout.group_size=4", "reference.batch_size=64"], 8, 8, 8),
        (["rollout.micro_batch_groups=2", "reward.batch_size=8"], 16, 8, 16),
    ],
)
def test_batches_are_at_most_a_step(
    overrides: list[str], rollout_rows: int, reward_rows: int, reference_rows: int
) -> None:
    cfg = load_config(None, [*overrides, "train.max_staleness=0"])
    rollout = graph.rollout_adapter(Capture, [], cfg, on_demand=None)  # type: ignore[arg-type]
    reward = graph.reward_adapter(Capture, lambda *a, **k: [], None, cfg)  # type: ignore[arg-type]
    reference = graph.reference_adapter(Capture, None, cfg)  # type: ignore[arg-type]
    assert isinstance(rollout, Capture) and isinstance(reward, Capture)
    assert isinstance(reference, Capture)
    assert rollout.kwargs["batch_size"] == rollout_rows
    assert reward.kwargs["batch_size"] == reward_rows
    assert reference.kwargs["batch_size"] == reference_rows
