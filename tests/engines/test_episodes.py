"""The turn loop: token layout, loss mask, per-token versions, bounds, environment failures.

A scripted engine writes given text per turn (through the real tiny tokenizer), so that each
test controls what the model says; the HF engine on the tiny model runs in the warm-start
test and in the workflow tests.
"""

from __future__ import annotations

import asyncio
import copy
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engines.envs import EnvError, StepResult, environment_factory
from engines.envs.tool_use import ToolUseTask
from engines.episodes import (
    TRUNCATION_MARKER,
    EpisodeLimits,
    EpisodeRunner,
    TurnBatcher,
    TurnFormat,
)
from engines.episodes.reference import reference_episode
from engines.hf import HFGenerationEngine, HFScoringEngine
from engines.hf.text import encode_prompts
from engines.protocols import Generation, SamplingParams
from engines.tiny import build_tokenizer

PARAMS = SamplingParams(max_new_tokens=32)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return build_tokenizer()


class ScriptedEngine:
    """Turn ``i`` of a conversation is ``script(conversation text, i)``, EOS-terminated,
    log-prob -0.5 per token, tagged with the engine's current version."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, script: Callable[[str, int], str]):
        self.tok = tokenizer
        self.script = script
        self.version = 0
        self.calls: list[list[torch.Tensor]] = []

    async def generate(
        self, prompts: Sequence[torch.Tensor], params: SamplingParams
    ) -> list[Generation]:
        self.calls.append(list(prompts))
        out = []
        for p in prompts:
            text = self.tok.decode(p.tolist())
            turn = text.count("<|assistant|>") - 1
            ids = [*self.tok(self.script(text, turn), add_special_tokens=False)["input_ids"]]
            ids.append(self.tok.eos_token_id)
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            n = len(ids)
            out.append(
                Generation(torch.tensor(ids), torch.full((n,), -0.5), finish, version=self.version)
            )
        self.version += 1  # a new version per call: turns of one episode differ
        return out


def run_one(
    runner: EpisodeRunner,
    engine: ScriptedEngine,
    tokenizer: PreTrainedTokenizerBase,
    row: Mapping[str, Any],
    prompt: str = "What is 37 * 48?",
    params: SamplingParams = PARAMS,
) -> Any:
    ids = encode_prompts(tokenizer, [prompt])[0]

    async def generate(p: torch.Tensor, sp: SamplingParams) -> Generation:
        return (await engine.generate([p], sp))[0]

    return asyncio.run(runner.run(ids, row, generate, params))


def solver(text: str, turn: int) -> str:
    return "<calc>37 * 48</calc>" if turn == 0 else "1776"


def test_tool_use_episode_layout(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = TurnFormat(tokenizer)
    runner = EpisodeRunner(environment_factory("tool_use"), fmt)
    engine = ScriptedEngine(tokenizer, solver)
    ep = run_one(runner, engine, tokenizer, {"answer": 1776})
    assert ep.end_reason == "done" and ep.num_turns == 2 and ep.episode_reward == 1.0
    assert ep.turn_rewards.tolist() == [0.0, 1.0] and ep.info == {"tool_calls": 1.0, "correct": 1.0}
    call = [*tokenizer("<calc>37 * 48</calc>", add_special_tokens=False)["input_ids"], 2]
    obs, _ = fmt.observation("1776", after_eos=True)
    answer = [*tokenizer("1776", add_special_tokens=False)["input_ids"], 2]
    assert ep.token_ids.tolist() == call + obs + answer
    assert tokenizer.decode(obs) == "\n<|user|>\n1776<|eos|>\n<|assistant|>\n"
    assert ep.loss_mask.tolist() == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    assert ep.turn_offsets.tolist() == [0, len(call) + len(obs)]
    # per-token versions: each turn its own call's version, -1 on the observation
    assert ep.versions.tolist() == [0] * len(call) + [-1] * len(obs) + [1] * len(answer)
    assert ep.version == 0  # the oldest token's
    assert ep.logprobs[ep.loss_mask].eq(-0.5).all() and ep.logprobs[~ep.loss_mask].eq(0).all()
    # turn 1 was asked to continue exactly the prompt + everything before it (prefix reuse)
    prompt = encode_prompts(tokenizer, ["What is 37 * 48?"])[0]
    assert engine.calls[1][0].tolist() == prompt.tolist() + call + obs


def test_warm_start_reference_matches_the_rollout_layout(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """What the warm start trains on is token for token what the runner records for the same
    turns: the model is taught the layout it will see."""
    item = ToolUseTask().item(7)
    factory = environment_factory("tool_use")
    ids, mask = reference_episode(item, factory, TurnFormat(tokenizer))
    runner = EpisodeRunner(factory, TurnFormat(tokenizer))
    turns = list(item.turns)
    engine = ScriptedEngine(tokenizer, lambda text, turn: turns[turn])
    ep = run_one(runner, engine, tokenizer, item.row(), prompt=str(item.prompt))
    assert ep.token_ids.tolist() == ids.tolist() and ep.loss_mask.tolist() == mask.tolist()
    assert ep.episode_reward == 1.0


def test_limits_end_episodes_with_their_reason(tokenizer: PreTrainedTokenizerBase) -> None:
    fmt = TurnFormat(tokenizer)
    caller = ScriptedEngine(tokenizer, lambda text, turn: "<calc>1 + 1</calc>")
    runner = EpisodeRunner(environment_factory("tool_use"), fmt, EpisodeLimits(max_turns=3))
    ep = run_one(runner, caller, tokenizer, {"answer": 5})
    assert ep.end_reason == "max_turns" and ep.num_turns == 3 and ep.episode_reward == 0.0
    assert ep.info["tool_calls"] == 3
    # the budget covers turns and observations; a turn is capped to what is left of it
    tight = EpisodeRunner(environment_factory("tool_use"), fmt, EpisodeLimits(max_tokens=30))
    caller.calls.clear()
    ep = run_one(tight, caller, tokenizer, {"answer": 5})
    assert ep.end_reason == "max_tokens" and len(ep.token_ids) <= 30
    assert ep.episode_reward == 0.0  # judged: out of budget is a failure, not "no verdict"
    assert ep.finish_reason == "length" and len(caller.calls) == 2  # turn 2 capped, cut


def test_long_observations_are_truncated_with_a_marker(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    fmt = TurnFormat(tokenizer)
    ids, truncated = fmt.observation("9" * 100, after_eos=True, max_tokens=16)
    assert truncated
    text = tokenizer.decode(ids)
    assert text.startswith("\n<|user|>\n9") and TRUNCATION_MARKER in text
    wrapper = fmt.observation("", after_eos=True)[0]
    assert len(ids) - len(wrapper) == 16  # the text's tokens: cut to the bound, marker included
    short, cut = fmt.observation("42", after_eos=False, max_tokens=16)
    assert not cut and tokenizer.decode(short) == "<|eos|>\n<|user|>\n42<|eos|>\n<|assistant|>\n"
    plain = TurnFormat(tokenizer, chat_template=False)
    assert tokenizer.decode(plain.observation("42", after_eos=True)[0]) == "\n42\n"


class FailingEnv:
    """Fails the way ``mode`` says: raise, hang (sync or async), or answer nonsense."""

    def __init__(self, mode: str, release: threading.Event) -> None:
        self.mode = mode
        self.release = release

    def reset(self, row: Mapping[str, Any]) -> None:
        if self.mode == "reset":
            raise RuntimeError("no such game")

    def step(self, action: str) -> Any:
        if self.mode == "raise":
            raise ValueError("tool crashed")
        if self.mode == "hang":
            self.release.wait(30)  # a stuck tool; abandoned after timeout_s
        if self.mode == "malformed":
            return {"observation": "not a StepResult"}
        if self.mode == "nan":
            return StepResult("x", reward=math.nan)
        return StepResult("ok")


class AsyncHangingEnv:
    def reset(self, row: Mapping[str, Any]) -> None:
        return None

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(30)
        return StepResult("late")


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("reset", "env_error"),
        ("raise", "env_error"),
        ("malformed", "env_error"),
        ("nan", "env_error"),
        ("hang", "env_error"),
        ("async-hang", "env_error"),
    ],
)
def test_environment_failures_end_the_episode_not_the_run(
    tokenizer: PreTrainedTokenizerBase, mode: str, reason: str
) -> None:
    """Every infrastructure failure (an exception, a call past its bound, a malformed answer)
    is retried on a fresh environment and, failing every try, ends ``env_error``: no verdict."""
    release = threading.Event()

    def factory() -> Any:
        return AsyncHangingEnv() if mode == "async-hang" else FailingEnv(mode, release)

    limits = EpisodeLimits(timeout_s=0.5, retries=1)
    runner = EpisodeRunner(factory, TurnFormat(tokenizer), limits)
    engine = ScriptedEngine(tokenizer, solver)
    t0 = time.monotonic()
    ep = run_one(runner, engine, tokenizer, {"answer": 1})
    assert time.monotonic() - t0 < 20  # bounded by timeout_s, not by the stuck call
    release.set()
    assert ep.end_reason == reason and ep.error
    assert math.isnan(ep.episode_reward)  # no verdict: not trained on
    assert ep.num_turns == (0 if mode == "reset" else 1)  # the last try's turns only
    assert ep.stats["retries"] == 1 and len(ep.stats["reset_s"]) == 2
    runner.close()


class FlakyEnv:
    """Its first ``fails`` instances fail as infrastructure (an explicit ``EnvError`` in
    ``step``); the later ones are a working ``tool_use`` environment. Counts the open ones."""

    built = 0
    open = 0
    most_open = 0

    def __init__(self, fails: int = 0, step_s: float = 0.0) -> None:
        cls = type(self)
        cls.built += 1
        cls.open += 1
        cls.most_open = max(cls.most_open, cls.open)
        self.broken = cls.built <= fails
        self.step_s = step_s
        self.inner = environment_factory("tool_use")()

    def reset(self, row: Mapping[str, Any]) -> Any:
        return self.inner.reset(row)

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(self.step_s)
        if self.broken:
            raise EnvError("the server closed the session")
        result = self.inner.step(action)
        assert isinstance(result, StepResult)
        return result

    def close(self) -> None:
        type(self).open -= 1


def test_an_infrastructure_failure_is_retried_from_the_start(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    FlakyEnv.built = FlakyEnv.open = 0
    runner = EpisodeRunner(lambda: FlakyEnv(fails=2), TurnFormat(tokenizer), EpisodeLimits())
    engine = ScriptedEngine(tokenizer, solver)
    ep = run_one(runner, engine, tokenizer, {"answer": 1776})
    assert FlakyEnv.built == 3 and FlakyEnv.open == 0  # three tries, each env closed
    assert ep.end_reason == "done" and ep.episode_reward == 1.0 and ep.error is None
    assert ep.num_turns == 2  # the last try's turns, not the failed ones'
    stats = ep.stats
    assert stats["retries"] == 2 and len(stats["reset_s"]) == 3 and len(stats["step_s"]) == 4
    assert stats["engine_s"] > 0 and stats["env_s"] >= sum(stats["reset_s"] + stats["step_s"])
    runner.close()


def test_a_timeout_is_the_policys_and_is_trained(tokenizer: PreTrainedTokenizerBase) -> None:
    """Past the episode's wall-clock budget the episode ends ``timeout`` with the configured
    return (a verdict: trained), never retried."""
    limits = EpisodeLimits(episode_timeout_s=0.05, timeout_reward=-0.5)
    runner = EpisodeRunner(environment_factory("tool_use"), TurnFormat(tokenizer), limits)
    engine = ScriptedEngine(tokenizer, solver)

    async def slow(p: torch.Tensor, sp: SamplingParams) -> Generation:
        await asyncio.sleep(0.1)  # a policy slower than the budget
        return (await engine.generate([p], sp))[0]

    ids = encode_prompts(tokenizer, ["What is 37 * 48?"])[0]
    ep = asyncio.run(runner.run(ids, {"answer": 1776}, slow, PARAMS))
    assert ep.end_reason == "timeout" and ep.episode_reward == -0.5 and ep.num_turns == 1
    assert ep.stats["retries"] == 0 and ep.stats["engine_s"] >= 0.1
    runner.close()


def test_max_concurrent_bounds_open_environments(tokenizer: PreTrainedTokenizerBase) -> None:
    FlakyEnv.built = FlakyEnv.open = FlakyEnv.most_open = 0
    limits = EpisodeLimits(max_concurrent=2)
    runner = EpisodeRunner(lambda: FlakyEnv(step_s=0.02), TurnFormat(tokenizer), limits)
    engine = ScriptedEngine(tokenizer, solver)
    ids = encode_prompts(tokenizer, ["What is 37 * 48?"])[0]

    async def generate(p: torch.Tensor, sp: SamplingParams) -> Generation:
        return (await engine.generate([p], sp))[0]

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(runner.run(ids, {"answer": 1776}, generate, PARAMS) for _ in range(6))
        )

    episodes = asyncio.run(main())
    assert all(e.end_reason == "done" for e in episodes) and FlakyEnv.built == 6
    assert FlakyEnv.most_open == 2 and FlakyEnv.open == 0
    runner.close()


def test_generation_errors_are_not_the_environments(tokenizer: PreTrainedTokenizerBase) -> None:
    runner = EpisodeRunner(environment_factory("tool_use"), TurnFormat(tokenizer))

    async def broken(p: torch.Tensor, sp: SamplingParams) -> Generation:
        raise ConnectionError("instance gone")

    prompt = encode_prompts(tokenizer, ["What is 1 * 1?"])[0]
    with pytest.raises(ConnectionError):
        asyncio.run(runner.run(prompt, {"answer": 1}, broken, PARAMS))


def test_one_turn_without_environment(tokenizer: PreTrainedTokenizerBase) -> None:
    runner = EpisodeRunner(None, TurnFormat(tokenizer))
    ep = run_one(runner, ScriptedEngine(tokenizer, lambda t, i: "7"), tokenizer, {})
    assert ep.num_turns == 1 and ep.end_reason == "done" and ep.loss_mask.all()
    assert math.isnan(ep.episode_reward)  # judged by the reward functions instead


def test_batcher_merges_turns_of_waiting_episodes(tokenizer: PreTrainedTokenizerBase) -> None:
    engine = ScriptedEngine(tokenizer, lambda t, i: "1")
    prompts = encode_prompts(tokenizer, ["a", "b", "c"])

    async def main(gather_s: float) -> TurnBatcher:
        batcher = TurnBatcher(engine.generate, gather_s=gather_s)

        async def one(p: torch.Tensor, delay: float, params: SamplingParams) -> Generation:
            async with batcher.episode():
                await asyncio.sleep(delay)
                return await batcher.generate(p, params)

        other = SamplingParams(max_new_tokens=2)
        gens = await asyncio.gather(
            one(prompts[0], 0, PARAMS), one(prompts[1], 0, PARAMS), one(prompts[2], 0, other)
        )
        assert [g.token_ids.numel() for g in gens] == [2, 2, 2]
        # a straggler: the first two wait for it (all running episodes waiting -> one call)
        await asyncio.gather(one(prompts[0], 0, PARAMS), one(prompts[1], 0.05, PARAMS))
        return batcher

    engine.calls.clear()
    batcher = asyncio.run(main(gather_s=10.0))
    # call 1 and 2: the two parameter sets of the first round; call 3: both of the second
    assert [len(c) for c in engine.calls] == [2, 1, 2] and batcher.turns == 5
    engine.calls.clear()
    asyncio.run(main(gather_s=0.0))  # no gathering: the straggler goes alone
    assert [len(c) for c in engine.calls] == [2, 1, 1, 1]


def test_batcher_raises_an_engine_error_in_every_turn_of_the_call(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    async def broken(ps: list[torch.Tensor], params: SamplingParams) -> list[Generation]:
        raise ConnectionError("gone")

    async def main() -> list[BaseException | Generation]:
        batcher = TurnBatcher(broken, gather_s=0.0)

        async def one() -> Generation:
            async with batcher.episode():
                return await batcher.generate(torch.tensor([1]), PARAMS)

        return await asyncio.gather(one(), one(), return_exceptions=True)

    assert all(isinstance(r, ConnectionError) for r in asyncio.run(main()))


STUCK = """
import asyncio, threading, torch
from engines.episodes import EpisodeLimits, EpisodeRunner, TurnFormat
from engines.protocols import Generation, SamplingParams
from engines.tiny import build_tokenizer

class Stuck:
    def reset(self, row):
        return None

    def step(self, action):
        threading.Event().wait()  # never returns

async def generate(prompt, params):
    return Generation(torch.tensor([5]), torch.tensor([-1.0]), "stop", version=0)

limits = EpisodeLimits(timeout_s=0.2, retries=0)
runner = EpisodeRunner(Stuck, TurnFormat(build_tokenizer()), limits)
episode = asyncio.run(runner.run(torch.tensor([1]), {}, generate, SamplingParams()))
print(episode.end_reason)
"""


def test_a_stuck_environment_call_does_not_keep_the_process_alive() -> None:
    """The episode ends at the bound, and the process exits although the call never returns
    (a pool that joins its threads at exit would hang here until the test's timeout)."""
    out = subprocess.run(
        [sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "env_error"


class Chatty:
    """An environment that always answers ``ok`` and never ends the episode."""

    def reset(self, row: Mapping[str, Any]) -> None:
        return None

    def step(self, action: str) -> StepResult:
        return StepResult(observation="ok")


def test_a_partial_update_inside_a_turn_keeps_its_tokens_with_their_versions(
    tiny_model: PreTrainedModel, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Partial rollouts within an episode (HF engine, ``partial=True``, the tiny model): an
    update lands in the middle of the first turn; that turn keeps its tokens, goes on with
    the new weights, and records both versions; the observation carries -1; the next turn is
    all new weights; the episode's version is its oldest model token's. Each model token's
    log-prob is that of the version recorded for it, given everything before it (the
    observation included)."""
    gen = HFGenerationEngine(copy.deepcopy(tiny_model), version=0, partial=True)
    new_model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    runner = EpisodeRunner(
        Chatty, TurnFormat(tiny_tokenizer), EpisodeLimits(max_turns=2, max_tokens=400)
    )
    prompt = encode_prompts(tiny_tokenizer, ["What is 12 * 7?"])[0]
    params = SamplingParams(max_new_tokens=64, temperature=0.8, seed=3)

    async def generate(p: torch.Tensor, sp: SamplingParams) -> Generation:
        return (await gen.generate([p], sp))[0]

    async def update_during_the_first_turn() -> Any:
        episode = asyncio.ensure_future(runner.run(prompt, {}, generate, params))
        while gen.tokens_decoded < 8:
            await asyncio.sleep(0.001)
        await gen.update_weights(new_model.state_dict(), 1)
        return await episode

    ep = asyncio.run(update_during_the_first_turn())
    gen.close()
    runner.close()
    assert ep.num_turns == 2
    second = int(ep.turn_offsets[1])
    first_turn = ep.versions[:second][ep.loss_mask[:second]]
    switch = int((first_turn == 0).sum())
    assert 8 <= switch < first_turn.numel()  # the update landed inside the first turn
    assert first_turn.tolist() == [0] * switch + [1] * (first_turn.numel() - switch)
    assert ep.versions[~ep.loss_mask].eq(-1).all() and (~ep.loss_mask).any()
    assert ep.versions[second:].eq(1).all()
    assert ep.version == 0
    assert gen.kept_tokens == switch
    old = HFScoringEngine(tiny_model, temperature=0.8).logprobs([prompt], [ep.token_ids])[0]
    new = HFScoringEngine(new_model, temperature=0.8).logprobs([prompt], [ep.token_ids])[0]
    for version, scored in ((0, old), (1, new)):
        at = ep.versions == version
        assert float((ep.logprobs[at] - scored[at]).abs().max()) < 1e-4
