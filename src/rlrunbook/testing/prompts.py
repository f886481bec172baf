"""Chat prompts of clearly different lengths, as token ids, for the tiers that sample a real model (gpu, vllm):
a batch of them is padded unevenly, and a prompt is encoded once and never re-decoded (tokens are the truth)."""

from __future__ import annotations

QUESTIONS = (
    "Hi.",
    "What is 7 * 8?",
    "Name a colour of the sky.",
    "Write one short sentence about the sea at night.",
    "List three fruits that are red, and say which one you like best.",
    "Explain in two sentences why the moon shows phases as it goes around the earth.",
    "A train leaves at nine and arrives at eleven. How long is the trip, and what would change "
    "if it left at ten?",
    "Summarise this: the committee met on Monday, discussed the budget for the new library, "
    "could not agree on the size of the reading room, and decided to meet again next week "
    "after looking at three other designs.",
)


def chat_prompts(tokenizer: object, n: int = len(QUESTIONS)) -> list[list[int]]:
    """The first ``n`` questions as chat-formatted user turns (the tokenizer's template), as token ids."""
    if not 1 <= n <= len(QUESTIONS):
        raise ValueError(f"n={n}: there are {len(QUESTIONS)} questions")
    prompts = []
    for question in QUESTIONS[:n]:
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
    return prompts
