"""OpenAI requests as token ids, and sampled tokens as OpenAI messages, for one tokenizer.

Token-in/token-out: a conversation that goes on from the session's last call is never
tokenized again as a whole. The model's own turn stays the token ids it sampled; only what
comes after it is encoded, read off the chat template by rendering the conversation with a
placeholder in place of the model's turn::

    <|user|>\\n What is 37 * 48? <|eos|>\\n <|assistant|>\\n  SLOT  <|eos|>\\n <|user|>\\n 1776 ...
    \\___ the previous call's prompt ids ___________________/       \\__ encoded: the suffix __/
                                              the sampled ids stand here

so the ids of the new prompt are ``previous ids + sampled ids + encode(suffix)``, where the
suffix loses its first token when it is the EOS the model already wrote (the same rule as
:class:`engines.episodes.TurnFormat`). ``/v1/completions`` does the same with text: a prompt
that starts with the previous prompt's text and the completion's text keeps their ids.

Tools (``tools=[...]`` of a chat request) go to the chat template as its ``tools`` argument
where the template reads them. A completion that contains ``<tool_call>{json}</tool_call>``
blocks (the format of the Hermes/Qwen templates) is answered with ``tool_calls``; any other
text is the message's ``content``, which the agent parses as it likes.

Called by the endpoint (:mod:`engines.agents.server`) for every request.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

__all__ = ["ChatCodec", "parse_tool_calls"]

_SLOT = "\x00slot\x00"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` of a completion: the ``<tool_call>{"name", "arguments"}``
    blocks as OpenAI tool calls, the rest as content (None when nothing is left)."""
    calls: list[dict[str, Any]] = []
    for m in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        args = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    rest = _TOOL_CALL.sub("", text).strip()
    return rest or None, calls


class ChatCodec:
    """Encodes requests and decodes completions (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_token_id: int | None = None if eos is None else int(eos)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, no special tokens added (special-token text maps to its id)."""
        if not text:
            return []
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text if isinstance(text, str) else "".join(text)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> str:
        """The conversation as the prompt text the model continues (generation prompt on)."""
        if not self.has_template:
            return "".join(f"{m.get('role')}: {_content(m)}\n" for m in messages) + "assistant: "
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = list(tools)
        text: Any = self.tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) gave {type(text).__name__}")
        return text

    def chat_ids(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None
    ) -> list[int]:
        """A whole conversation tokenized afresh (a session's first call)."""
        return self.encode(self.render(messages, tools))

    def chat_suffix(
        self,
        messages: Sequence[Mapping[str, Any]],
        model_turn: int,
        tools: Sequence[Any] | None,
        *,
        after_eos: bool,
    ) -> list[int] | None:
        """Ids of what follows the model's turn ``messages[model_turn]`` (its sampled ids are
        kept, see the module docstring); None when the template does not render that turn as
        one block the rest extends."""
        slotted = [dict(m) for m in messages]
        slotted[model_turn] = {"role": "assistant", "content": _SLOT}
        text = self.render(slotted, tools)
        if text.count(_SLOT) != 1:
            return None
        ids = self.encode(text[text.index(_SLOT) + len(_SLOT) :])
        if after_eos and ids and ids[0] == self.eos_token_id:
            ids = ids[1:]
        return ids


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)
