"""A reward whose ties are known in advance, for the dynamic-sampling tests.

In an importable module (not a test module) so that Ray actors and a run started from the
command line (``reward.functions=[tests.asyncflow.tie_rewards:tie_by_answer]``) import it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from asyncflow import RunConfig
from engines.tasks import Task, make_task

REWARD = "reward.functions=[tests.asyncflow.tie_rewards:tie_by_answer]"
"""The config override that makes a run use :func:`tie_by_answer`."""


def tied(task: Task, group: int) -> bool:
    """Whether every sample of group ``group`` (prompt ``task.item(group)``) gets one reward."""
    return int(task.item(group).answer) % 3 == 0


def tie_by_answer(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any], **_: Any
) -> list[float]:
    """1.0 for every sample of a prompt whose answer is a multiple of 3 (its group ties);
    otherwise a number drawn from the completion's text (a group ties only if its
    completions are all the same)."""
    return [
        1.0 if int(a) % 3 == 0 else (zlib.crc32(c.encode()) % 997) / 997
        for c, a in zip(completions, answer, strict=True)
    ]


def check_filtered_run(records: list[dict[str, Any]], cfg: RunConfig) -> list[int]:
    """The invariants of a run with dynamic sampling, from its records; returns the groups it
    filtered. Each step trains ``B`` whole groups; its window (trained + filtered) follows the
    previous one without a gap; every tied prompt in a window is filtered, none trained; no
    group twice; the staleness bound holds for every trained sample."""
    task = make_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.options)
    b, n, k = cfg.train.groups_per_step, cfg.rollout.group_size, cfg.train.max_staleness
    start, trained, filtered = 0, [], []
    for r in records:
        window = sorted(r["groups"] + r["filtered"])
        assert window == list(range(start, start + len(window))), (r["step"], window)
        assert len(r["groups"]) == b and r["samples"] == b * n
        assert r["groups_filtered"] == len(r["filtered"])
        assert not any(tied(task, g) for g in r["groups"]), r
        assert {g for g in window if tied(task, g)} <= set(r["filtered"])
        assert r["staleness_max"] <= k and all(int(s) <= k for s in r["staleness_hist"])
        start += len(window)
        trained += r["groups"]
        filtered += r["filtered"]
    assert len(trained) == len(set(trained)) and set(trained).isdisjoint(filtered)
    assert filtered, "no group was filtered: the test proves nothing"
    return filtered
