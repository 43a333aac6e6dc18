"""Agents for the workflow tests, written as anyone writes one against the ``openai`` client.

They live in an importable module (not a test module) so that the rollout, wherever it runs,
imports them by path (``rollout.agent=tests.asyncflow.agents:check_twice``).
"""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

PREFIX = "Question: "
"""The agent's own wording of the row's prompt (the train stage must see it)."""


async def check_twice(row: dict[str, Any], client: AsyncOpenAI) -> float:
    """Ask, have the model check its answer once, reward 1 if the last answer has the number."""
    messages: list[Any] = [{"role": "user", "content": f"{PREFIX}{row['prompt']}"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message, {"role": "user", "content": "Are you sure?"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    return float(str(row["answer"]) in (reply.choices[0].message.content or ""))
