"""Episodes as TransferQueue columns, and a batch of episodes run on one engine instance.

What the rollout writes onto each row (one row = one episode; a GRPO group is ``group_size``
episodes of one prompt). ``T`` is the number of tokens after the prompt, ``n`` the turns:

| field              | kind                 | per row                                            |
|--------------------|----------------------|----------------------------------------------------|
| response_ids       | ragged int32 [T]     | every token after the prompt: the model's turns    |
|                    |                      | and the observations between them                  |
| behaviour_logprobs | ragged float32 [T]   | the sampler's log-prob per token (0 off the mask)  |
| loss_mask          | ragged bool [T]      | true on the model's own tokens only                |
| token_versions     | ragged int32 [T]     | policy version that sampled each token (-1 off the |
|                    |                      | mask); tokens of one turn may carry several        |
|                    |                      | versions (partial rollouts)                        |
| turn_offsets       | ragged int32 [n]     | where each model turn starts in response_ids       |
| turn_rewards       | ragged float32 [n]   | the environment's reward per turn (NaN: none)      |
| num_turns          | dense int32          | n                                                  |
| end_reason         | object str           | done, max_turns, max_tokens, timeout, env_error    |
| episode_reward     | dense float32        | sum of turn_rewards (``timeout``: the timeout      |
|                    |                      | reward); NaN: no verdict (no environment, or its   |
|                    |                      | infrastructure failed: ``env_error``)              |
| episode_info       | object dict          | the environment's counters summed over the turns   |
|                    |                      | (e.g. ``tool_calls``), ``truncated_observations``  |
| episode_stats      | object dict          | how its time went: ``reset_s``/``step_s`` (each    |
|                    |                      | call's latency), ``engine_s``, ``env_s``,          |
|                    |                      | ``retries`` (``engines.episodes.EpisodeStats``)    |
| finish_reason      | object str           | of the last turn: stop or length                   |

and the row's header ``version`` is the oldest version among its tokens (what the staleness
bound is checked against), ``length`` the prompt's tokens plus ``T``.

**When rows are written**: an episode is written once it has ended, with the rest of its
micro-batch (the stage runner writes a batch's columns in one put, which acknowledges its
lease). A rollout worker that dies mid-episode has written nothing of its batch: the lease runs
out and the rows are handed out again, and their episodes are generated from the start. So a
dead worker loses at most the episodes it held, and none is ever half written.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engines.episodes import END_REASONS, Episode, EpisodeSource, TurnBatcher
from engines.episodes.batcher import BatchGenerate
from engines.episodes.causes import top_causes
from engines.episodes.record import FAILED
from engines.protocols import Generation, SamplingParams
from transferqueue import Ragged
from transferqueue.schema import Column

__all__ = [
    "EPISODE_FIELDS",
    "SUMMARY_FIELDS",
    "EpisodeTally",
    "episode_columns",
    "episode_metrics",
    "failed_groups",
    "rows_of",
    "run_episodes",
    "single_turn_columns",
]

EPISODE_FIELDS = (
    "response_ids",
    "behaviour_logprobs",
    "finish_reason",
    "loss_mask",
    "token_versions",
    "turn_offsets",
    "turn_rewards",
    "num_turns",
    "end_reason",
    "episode_reward",
    "episode_info",
    "episode_stats",
)
"""The fields the rollout writes onto each episode's row."""

SUMMARY_FIELDS = ("num_turns", "end_reason", "episode_info", "episode_stats")
"""What the train stage reads of each episode for its step's summary (:class:`EpisodeTally`)."""


def episode_columns(episodes: Sequence[Episode]) -> dict[str, Any]:
    """The columns of :data:`EPISODE_FIELDS`, one row per episode."""
    return {
        "response_ids": [e.token_ids.to(torch.int32) for e in episodes],
        "behaviour_logprobs": [e.logprobs.to(torch.float32) for e in episodes],
        "finish_reason": [e.finish_reason for e in episodes],
        "loss_mask": [e.loss_mask for e in episodes],
        "token_versions": [e.versions.to(torch.int32) for e in episodes],
        "turn_offsets": [e.turn_offsets.to(torch.int32) for e in episodes],
        "turn_rewards": [e.turn_rewards.to(torch.float32) for e in episodes],
        "num_turns": torch.tensor([e.num_turns for e in episodes], dtype=torch.int32),
        "end_reason": [e.end_reason for e in episodes],
        "episode_reward": torch.tensor([e.episode_reward for e in episodes], dtype=torch.float32),
        "episode_info": [dict(e.info) for e in episodes],
        "episode_stats": [dict(e.stats) for e in episodes],
    }


def single_turn_columns(gens: Sequence[Generation]) -> dict[str, Any]:
    """:func:`episode_columns` of one-turn responses (``Episode.single`` of each), built
    straight from the generations: the same values and dtypes without an :class:`Episode`
    per row (the rollout's hot path when no environment runs)."""
    n = len(gens)
    lens = torch.tensor([int(g.token_ids.numel()) for g in gens], dtype=torch.int64)
    offsets = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=offsets[1:])
    ones = torch.arange(n + 1, dtype=torch.int64)  # one element per row

    def joined(parts: list[torch.Tensor], dtype: torch.dtype) -> Ragged:
        # one concatenation and one conversion per column, not one tensor per row
        values = torch.cat(parts).to(dtype) if n else torch.empty(0, dtype=dtype)
        return Ragged(values, offsets)

    total = int(offsets[-1])
    return {
        "response_ids": joined([g.token_ids.reshape(-1) for g in gens], torch.int32),
        "behaviour_logprobs": joined([g.logprobs.reshape(-1) for g in gens], torch.float32),
        "finish_reason": [g.finish_reason for g in gens],
        "loss_mask": Ragged(torch.ones(total, dtype=torch.bool), offsets),
        "token_versions": joined([g.token_versions.reshape(-1) for g in gens], torch.int32),
        "turn_offsets": Ragged(torch.zeros(n, dtype=torch.int32), ones),
        "turn_rewards": Ragged(torch.full((n,), math.nan, dtype=torch.float32), ones),
        "num_turns": torch.ones(n, dtype=torch.int32),
        "end_reason": ["done" if g.finish_reason == "stop" else "max_tokens" for g in gens],
        "episode_reward": torch.full((n,), math.nan, dtype=torch.float32),
        "episode_info": [{} for _ in range(n)],
        "episode_stats": [{} for _ in range(n)],
    }


def failed_groups(cols: dict[str, Column], groups: np.ndarray) -> list[int]:
    """The groups (ids, sorted) with an episode whose environment failed (``env_error``):
    the train stage drops them whole."""
    reasons = cols["end_reason"]
    if not isinstance(reasons, list):
        raise TypeError("end_reason must be an object column")
    return sorted({int(g) for g, r in zip(groups.tolist(), reasons, strict=True) if r in FAILED})


class EpisodeTally:
    """The episodes of one train step, summed: what each step's record says of them.

    | key                      | what (over the step's episodes: trained, filtered, dropped) |
    |--------------------------|-------------------------------------------------------------|
    | ``turns_mean``           | model turns per episode                                     |
    | ``episode_end_reasons``  | episodes per end reason (those that occurred)               |
    | ``episode_end_rates``    | share of each end reason (every reason, 0 included)         |
    | ``env_retries``          | tries thrown away because the environment failed            |
    | ``env_failures``         | failed tries by cause (``engines.episodes.causes``)         |
    | ``agent_refused``        | requests the agent endpoint refused, by error code          |
    | ``env_counters``         | each numeric counter of the environment's ``info``, summed  |
    | ``tool_calls_per_episode``| ``tool_calls`` per episode, where the environment counts it|
    | ``env_latency_s``        | ``reset``/``step`` call latency: ``*_p50``, ``*_p99``       |
    | ``episode_wait_s``       | seconds per episode waiting on the ``engine`` / the ``env`` |

    The last four (and ``agent_refused``) only where the episodes had an environment (an
    agent) that reported them. :meth:`causes` names the top causes with a count and the first
    message of each (what a step that gives up on its dropped groups says).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._turns: list[int] = []
        self._reasons: dict[str, int] = {}
        self._counters: dict[str, float] = {}
        self._calls: dict[str, list[float]] = {"reset": [], "step": []}
        self._wait = {"engine": 0.0, "env": 0.0}
        self._retries = 0
        self._timed = 0
        self._failures: dict[str, int] = {}
        self._messages: dict[str, str] = {}
        self._refused: dict[str, int] = {}

    def add(self, cols: dict[str, Column]) -> None:
        """One micro-batch's :data:`SUMMARY_FIELDS` columns."""
        turns, reasons, infos = cols["num_turns"], cols["end_reason"], cols["episode_info"]
        stats = cols["episode_stats"]
        if not isinstance(turns, torch.Tensor) or not isinstance(reasons, list):
            raise TypeError("num_turns must be a dense column and end_reason an object column")
        if not isinstance(infos, list) or not isinstance(stats, list):
            raise TypeError("episode_info and episode_stats must be object columns")
        self._turns += [int(t) for t in turns.tolist()]
        for reason in reasons:
            self._reasons[str(reason)] = self._reasons.get(str(reason), 0) + 1
        for info in infos:
            for k, v in info.items():
                if isinstance(v, int | float):
                    self._counters[k] = self._counters.get(k, 0.0) + float(v)
        for st in stats:
            if not st:  # an episode no runner ran
                continue
            self._timed += 1
            self._calls["reset"] += st.get("reset_s", [])
            self._calls["step"] += st.get("step_s", [])
            self._wait["engine"] += float(st.get("engine_s", 0.0))
            self._wait["env"] += float(st.get("env_s", 0.0))
            self._retries += int(st.get("retries", 0))
            for cause, count in (st.get("failures") or {}).items():
                self._failures[cause] = self._failures.get(cause, 0) + int(count)
            for cause, message in (st.get("failure_messages") or {}).items():
                self._messages.setdefault(cause, str(message))
            for code, count in (st.get("refused") or {}).items():
                self._refused[code] = self._refused.get(code, 0) + int(count)

    def causes(self, n: int = 3) -> str:
        """The ``n`` most frequent causes of failed tries so far, each with its count and first
        message (``connection_refused x 24 (first: ...)``); empty when none failed."""
        return top_causes(self._failures, self._messages, n)

    def summary(self) -> dict[str, Any]:
        """The table above, of the episodes added since the last summary, which starts a new
        tally."""
        n = max(len(self._turns), 1)
        out: dict[str, Any] = {
            "turns_mean": sum(self._turns) / n,
            "episode_end_reasons": dict(sorted(self._reasons.items())),
            "episode_end_rates": {r: self._reasons.get(r, 0) / n for r in END_REASONS},
            "env_retries": self._retries,
            "env_failures": dict(sorted(self._failures.items())),
            "env_counters": dict(sorted(self._counters.items())),
        }
        if self._refused:
            out["agent_refused"] = dict(sorted(self._refused.items()))
        if "tool_calls" in self._counters:
            out["tool_calls_per_episode"] = self._counters["tool_calls"] / n
        latency = {}
        for call, values in self._calls.items():
            if values:
                latency[f"{call}_p50"] = float(np.percentile(values, 50))
                latency[f"{call}_p99"] = float(np.percentile(values, 99))
        if latency:
            out["env_latency_s"] = latency
        if self._timed:
            out["episode_wait_s"] = {k: v / self._timed for k, v in self._wait.items()}
        self._reset()
        return out


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over a batch's episodes (the rollout stage's metrics): ``turns_mean``, the share
    of each end reason (``end_reason/<reason>``), ``episode_reward`` (over those with a
    verdict), ``model_tokens_mean`` and the environment's own counters (``env/<name>``, per
    episode: only those it reported)."""
    n = max(len(episodes), 1)
    rewards = [e.episode_reward for e in episodes if not math.isnan(e.episode_reward)]
    out = {
        "turns_mean": sum(e.num_turns for e in episodes) / n,
        "episode_reward": sum(rewards) / len(rewards) if rewards else math.nan,
        "model_tokens_mean": sum(e.model_tokens for e in episodes) / n,
    }
    for reason in END_REASONS:
        out[f"end_reason/{reason}"] = sum(e.end_reason == reason for e in episodes) / n
    for key in sorted({k for e in episodes for k in e.info}):
        out[f"env/{key}"] = sum(e.info.get(key, 0.0) for e in episodes) / n
    return out


def rows_of(cols: dict[str, Column], names: Sequence[str], size: int) -> list[dict[str, Any]]:
    """Per row, the values of the columns ``names`` as plain Python values (an environment's
    ``reset`` reads them): objects as stored, dense rows as lists or scalars, ragged rows as
    lists."""
    rows: list[dict[str, Any]] = [{} for _ in range(size)]
    for name in names:
        col = cols[name]
        values: list[Any]
        if isinstance(col, list):
            values = col
        elif isinstance(col, Ragged):
            values = [t.tolist() for t in col.unbind()]
        else:
            values = col.tolist()
        for row, value in zip(rows, values, strict=True):
            row[name] = value
    return rows


async def run_episodes(
    runner: EpisodeSource,
    prompts: Sequence[torch.Tensor],
    rows: Sequence[dict[str, Any]],
    generate: BatchGenerate,
    params: SamplingParams,
    *,
    gather_s: float,
) -> list[Episode]:
    """Run one episode per prompt concurrently, their turns sent through ``generate`` (one
    engine instance) by a :class:`TurnBatcher`. The first error of ``generate`` cancels the
    other episodes and is raised as it is."""
    batcher = TurnBatcher(generate, gather_s=gather_s)

    async def one(prompt: torch.Tensor, row: dict[str, Any]) -> Episode:
        async with batcher.episode():
            return await runner.run(prompt, row, batcher.generate, params)

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(p, r)) for p, r in zip(prompts, rows, strict=True)]
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from None
    finally:
        await batcher.close()
    return [t.result() for t in tasks]
