"""Text to token ids and back, the way the HF engines and the tiny model expect them.

Called by examples, tests and adapters that start from prompt text, and by
:func:`engines.tiny.warm_start`, so that a warm-started model sees prompts encoded exactly as
the rollout will encode them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

__all__ = ["decode_responses", "encode_prompts"]


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    chat_template: bool | None = None,
) -> list[torch.Tensor]:
    """One 1-D int64 tensor per prompt text.

    With ``chat_template`` (default: whenever the tokenizer has one) each text becomes a single
    user turn followed by the assistant header, so generation continues as the assistant.
    Otherwise the text is encoded with the tokenizer's special tokens (e.g. BOS).
    """
    use_chat = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if use_chat and not tokenizer.chat_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    out: list[torch.Tensor] = []
    for text in texts:
        if use_chat:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        else:
            ids = tokenizer(text)["input_ids"]
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
