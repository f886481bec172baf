"""Prompts as tokens: the chat template rendered once, and the token pieces that splice turns together.

Debate injects an opponent's turn as its token ids; only the fixed framing around it (closing the
own turn, opening a user turn, closing it, opening the next assistant turn) is text, encoded once.
"""

from __future__ import annotations

from dataclasses import dataclass

_MARK = "\u2063RLRUNBOOK\u2063"  # a marker no template contains, to split rendered templates


def render_prompt(tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a conversation of one user turn, ready for the assistant's reply."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    plain = (f"{system}\n\n" if system else "") + f"{user}\n"
    return tokenizer.encode(plain, add_special_tokens=False)


@dataclass(frozen=True)
class TurnSplicer:
    """Token framing for inserting a user turn after an assistant turn.

    ``close_assistant`` ends an assistant turn that did not stop on its own (the eos token),
    ``open_user`` starts a user turn, ``close_user_open_assistant`` ends it and starts the reply.
    """

    close_assistant: list[int]
    open_user: list[int]
    close_user_open_assistant: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TurnSplicer:
        eos = tokenizer.eos_token
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A" + _MARK},
                        {"role": "user", "content": _MARK}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            _, after_answer, tail = text.split(_MARK)
            between = after_answer.removeprefix(eos)
            return cls(
                close_assistant=tokenizer.encode(eos, add_special_tokens=False),
                open_user=tokenizer.encode(between, add_special_tokens=False),
                close_user_open_assistant=tokenizer.encode(tail, add_special_tokens=False),
            )
        return cls(close_assistant=tokenizer.encode(eos, add_special_tokens=False),
                   open_user=tokenizer.encode("\n", add_special_tokens=False),
                   close_user_open_assistant=tokenizer.encode("\n", add_special_tokens=False))

    def inject_user_turn(self, own_completion: list[int], eos_ids: list[int], intro: list[int],
                         content: list[int], outro: list[int]) -> list[int]:
        """Tokens that follow ``own_completion``: close it if needed, then a user turn holding ``content``.

        ``content`` (an opponent's tokens) goes in as ids, never decoded and re-encoded; a trailing
        eos of the content is dropped so it does not end the user turn early.
        """
        closing = [] if own_completion and own_completion[-1] in eos_ids else list(self.close_assistant)
        body = content[:-1] if content and content[-1] in eos_ids else content
        return closing + self.open_user + intro + body + outro + self.close_user_open_assistant
