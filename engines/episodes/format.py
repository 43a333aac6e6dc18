"""How an observation enters the token sequence between two model turns.

Tokens in, tokens out: the model's tokens are kept exactly as sampled (never decoded and
encoded again), and only the text the environment answers is encoded, wrapped in the tokens
the tokenizer's chat template puts around a message. The wrapper is read off the template
once, by rendering a conversation with placeholder contents::

    ... <|assistant|>\\n A <|eos|>\\n <|user|>\\n S <|eos|>\\n <|assistant|>\\n
                          \\_close__/ \\_open_____/   \\_after_______________/

so an observation is ``close + open + encode(text) + after``, where ``close`` loses the
end-of-turn token when the model's turn already ended with it (its EOS is one of the model's
own tokens, trained like the rest of the turn). The same wrapping follows an empty model turn
for the text an environment's ``reset`` returns. A tokenizer without a chat template gets
``"\\n" + text + "\\n"``.

An observation longer than ``max_tokens`` is cut to fit and ends with a marker (``...
[truncated]``), so one verbose tool answer cannot eat an episode's token budget.

Called by the episode runner (:mod:`engines.episodes.runner`) and the tiny model's warm start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (transformers loads where a tokenizer is built)
    from transformers import PreTrainedTokenizerBase

__all__ = ["TRUNCATION_MARKER", "TurnFormat"]

TRUNCATION_MARKER = " ... [truncated]"
"""Appended to an observation cut to its token budget."""

_USER, _ASSISTANT, _SLOT = "\x00u\x00", "\x00a\x00", "\x00s\x00"


class TurnFormat:
    """Observation tokens and action text for one tokenizer (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        role: the chat role observations are written as (``user`` works with every
            template; ``tool`` where the template supports it).
        chat_template: use the template (default: whenever the tokenizer has one), as
            :func:`engines.hf.text.encode_prompts` does for prompts.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        role: str = "user",
        chat_template: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.role = role
        eos = tokenizer.eos_token_id
        self.eos_token_id: int | None = None if eos is None else int(eos)
        use_chat = bool(tokenizer.chat_template) if chat_template is None else chat_template
        if use_chat:
            close, opening, after = self._split_template()
        else:
            close, opening, after = "", "\n", "\n"
        self._close = self.encode(close)
        self._open = self.encode(opening)
        self._after = self.encode(after)
        self._marker = self.encode(TRUNCATION_MARKER)

    def _split_template(self) -> tuple[str, str, str]:
        conv = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        base = self._render(conv, False)
        full = self._render([*conv, {"role": self.role, "content": _SLOT}], True)
        if not full.startswith(base) or _ASSISTANT not in base or _SLOT not in full[len(base) :]:
            raise ValueError(
                f"the chat template does not render a {self.role!r} message after an assistant "
                "turn as an extension of the conversation; pass chat_template=False or another "
                "role"
            )
        close = base[base.rindex(_ASSISTANT) + len(_ASSISTANT) :]
        rest = full[len(base) :]
        slot = rest.index(_SLOT)
        return close, rest[:slot], rest[slot + len(_SLOT) :]

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text: Any = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) gave {type(text).__name__}")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; special-token text maps to its id)."""
        if not text:
            return []
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, token_ids: Sequence[int]) -> str:
        """A model turn as the environment reads it (special tokens such as EOS removed)."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return text if isinstance(text, str) else "".join(text)

    def observation(
        self, text: str, *, after_eos: bool, max_tokens: int | None = None
    ) -> tuple[list[int], bool]:
        """The tokens that follow a model turn and show ``text``: ``(ids, truncated)``.

        ``after_eos``: the model's turn ended with the EOS token (then the template's own
        end-of-turn token is not repeated). ``max_tokens`` bounds the observation's own tokens
        (the wrapper's come on top); a longer one is cut and marked.
        """
        close = self._close
        if after_eos and close and close[0] == self.eos_token_id:
            close = close[1:]
        content = self.encode(text)
        truncated = max_tokens is not None and len(content) > max_tokens
        if truncated:
            assert max_tokens is not None
            keep = max(max_tokens - len(self._marker), 0)
            content = content[:keep] + self._marker[: max_tokens - keep]
        return [*close, *self._open, *content, *self._after], truncated
