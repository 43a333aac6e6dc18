"""Agents: programs that own the loop and call the model through an OpenAI-compatible endpoint.

| module                              | what                                                 |
|-------------------------------------|------------------------------------------------------|
| :mod:`engines.agents.server`        | :class:`OpenAIServer`: ``/v1/chat/completions``,     |
|                                     | ``/v1/completions``, ``/v1/models`` from engines,    |
|                                     | token ids, log-probs and versions in every answer    |
| :mod:`engines.agents.session`       | :class:`Session`: one episode's calls as one         |
|                                     | trajectory, budgets, refused history rewrites        |
| :mod:`engines.agents.codec`         | :class:`ChatCodec`: messages to ids, keeping the     |
|                                     | model's sampled ids (token-in/token-out)             |
| :mod:`engines.agents.runner`        | :class:`AgentRunner`: the agent seam                 |
|                                     | (``rollout.agent=module:attribute``)                 |
| :mod:`engines.agents.verifiers_env` | verifiers environments as agents                     |
|                                     | (``rollout.agent=verifiers:...``, task ``verifiers``)|

aiohttp and openai (the ``agents`` extra) are imported when a server starts or a runner is
built, verifiers (the ``verifiers`` extra) when its environment is loaded, so this package
imports without them. Nothing here knows TransferQueue.
"""

from engines.agents.codec import ChatCodec, parse_tool_calls
from engines.agents.runner import Agent, AgentRunner, agent_factory
from engines.agents.server import OpenAIServer
from engines.agents.session import APIError, Session

__all__ = [
    "APIError",
    "Agent",
    "AgentRunner",
    "ChatCodec",
    "OpenAIServer",
    "Session",
    "agent_factory",
    "parse_tool_calls",
]
