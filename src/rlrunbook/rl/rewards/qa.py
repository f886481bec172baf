"""Rewards for question answering: a numeric answer (arithmetic, GSM8K) or a short text answer (NQ-open).

The numeric reward reads the *last* number of the completion. Small models restate the question
before answering ("7 * 8 = 56"), so the first number is usually an operand: a first-number reward
scores every sample 0 and leaves GRPO with no spread (measured on SmolLM2-135M).
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from fractions import Fraction

from rlrunbook.rl.rewards.base import RewardResult

# A number as people write it: optional minus (ASCII or U+2212), optional "$", thousands groups
# of exactly three digits ("1,000" but not "1,0000"), optional decimals. A minus counts as a sign
# only after a non-word character, so "5-3" reads as 5 and 3, not 5 and -3; digits glued to a
# letter or a dot ("x2", the "2" of "v1.2") are not numbers.
NUMBER_PATTERN = r"(?:(?<![\w.)\]])([-\u2212]))?(?<![\w.])\$?(\d{1,3}(?:,\d{3})+(?!\d)|\d+)(\.\d+)?"
_NUMBER = re.compile(NUMBER_PATTERN)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, drop punctuation, drop a/an/the, collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` as a plain decimal string (``"-3"``, ``"1000"``, ``"2.50"``), or None.

    Thousands commas and a leading ``$`` are dropped; a sentence-final period is not a decimal
    point (``"is 5."`` gives ``"5"``).
    """
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    sign, digits, decimals = matches[-1].groups()
    return ("-" if sign else "") + digits.replace(",", "") + (decimals or "")


def qa_numeric_reward(completion: str, answers: Sequence[str] | str) -> RewardResult:
    """1.0 if the last number of ``completion`` equals an accepted answer as a number, else 0.0.

    Numbers compare exactly as fractions, so ``"2.50"`` matches ``"2.5"`` and ``"1,000"`` matches
    ``"1000"``. A bare str ``answers`` is one answer. Metrics: ``has_number`` (1.0 when the
    completion holds any number, so "wrong" and "no answer" can be told apart in the log).
    """
    answers = (answers,) if isinstance(answers, str) else answers
    found = extract_last_number(completion)
    if found is None:
        return RewardResult(0.0, {"has_number": 0.0})
    value = Fraction(found)
    correct = any(_as_number(a) == value for a in answers)
    return RewardResult(float(correct), {"has_number": 1.0})


def qa_text_reward(completion: str, answers: Sequence[str] | str) -> RewardResult:
    """1.0 if a normalised answer occurs in the normalised completion as whole words, else 0.0.

    This is the NQ-open "answer contained" criterion: ``"Paris"`` scores in ``"It is Paris."``
    but ``"1972"`` does not in ``"19720"``. Answers that normalise to nothing (``"the"``) never
    match. Metrics: ``exact_match`` (1.0 when the whole normalised completion equals an answer).
    """
    answers = (answers,) if isinstance(answers, str) else answers
    normalized = normalize_answer(completion)
    targets = [t for t in (normalize_answer(a) for a in answers) if t]
    padded = f" {normalized} "  # spaces on both sides turn substring search into whole-word search
    contained = any(f" {t} " in padded for t in targets)
    exact = any(t == normalized for t in targets)
    return RewardResult(float(contained), {"exact_match": float(exact)})


def _as_number(answer: str) -> Fraction | None:
    """An answer string as a number if the whole of it is one number, else None."""
    match = _NUMBER.fullmatch(answer.strip())
    if match is None:
        return None
    sign, digits, decimals = match.groups()
    return Fraction(("-" if sign else "") + digits.replace(",", "") + (decimals or ""))
