"""The OpenAI-compatible endpoint and the agent seam, with the real ``openai`` client, the real
aiohttp server on loopback and the HF engine on the tiny model: answers and errors, token-exact
sessions (the recorded ids are the engine's own, the loss mask only on them), per-token versions
across a weight update, budgets, history rewrites, agents that raise or hang."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

openai = pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

from engines.agents import AgentRunner, ChatCodec, OpenAIServer  # noqa: E402
from engines.episodes import Episode, EpisodeLimits  # noqa: E402
from engines.hf import HFGenerationEngine  # noqa: E402
from engines.protocols import Generation, SamplingParams  # noqa: E402
from transferqueue.aio import within  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


@pytest.fixture
def engine(tiny_dir: Path) -> HFGenerationEngine:
    return HFGenerationEngine(tiny_dir, seed=0, version=0)


class Recorder:
    """The ``generate`` of a session: the engine's own, every prompt and sample kept."""

    def __init__(self, engine: HFGenerationEngine) -> None:
        self.engine = engine
        self.prompts: list[torch.Tensor] = []
        self.gens: list[Generation] = []

    async def __call__(self, prompt: torch.Tensor, params: SamplingParams) -> Generation:
        [gen] = await self.engine.generate([prompt], params)
        self.prompts.append(prompt.clone())
        self.gens.append(gen)
        return gen


def run_agent(
    tokenizer: Any,
    engine: HFGenerationEngine,
    agent: Callable[[dict[str, Any], Any], Awaitable[float | None]],
    limits: EpisodeLimits | None = None,
) -> tuple[Episode, Recorder]:
    async def main() -> tuple[Episode, Recorder]:
        runner = AgentRunner(agent, tokenizer, limits or EpisodeLimits(max_tokens=200))
        rec = Recorder(engine)
        try:
            prompt = torch.tensor([1, 2, 3])
            ep = await runner.run(prompt, {"prompt": "What is 2 + 3?", "answer": 5}, rec, PARAMS)
        finally:
            await runner.aclose()
        return ep, rec

    return asyncio.run(within(main(), 60.0))


def test_openai_client_chat_completions_models_and_extension_fields(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    async def main() -> None:
        server = OpenAIServer(tiny_tokenizer, engine=engine, params=PARAMS, api_key="k")
        await server.start()
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url(), api_key="k", max_retries=0)
            models = await client.models.list()
            assert [m.id for m in models.data] == ["policy"]
            messages = [{"role": "user", "content": "What is 2 + 3?"}]
            chat = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=5, temperature=0.0
            )
            extra = chat.model_extra or {}
            choice = chat.choices[0]
            ids = choice.model_extra["token_ids"]
            assert extra["prompt_token_ids"] == ChatCodec(tiny_tokenizer).chat_ids(messages)
            assert 1 <= len(ids) <= 5 and chat.usage.completion_tokens == len(ids)
            assert len(choice.model_extra["token_logprobs"]) == len(ids)
            assert choice.model_extra["token_versions"] == [0] * len(ids)
            assert choice.message.content == tiny_tokenizer.decode(ids, skip_special_tokens=True)
            assert choice.finish_reason in ("stop", "length")
            # greedy: the same answer again
            again = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=5, temperature=0.0
            )
            assert again.choices[0].model_extra["token_ids"] == ids
            text = await client.completions.create(model="policy", prompt="1 + 1 =", max_tokens=4)
            assert text.choices[0].text == tiny_tokenizer.decode(
                text.choices[0].model_extra["token_ids"], skip_special_tokens=True
            )
            by_ids = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=3)
            assert by_ids.model_extra["prompt_token_ids"] == [5, 6, 7]
        finally:
            await server.close()

    asyncio.run(within(main(), 60.0))


def test_a_prompt_past_the_models_context_is_refused(
    tiny_tokenizer: Any, engine: HFGenerationEngine, tiny_dir: Path
) -> None:
    """The tiny model reads 512 positions: a prompt and the tokens asked for must fit in them,
    outside a session and on every call of one (its prompt grows by the episode's turns)."""
    context = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    assert context == 512

    async def main() -> None:
        server = OpenAIServer(tiny_tokenizer, engine=engine, params=PARAMS, context_tokens=context)
        await server.start()
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url(), api_key="-", max_retries=0)
            fits = await client.completions.create(model="policy", prompt=[5] * 509, max_tokens=3)
            assert fits.model_extra["prompt_token_ids"] == [5] * 509
            with pytest.raises(openai.BadRequestError) as over:  # one token too many
                await client.completions.create(model="policy", prompt=[5] * 510, max_tokens=3)
            assert over.value.code == "context_length_exceeded"
            assert "maximum context length is 512 tokens" in str(over.value)
            assert "513 tokens (510 in the messages, 3 in the completion)" in str(over.value)
            # without max_tokens the endpoint's default is asked for (PARAMS: 6 tokens)
            with pytest.raises(openai.BadRequestError) as default:
                await client.completions.create(model="policy", prompt=[5] * 507)
            assert default.value.code == "context_length_exceeded"
            text = "1 + 2 = 3, " * 120  # a chat prompt of about 700 tokens
            assert len(tiny_tokenizer(text)["input_ids"]) > 512
            with pytest.raises(openai.BadRequestError) as chat:
                await client.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": text}]
                )
            assert chat.value.code == "context_length_exceeded"

            # a session: its second call passes the context (the episode budget would allow it)
            rec = Recorder(engine)
            session = server.open_session(rec, PARAMS, EpisodeLimits(max_tokens=10_000))
            sc = openai.AsyncOpenAI(base_url=server.base_url(session), api_key="-", max_retries=0)
            first = await sc.completions.create(model="policy", prompt=[5] * 400)
            grown = (
                first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
            )
            with pytest.raises(openai.BadRequestError) as later:
                await sc.completions.create(model="policy", prompt=grown + [7] * 120)
            assert later.value.code == "context_length_exceeded"
            assert len(rec.gens) == 1 and session.end_reason == "max_tokens"
            # the server is still up
            ok = await client.completions.create(model="policy", prompt=[5, 6], max_tokens=2)
            assert ok.choices[0].model_extra["token_ids"]
        finally:
            await server.close()

    asyncio.run(within(main(), 60.0))


def test_bad_requests_get_openai_errors_and_the_server_stays_up(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    async def main() -> None:
        server = OpenAIServer(
            tiny_tokenizer, engine=engine, params=PARAMS, api_key="k", context_tokens=38
        )
        await server.start()
        try:
            client = openai.AsyncOpenAI(base_url=server.base_url(), api_key="k", max_retries=0)
            msgs = [{"role": "user", "content": "hi"}]
            with pytest.raises(openai.NotFoundError) as nf:
                await client.chat.completions.create(model="gpt-4o", messages=msgs)
            assert nf.value.code == "model_not_found"
            with pytest.raises(openai.AuthenticationError):
                bad = openai.AsyncOpenAI(base_url=server.base_url(), api_key="x", max_retries=0)
                await bad.chat.completions.create(model="policy", messages=msgs)
            long = [{"role": "user", "content": "1 + 2 " * 40}]
            with pytest.raises(openai.BadRequestError) as big:
                await client.chat.completions.create(model="policy", messages=long)
            assert big.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as st:
                await client.chat.completions.create(model="policy", messages=msgs, stream=True)
            assert st.value.code == "unsupported_value"
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="policy", messages=[])
            with pytest.raises(openai.BadRequestError):
                await client.completions.create(model="policy", prompt=[1, -2], max_tokens=3)
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="policy", messages=msgs, max_tokens=0)
            async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as http:
                async with http.post(server.url + "/v1/chat/completions", data=b"{nope") as r:
                    assert r.status == 400
                    assert (await r.json())["error"]["code"] == "invalid_json"
                async with http.get(server.url + "/v2/whatever") as r:
                    assert r.status == 404 and "error" in await r.json()
                async with http.post(server.url + "/sessions/nobody/v1/completions") as r:
                    assert r.status == 404
                    assert (await r.json())["error"]["code"] == "session_not_found"
            ok = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=2)
            assert ok.choices[0].model_extra["token_ids"]  # still serving
        finally:
            await server.close()

    asyncio.run(within(main(), 60.0))


def test_a_multi_call_session_records_exactly_the_sampled_tokens(
    tiny_tokenizer: Any, engine: HFGenerationEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole: list[int] = []  # conversations tokenized as a whole: the first call's only
    chat_ids = ChatCodec.chat_ids

    def counted(self: ChatCodec, *a: Any, **k: Any) -> list[int]:
        whole.append(1)
        return chat_ids(self, *a, **k)

    monkeypatch.setattr(ChatCodec, "chat_ids", counted)

    async def agent(row: dict[str, Any], client: Any) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for i in range(3):
            r = await client.chat.completions.create(model="policy", messages=messages)
            messages.append(r.choices[0].message)  # the answer as the client returns it
            messages.append({"role": "user", "content": f"tool says {i}"})
        return 0.5

    ep, rec = run_agent(tiny_tokenizer, engine, agent)
    assert ep.end_reason == "done" and ep.num_turns == 3 and ep.episode_reward == 0.5
    assert whole == [1]  # later calls kept the sampled ids, never re-encoded them
    sampled = torch.cat([g.token_ids for g in rec.gens])
    assert torch.equal(ep.token_ids[ep.loss_mask], sampled)  # token for token
    assert torch.equal(ep.logprobs[ep.loss_mask], torch.cat([g.logprobs for g in rec.gens]))
    assert bool((ep.versions[~ep.loss_mask] == -1).all())
    assert int(ep.loss_mask.sum()) == sum(int(g.token_ids.numel()) for g in rec.gens)
    # the episode's prompt is the first call's; every call's prompt is the trajectory so far
    assert ep.prompt_ids is not None and torch.equal(ep.prompt_ids, rec.prompts[0])
    full = torch.cat([ep.prompt_ids, ep.token_ids])
    for offset, prompt in zip(ep.turn_offsets.tolist(), rec.prompts, strict=True):
        assert torch.equal(prompt, full[: len(ep.prompt_ids) + offset])
    # what the agent added (the tool turns) is off the mask, and reads as the template has it
    added = tiny_tokenizer.decode(ep.token_ids[~ep.loss_mask].tolist())
    assert "tool says 0" in added and "tool says 1" in added


def test_completions_session_keeps_the_sampled_ids_of_a_text_prompt(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    async def agent(row: dict[str, Any], client: Any) -> None:
        text = "Q: 2 + 3 ="
        for _ in range(2):
            r = await client.completions.create(model="policy", prompt=text, max_tokens=4)
            text += r.choices[0].text + "\nQ: again ="

    ep, rec = run_agent(tiny_tokenizer, engine, agent)
    assert ep.num_turns == 2 and torch.equal(
        ep.token_ids[ep.loss_mask], torch.cat([g.token_ids for g in rec.gens])
    )
    assert ep.episode_reward != ep.episode_reward  # None: NaN, for the reward stage


def test_per_token_versions_across_a_weight_update_inside_a_session(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    state = {k: v.clone() for k, v in engine._model.state_dict().items()}

    async def agent(row: dict[str, Any], client: Any) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        assert r.choices[0].model_extra["token_versions"][0] == 0
        await engine.update_weights(state, 1)
        messages += [r.choices[0].message, {"role": "user", "content": "more"}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        assert set(r.choices[0].model_extra["token_versions"]) == {1}
        return 1.0

    ep, _ = run_agent(tiny_tokenizer, engine, agent)
    second = int(ep.turn_offsets[1])
    mask = ep.loss_mask
    assert set(ep.versions[:second][mask[:second]].tolist()) == {0}
    assert set(ep.versions[second:][mask[second:]].tolist()) == {1}
    assert ep.version == 0  # the oldest token: what the staleness bound is checked against


def test_a_history_rewrite_is_refused_and_the_trajectory_kept(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    codes: list[str | None] = []

    async def agent(row: dict[str, Any], client: Any) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        r = await client.chat.completions.create(model="policy", messages=messages)
        edited = [{"role": "user", "content": "Something else entirely"}, r.choices[0].message]
        try:
            await client.chat.completions.create(
                model="policy", messages=[*edited, {"role": "user", "content": "go on"}]
            )
        except openai.BadRequestError as e:
            codes.append(e.code)
        return 1.0

    ep, rec = run_agent(tiny_tokenizer, engine, agent)
    assert codes == ["history_rewritten"]
    assert ep.num_turns == 1 and len(rec.gens) == 1 and ep.end_reason == "done"
    assert torch.equal(ep.token_ids, rec.gens[0].token_ids)


def test_budgets_answer_the_agent_and_never_hang(
    tiny_tokenizer: Any, engine: HFGenerationEngine, caplog: pytest.LogCaptureFixture
) -> None:
    errors: list[str | None] = []

    async def agent(row: dict[str, Any], client: Any) -> float:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        for _ in range(5):
            try:
                r = await client.chat.completions.create(model="policy", messages=messages)
            except openai.BadRequestError as e:
                errors.append(e.code)
                break
            messages += [r.choices[0].message, {"role": "user", "content": "again"}]
        return 0.0

    ep, _ = run_agent(tiny_tokenizer, engine, agent, EpisodeLimits(max_turns=2, max_tokens=200))
    assert errors == ["turn_limit_exceeded"] and ep.num_turns == 2 and ep.end_reason == "max_turns"
    errors.clear()
    assert ep.stats["refused"] == {"turn_limit_exceeded": 1}  # counted in the step's record
    errors.clear()
    with caplog.at_level(logging.WARNING, logger="engines.agents.server"):
        ep, _ = run_agent(tiny_tokenizer, engine, agent, EpisodeLimits(max_turns=5, max_tokens=8))
    assert errors == ["context_length_exceeded"] and ep.end_reason == "max_tokens"
    assert int(ep.token_ids.numel()) <= 8
    assert ep.stats["refused"] == {"context_length_exceeded": 1}
    logged = [r.getMessage() for r in caplog.records if r.name == "engines.agents.server"]
    assert len(logged) == 2  # the first refusal of each code, at WARNING
    assert "refused a request (turn_limit_exceeded)" in logged[0]
    assert "refused a request (context_length_exceeded)" in logged[1] and "budget" in logged[1]


@pytest.mark.parametrize("how", ["raises", "hangs", "bad_reward"])
def test_an_agent_that_fails_ends_its_episode_only(
    tiny_tokenizer: Any, engine: HFGenerationEngine, how: str
) -> None:
    async def agent(row: dict[str, Any], client: Any) -> Any:
        messages = [{"role": "user", "content": row["prompt"]}]
        await client.chat.completions.create(model="policy", messages=messages)
        if how == "raises":
            raise KeyError("no such tool")
        if how == "hangs":
            await asyncio.sleep(60)
        return "yes"

    limits = EpisodeLimits(max_tokens=100, timeout_s=1.0, retries=1, timeout_reward=-0.5)
    ep, rec = run_agent(tiny_tokenizer, engine, agent, limits)
    if how == "hangs":  # the policy's failure: trained with the timeout reward, never retried
        assert ep.end_reason == "timeout" and ep.episode_reward == -0.5, ep.error
        assert len(rec.gens) == 1 and ep.stats["retries"] == 0
    else:  # infrastructure: tried again from the start, then no verdict (its group is dropped)
        assert ep.end_reason == "env_error" and ep.episode_reward != ep.episode_reward, ep.error
        assert len(rec.gens) == 2 and ep.stats["retries"] == 1
        # counted by cause, the first message of each kept for the step's record
        cause = "agent_raised" if how == "raises" else "protocol_error"
        assert ep.stats["failures"] == {cause: 2}
        words = "KeyError: 'no such tool'" if how == "raises" else "'yes', not a finite number"
        assert words in ep.stats["failure_messages"][cause]
    assert ep.num_turns == 1 and torch.equal(ep.token_ids, rec.gens[-1].token_ids)


def test_a_call_on_a_finished_session_is_refused(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    kept: list[Any] = []

    async def agent(row: dict[str, Any], client: Any) -> float:
        kept.append(client)
        return 1.0

    async def main() -> None:
        runner = AgentRunner(agent, tiny_tokenizer)
        try:
            await runner.run(torch.tensor([1]), {}, Recorder(engine), PARAMS)
            with pytest.raises(openai.BadRequestError) as e:
                await kept[0].completions.create(model="policy", prompt="x", max_tokens=2)
            assert e.value.code == "session_finished"
        finally:
            await runner.aclose()

    asyncio.run(within(main(), 60.0))


class ScriptedEngine:
    """A generation engine that writes a given text (then EOS) for every prompt, log-prob
    -0.5 per token: a model that calls a tool, for the tool-call path."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.ids = torch.tensor(ids, dtype=torch.int64)
        self.version = 0
        self.prompts: list[list[int]] = []

    async def generate(self, prompts: list[torch.Tensor], params: SamplingParams) -> list[Any]:
        self.prompts += [p.tolist() for p in prompts]
        n = int(self.ids.numel())
        return [Generation(self.ids, torch.full((n,), -0.5), "stop", self.version) for _ in prompts]


def test_tools_reach_the_chat_template_and_tool_calls_come_back(tiny_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (  # the tiny template, with the tools listed first
        "{% if tools %}TOOLS {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
        + tiny_tokenizer.chat_template
    )
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine(tokenizer, call)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def agent(row: dict[str, Any], client: Any) -> float:
        messages: list[Any] = [{"role": "user", "content": "2 + 3?"}]
        r = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        (tc,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and tc.function.name == "add"
        assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
        messages += [r.choices[0].message, {"role": "tool", "tool_call_id": tc.id, "content": "5"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        return 1.0

    async def main() -> Episode:
        runner = AgentRunner(agent, tokenizer, EpisodeLimits(max_tokens=200))

        async def generate(prompt: torch.Tensor, params: SamplingParams) -> Generation:
            return (await engine.generate([prompt], params))[0]

        try:
            return await runner.run(torch.tensor([1]), {}, generate, PARAMS)
        finally:
            await runner.aclose()

    ep = asyncio.run(within(main(), 60.0))
    assert ep.end_reason == "done" and ep.num_turns == 2, ep.error
    assert tokenizer.decode(engine.prompts[0]).startswith("TOOLS add")
    # the second prompt is the first, the model's call as sampled, then the tool's answer
    assert engine.prompts[1][: len(engine.prompts[0])] == engine.prompts[0]
    assert torch.equal(ep.token_ids[ep.loss_mask], torch.cat([engine.ids, engine.ids]))
    assert "5" in tokenizer.decode(ep.token_ids[~ep.loss_mask].tolist())


def test_the_simulated_agent_makes_the_environment_seams_episodes(
    tiny_tokenizer: Any, engine: HFGenerationEngine
) -> None:
    """The same environment through both seams, greedy: the same episodes, token for token."""
    from engines.envs import environment_factory
    from engines.episodes import EpisodeRunner, TurnFormat
    from engines.hf.text import encode_prompts
    from engines.simulated.agent import SimulatedAgent

    options = {"time_scale": 0.001, "observation_tokens": 6, "min_turns": 2, "max_turns": 3}
    limits = EpisodeLimits(max_turns=3, max_tokens=120, max_observation_tokens=16)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    env = EpisodeRunner(
        environment_factory("engines.simulated.environment:SimulatedEnvironment", options),
        TurnFormat(tiny_tokenizer),
        limits,
    )
    agents = AgentRunner(SimulatedAgent, tiny_tokenizer, limits, options=options)

    async def generate(prompt: torch.Tensor, params: SamplingParams) -> Generation:
        return (await engine.generate([prompt], params))[0]

    async def main() -> list[tuple[Episode, Episode]]:
        pairs = []
        try:
            for q in ("What is 2 + 3?", "Name a color.", "Count to three."):
                row = {"prompt": q}
                (prompt,) = encode_prompts(tiny_tokenizer, [q])
                a = await env.run(prompt, row, generate, greedy)
                b = await agents.run(prompt, row, generate, greedy)
                pairs.append((a, b))
        finally:
            env.close()
            await agents.aclose()
        return pairs

    for a, b in asyncio.run(within(main(), 60.0)):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.turn_offsets, b.turn_offsets) and a.num_turns >= 2
        assert a.end_reason == b.end_reason and a.episode_reward == b.episode_reward
