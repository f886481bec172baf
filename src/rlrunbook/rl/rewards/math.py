r"""A math answer checker: find the final answer in a completion and compare it with the reference.

Extraction order, first hit wins: the last well-formed ``\boxed{...}`` (nested braces allowed),
the text after the last ``####`` (GSM8K), the phrase after the last "answer is" / "answer:",
the last number (a simple fraction ``a/b`` counts as one number).

Comparison: when both sides parse as numbers they are compared exactly as fractions, so
``\frac{1}{2}``, ``1/2`` and ``0.5`` are equal but ``0.333`` and ``1/3`` are not. Units are not
part of the value: ``$5``, ``5 \text{ cm}``, ``5^\circ`` and ``50%`` read as 5 and 50 (GSM8K
writes percentages as bare numbers, so ``50%`` equals ``50``, not ``0.5``). Otherwise the two
strings are compared after removing spacing and sizing commands. Not handled (they compare as
strings): radicals, pi, mixed numbers, intervals, matrices and symbolic equivalence.
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.qa import NUMBER_PATTERN

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
# The last-number fallback also takes "3/4" whole and a trailing "%".
_LAST_NUMBER = re.compile(NUMBER_PATTERN + r"(?:/\d+)?%?")
_LEADING_NUMBER = re.compile(r"[-\u2212]?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?%?")
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad|~|\\left|\\right|\s+")
_UNITS = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{[^{}]*\}|\^\s*\{?\\circ\}?|°")
_FRAC = re.compile(r"\\[dt]?frac(?:\{([^{}]*)\}|(\d))(?:\{([^{}]*)\}|(\d))")
_PLAIN = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+")


def extract_math_answer(text: str) -> str | None:
    r"""The final answer written in ``text`` (see the module docstring for the order), or None."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        final = text.rsplit("####", 1)[1].strip().splitlines()
        if final and final[0].strip():
            return final[0].strip()
    said = list(_ANSWER_IS.finditer(text))
    if said:
        phrase = _answer_phrase(text[said[-1].end():])
        if phrase:
            return phrase
    numbers = list(_LAST_NUMBER.finditer(text))
    return numbers[-1].group(0) if numbers else None


def parse_math_value(s: str) -> Fraction | None:
    r"""``s`` as an exact number, or None when it is not a plain number.

    Accepts integers, decimals, thousands commas, a leading ``$`` / ``\$``, a trailing ``%``,
    ``a/b``, ``\frac{a}{b}`` / ``\dfrac`` / ``\tfrac`` / ``\frac12``, signs, ``\left( \right)`` and
    outer parentheses, surrounding ``$...$`` and ``\boxed{}``, units in ``\text{...}``, and
    ``x = 5`` (the part after the last ``=``).
    """
    s = _unwrap(s)
    s = _UNITS.sub("", s)
    s = _SPACING.sub("", s).replace("\\$", "").replace("$", "").replace("\\%", "").rstrip("%")
    s = s.rsplit("=", 1)[-1].replace("\u2212", "-").rstrip(".")
    while len(s) > 2 and s[0] + s[-1] in ("()", "{}") and _balanced(s[1:-1]):
        s = s[1:-1]
    sign = 1
    if s[:1] in ("-", "+"):
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    frac = _FRAC.fullmatch(s)
    if frac is not None:
        num_text, num_digit, den_text, den_digit = frac.groups()
        num, den = parse_math_value(num_text or num_digit), parse_math_value(den_text or den_digit)
        return None if num is None or den is None or den == 0 else sign * num / den
    if s.count("/") == 1:
        num_text, den_text = s.split("/")
        num, den = _plain(num_text), _plain(den_text)
        return None if num is None or den is None or den == 0 else sign * num / den
    value = _plain(s)
    return None if value is None else sign * value


def math_answers_equal(pred: str | None, ref: str) -> bool:
    """Whether ``pred`` and ``ref`` are one answer: numerically if both parse, else as normalised strings."""
    if pred is None:
        return False
    a, b = parse_math_value(pred), parse_math_value(ref)
    if a is not None and b is not None:
        return a == b
    return _normalize_string(pred) == _normalize_string(ref)


def math_reward(completion: str, reference: str) -> RewardResult:
    """1.0 if the answer extracted from ``completion`` equals ``reference`` (a final answer, not a solution).

    Metrics: ``extracted`` (1.0 when any answer was found, to tell "wrong" from "no answer").
    """
    extracted = extract_math_answer(completion)
    correct = extracted is not None and math_answers_equal(extracted, reference)
    return RewardResult(float(correct), {"extracted": float(extracted is not None)})


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` with balanced braces and something inside."""
    for match in reversed(list(_BOXED.finditer(text))):
        start = match.end()
        if text[start:start + 1] == "{":
            content = _braced(text, start)
        else:  # "\boxed 5": the argument is the next token
            content = text[start:].split()[0].rstrip("$.") if text[start:].strip() else None
        if content and content.strip():
            return content.strip()
    return None


def _braced(text: str, start: int) -> str | None:
    """The text inside the braces opening at ``text[start]``, or None if they never close."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return None


def _answer_phrase(rest: str) -> str:
    """The answer after "answer is": a leading ``$...$`` or number, else the rest of the sentence."""
    rest = rest.split("\n", 1)[0].strip()
    if rest.startswith("$") and rest.count("$") >= 2:
        return rest[: rest.index("$", 1) + 1]
    number = _LEADING_NUMBER.match(rest)
    if number is not None:
        return number.group(0)
    return re.split(r"\.(?:\s|$)", rest, maxsplit=1)[0].strip()


def _unwrap(s: str) -> str:
    """Strip surrounding ``$...$``, ``\\(...\\)``, ``\\[...\\]`` and ``\\boxed{...}``, repeatedly."""
    s = s.strip()
    while True:
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$").strip()
        elif s[:2] in ("\\(", "\\[") and s[-2:] in ("\\)", "\\]"):
            s = s[2:-2].strip()
        elif (boxed := _BOXED.match(s)) and s[boxed.end():boxed.end() + 1] == "{":
            inner = _braced(s, boxed.end())
            # Only a box around the whole string is a wrapper: "\boxed{1}+\boxed{2}" is not one answer.
            if inner is None or boxed.end() + len(inner) + 2 != len(s):
                return s
            s = inner.strip()
        else:
            return s


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"(": 1, "{": 1, ")": -1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _plain(s: str) -> Fraction | None:
    return Fraction(s.replace(",", "")) if _PLAIN.fullmatch(s) else None


def _normalize_string(s: str) -> str:
    r"""Without spacing, sizing, delimiters, ``\text{}`` wrappers, a final period; ``\dfrac`` as ``\frac``."""
    s = _unwrap(s)
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\s*\{([^{}]*)\}", r"\1", s)
    s = _SPACING.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")
