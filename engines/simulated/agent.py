"""The simulated environment driven as an agent: the same episodes through the OpenAI API.

:class:`SimulatedAgent` is an agent (:mod:`engines.agents`) that plays
:class:`engines.simulated.SimulatedEnvironment` itself, as an agent program would: it calls
the model with the ``openai`` client, hands the answer's text to the environment, and sends
the observation back as a user turn. With the same sampled tokens it makes the same episodes
as the environment seam (``env.name=engines.simulated.environment:SimulatedEnvironment``):
the same token ids, loss mask, turns and reward, the observations wrapped by the same chat
template. ``bench.rl``'s agentic workload compares the two seams with it (HTTP in the loop).

Options are the environment's (``rollout.agent_options``), plus ``model``.
"""

from __future__ import annotations

from typing import Any

from engines.simulated.environment import SimulatedEnvironment

__all__ = ["SimulatedAgent"]


class SimulatedAgent:
    """One episode's agent (see the module docstring)."""

    def __init__(self, *, model: str = "policy", **options: Any) -> None:
        self.env = SimulatedEnvironment(**options)
        self.model = model

    async def __call__(self, row: dict[str, Any], client: Any) -> float:
        import openai

        self.env.reset(row)
        messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
        while True:
            try:
                reply = await client.chat.completions.create(model=self.model, messages=messages)
            except openai.BadRequestError:  # the episode's turn or token budget is spent
                return 0.0
            text = reply.choices[0].message.content or ""
            result = await self.env.step(text)
            if result.done:
                return result.reward
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": result.observation or ""})
