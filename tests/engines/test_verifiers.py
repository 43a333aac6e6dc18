"""verifiers environments as agents (engines.agents.verifiers_env), with the real library: the
environment's own rollout calls the endpoint through its OpenAI client, its rubric scores, and
the episode holds exactly the tokens the engine sampled (tool results off the loss mask)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("verifiers", reason="the verifiers extra: pip install 'asyncflow[verifiers]'")
pytest.importorskip("aiohttp")

from engines.agents import AgentRunner
from engines.agents.verifiers_env import VerifiersTask, rollout_input
from engines.episodes import Episode, EpisodeLimits
from engines.hf import HFGenerationEngine
from engines.imports import MissingExtraError
from engines.protocols import Generation, SamplingParams
from engines.tasks import make_task
from transferqueue.aio import within

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
SINGLE = "verifiers:tests.asyncflow.vf_envs:single_turn"
TOOLS = "verifiers:tests.asyncflow.vf_envs:tool_env"


class Scripted:
    """The ``generate`` of a session writing the given texts (then EOS), one per call: a model
    that calls the tool, then answers."""

    def __init__(self, tokenizer: Any, texts: list[str]) -> None:
        eos = tokenizer.eos_token_id
        self.outputs = [
            torch.tensor(tokenizer(t, add_special_tokens=False)["input_ids"] + [eos]) for t in texts
        ]
        self.prompts: list[list[int]] = []

    async def __call__(self, prompt: torch.Tensor, params: SamplingParams) -> Generation:
        ids = self.outputs[len(self.prompts)]
        self.prompts.append(prompt.tolist())
        return Generation(ids, torch.full((len(ids),), -0.5), "stop", 0)


def run_episode(tokenizer: Any, agent: str, row: dict[str, Any], generate: Any) -> Episode:
    async def main() -> Episode:
        runner = AgentRunner(agent, tokenizer, EpisodeLimits(max_tokens=200, max_turns=4))
        try:
            return await runner.run(torch.tensor([1]), row, generate, PARAMS)
        finally:
            await runner.aclose()

    return asyncio.run(within(main(), 60.0))


def row_of(task_env: str, index: int = 0) -> dict[str, Any]:
    task = make_task("verifiers", environment=task_env)
    return task.item(index).row()


def test_the_task_serves_the_environments_dataset() -> None:
    task = make_task("verifiers", environment=SINGLE.removeprefix("verifiers:"), seed=3)
    assert isinstance(task, VerifiersTask)
    n = len(task.rows)
    first = [task.item(i).row() for i in range(n)]
    assert sorted(r["example_id"] for r in first) == list(range(n))  # each row once per epoch
    assert [task.item(i).row() for i in range(n)] == first  # the same for the same index
    row = first[0]
    assert row["prompt"][0] == {"role": "system", "content": "Answer with the number."}
    assert row["prompt"][-1]["role"] == "user" and row["answer"].isdigit()
    assert "info" not in rollout_input(row) and "task" not in rollout_input(row)


def test_a_tool_env_rollout_records_the_sampled_tokens_and_scores_with_its_rubric(
    tiny_tokenizer: Any,
) -> None:
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    gen = Scripted(tiny_tokenizer, [call, "5"])
    row = {**row_of(TOOLS.removeprefix("verifiers:")), "answer": "5"}
    ep = run_episode(tiny_tokenizer, TOOLS, row, gen)
    assert ep.end_reason == "done" and ep.num_turns == 2, ep.error
    # the second call's prompt extends the first: the model's call as sampled, then the tool's
    # result, which only the tool env's own loop could have added
    assert gen.prompts[1][: len(gen.prompts[0])] == gen.prompts[0]
    assert torch.equal(ep.token_ids[ep.loss_mask], torch.cat(gen.outputs))
    added = tiny_tokenizer.decode(ep.token_ids[~ep.loss_mask].tolist())
    assert "tool" in added and "5" in added
    # the rubric's reward: correct (1.0) + 0.5 * short (1 / (1 + len("5"))) + the tool's
    # result right (1.0)
    assert ep.episode_reward == pytest.approx(2.25)


def test_a_single_turn_env_on_the_tiny_model(tiny_tokenizer: Any, tiny_dir: Path) -> None:
    engine = HFGenerationEngine(tiny_dir, seed=0, version=0)
    sampled: list[Generation] = []

    async def generate(prompt: torch.Tensor, params: SamplingParams) -> Generation:
        [g] = await engine.generate([prompt], params)
        sampled.append(g)
        return g

    ep = run_episode(tiny_tokenizer, SINGLE, row_of(SINGLE.removeprefix("verifiers:")), generate)
    assert ep.num_turns == 1 and len(sampled) == 1, ep.error
    assert torch.equal(ep.token_ids, sampled[0].token_ids)
    assert bool(ep.loss_mask.all())
    text = tiny_tokenizer.decode(sampled[0].token_ids.tolist(), skip_special_tokens=True)
    assert ep.episode_reward == pytest.approx(0.5 / (1 + len(text.strip())), rel=0.2)


def test_a_missing_extra_names_the_pip_install(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'asyncflow\[verifiers\]'"):
        AgentRunner("verifiers:some_env", tiny_tokenizer)


def test_an_infrastructure_error_of_the_environment_is_env_error(tiny_tokenizer: Any) -> None:
    """verifiers' InfraError (a sandbox down) is not the policy's: the episode ends
    ``env_error`` (tried again, then its group refilled) instead of taking the rubric's 0."""
    import verifiers as vf

    from engines.agents import verifiers_env

    env = verifiers_env.load_environment("tests.asyncflow.vf_envs:tool_env")

    async def setup_state(state: Any) -> Any:
        raise vf.SandboxError("the sandbox did not start")

    gen = Scripted(tiny_tokenizer, ["5"])
    row = row_of(TOOLS.removeprefix("verifiers:"))
    original = env.setup_state
    env.setup_state = setup_state
    try:
        ep = run_episode(tiny_tokenizer, TOOLS, row, gen)
    finally:
        env.setup_state = original
    assert ep.end_reason == "env_error" and "SandboxError" in (ep.error or ""), ep.error
