"""What a step's record says of its episodes: the environment's own counters (only those it
returns), call latencies, engine vs environment wait, end-reason rates and retries."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

import torch

from adapters.episodes import EpisodeTally, episode_columns, failed_groups
from engines.envs import EnvError, StepResult
from engines.episodes import END_REASONS, EpisodeLimits, EpisodeRunner, TurnFormat
from engines.protocols import Generation, SamplingParams
from engines.tiny import build_tokenizer


class Cache:
    """No tools: counts its own ``hits`` and ``misses``; a ``broken`` row's server is gone."""

    def reset(self, row: Mapping[str, Any]) -> str:
        self.broken = bool(row["broken"])
        return "look up a key"

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(0.01)
        if self.broken:
            raise EnvError("the cache server is gone")
        return StepResult("ok", reward=1.0, done=True, info={"hits": 2, "misses": 1, "note": "x"})


async def _turn(prompt: torch.Tensor, params: SamplingParams) -> Generation:
    await asyncio.sleep(0.02)
    return Generation(torch.tensor([5, 6]), torch.tensor([-0.5, -0.5]), "stop", version=0)


def test_a_step_reports_what_its_environment_counts_and_how_its_time_went() -> None:
    runner = EpisodeRunner(Cache, TurnFormat(build_tokenizer()), EpisodeLimits(retries=1))
    rows = [{"broken": i == 3} for i in range(4)]

    async def main() -> list[Any]:
        prompt = torch.tensor([1, 2, 3])
        return await asyncio.gather(
            *(runner.run(prompt, row, _turn, SamplingParams(max_new_tokens=4)) for row in rows)
        )

    episodes = asyncio.run(main())
    runner.close()
    cols = episode_columns(episodes)
    assert failed_groups(cols, torch.tensor([0, 0, 1, 1]).numpy()) == [1]
    tally = EpisodeTally()
    tally.add(cols)
    s = tally.summary()
    assert s["env_counters"] == {"hits": 6.0, "misses": 3.0}  # the three that played; no text
    assert "tool_calls_per_episode" not in s  # it has no tools
    assert s["episode_end_reasons"] == {"done": 3, "env_error": 1}
    assert s["episode_end_rates"]["env_error"] == 0.25 and set(s["episode_end_rates"]) == set(
        END_REASONS
    )
    assert s["env_retries"] == 1  # the broken one was tried twice
    lat = s["env_latency_s"]
    assert (
        0.0 <= lat["reset_p50"] <= lat["reset_p99"] and 0.01 <= lat["step_p50"] <= lat["step_p99"]
    )
    wait = s["episode_wait_s"]
    assert wait["engine"] >= 0.02 and wait["env"] >= 0.01
    assert math.isnan(episodes[3].episode_reward) and episodes[0].episode_reward == 1.0
    assert tally.summary()["turns_mean"] == 0.0  # a summary starts a new tally
