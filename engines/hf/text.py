"""Text to token ids and back, the way the HF engines and the tiny model expect them.

Called by examples, tests and adapters that start from prompt text, and by
:func:`engines.tiny.warm_start`, so that a warm-started model sees prompts encoded exactly as
the rollout will encode them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (transformers loads where a tokenizer is built)
    from transformers import PreTrainedTokenizerBase

__all__ = ["decode_responses", "encode_prompts"]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str | Sequence[Mapping[str, str]]],
    *,
    chat_template: bool | None = None,
) -> list[torch.Tensor]:
    """One 1-D int64 tensor per prompt: a text, or chat messages (role/content dicts).

    With ``chat_template`` (default: whenever the tokenizer has one) a text becomes a single
    user turn, messages are rendered as they are, and the assistant header follows, so
    generation continues as the assistant. Without it a text is encoded with the tokenizer's
    special tokens (e.g. BOS), and messages as their contents joined by blank lines.
    """
    use_chat = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if use_chat and not tokenizer.chat_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    out: list[torch.Tensor] = []
    for text in texts:
        if isinstance(text, str):
            messages = [{"role": "user", "content": text}]
        else:
            messages = [{"role": m["role"], "content": m["content"]} for m in text]
        if use_chat:
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            joined = text if isinstance(text, str) else "\n\n".join(m["content"] for m in text)
            ids = tokenizer(joined)["input_ids"]
        out.append(torch.tensor(list(ids), dtype=torch.long))
    return out


def decode_responses(
    tokenizer: PreTrainedTokenizerBase,
    responses: Sequence[torch.Tensor],
    *,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Decode response token ids (special tokens such as EOS dropped by default)."""
    out: list[str] = []
    for response in responses:
        text = tokenizer.decode(response.tolist(), skip_special_tokens=skip_special_tokens)
        out.append(text if isinstance(text, str) else "".join(text))
    return out
