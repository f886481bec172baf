r"""A math answer checker: find the final answer in a completion and compare it with the reference.

Extraction order, first hit wins: the last well-formed ``\boxed{...}`` (nested braces allowed),
the text after the last ``####`` (GSM8K), the phrase after the last "answer is" / "answer:",
the last number (a simple fraction ``a/b`` counts as one number).

Comparison, fastest first:

1. Exact: when both sides parse as numbers they are compared exactly as fractions, so
   ``\frac{1}{2}``, ``1/2`` and ``0.5`` are equal but ``0.333`` and ``1/3`` are not, and that is
   the verdict. Units are not part of the value: ``$5``, ``5 \text{ cm}``, ``5^\circ`` and ``50%``
   read as 5 and 50 (GSM8K writes percentages as bare numbers, so ``50%`` equals ``50``, not ``0.5``).
2. String: equal after removing spacing and sizing commands.
3. Symbolic (math-verify, in a worker process with a timeout: :mod:`rlrunbook.rl.rewards.symbolic`):
   ``\sqrt{8}`` = ``2\sqrt{2}``, ``\pi/2`` = ``\frac{\pi}{2}``, ``x^2+2x+1`` = ``(x+1)^2``,
   ``\{1,2\}`` = ``\{2,1\}``, ``\sqrt 3`` = ``\sqrt{3}``. Decimals stay exact there too (``1.414``
   is not ``\sqrt{2}``). Only answers that look like mathematics go there: at most 500 characters
   and no run of two letters outside a LaTeX command (math-verify reads ``no`` as ``n*o``, equal to
   ``on``), so word answers compare as strings only. An answer whose comparison outlives the timeout
   (2 s by default, task option ``math_timeout_s``) scores 0 and is counted in ``symbolic_timeout``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.qa import NUMBER_PATTERN
from rlrunbook.rl.rewards.symbolic import DEFAULT_TIMEOUT_S, symbolic_equal

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
# The last-number fallback also takes "3/4" whole and a trailing "%".
_LAST_NUMBER = re.compile(NUMBER_PATTERN + r"(?:/\d+)?%?")
_LEADING_NUMBER = re.compile(r"[-\u2212]?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?%?")
_SPACING = re.compile(r"\\[!,;:> ]|\\q?quad|~|\\left|\\right|\s+")
_UNITS = re.compile(r"\\(?:text|textbf|mbox|mathrm)\s*\{[^{}]*\}|\^\s*\{?\\circ\}?|°")
_FRAC = re.compile(r"\\[dt]?frac(?:\{([^{}]*)\}|(\d))(?:\{([^{}]*)\}|(\d))")
_PLAIN = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{2,}")
_SYMBOLIC_MAX_CHARS = 500


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
        # ``\frac{}{}`` has empty groups: "" is no number (``"" or None`` would pass None on).
        num = parse_math_value(num_text if num_text is not None else num_digit)
        den = parse_math_value(den_text if den_text is not None else den_digit)
        return None if num is None or den is None or den == 0 else sign * num / den
    if s.count("/") == 1:
        num_text, den_text = s.split("/")
        num, den = _plain(num_text), _plain(den_text)
        return None if num is None or den is None or den == 0 else sign * num / den
    value = _plain(s)
    return None if value is None else sign * value


@dataclass(frozen=True)
class MathVerdict:
    """How two answers compared: ``equal``, and which step decided (``exact``, ``string``, ``symbolic``,
    ``timeout`` when the symbolic check was stopped, ``none`` when no step could tell them equal)."""

    equal: bool
    method: str


def compare_math_answers(pred: str | None, ref: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> MathVerdict:
    """Compare ``pred`` with ``ref``: exact numbers, then normalised strings, then symbolically (module docstring)."""
    if pred is None:
        return MathVerdict(False, "none")
    a, b = parse_math_value(pred), parse_math_value(ref)
    if a is not None and b is not None:
        return MathVerdict(a == b, "exact")
    normalized = _normalize_string(pred)
    if not normalized or not _normalize_string(ref):
        return MathVerdict(False, "none")  # an empty answer equals nothing, not even another empty one
    if normalized == _normalize_string(ref):
        return MathVerdict(True, "string")
    if not (_looks_symbolic(pred) and _looks_symbolic(ref)):
        return MathVerdict(False, "none")
    verdict = symbolic_equal(_unwrap(pred), _unwrap(ref), timeout_s)
    return MathVerdict(verdict.equal, "timeout" if verdict.timed_out else "symbolic")


def math_answers_equal(pred: str | None, ref: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``pred`` and ``ref`` are one answer (see :func:`compare_math_answers`)."""
    return compare_math_answers(pred, ref, timeout_s).equal


def math_reward(completion: str, reference: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> RewardResult:
    """1.0 if the answer extracted from ``completion`` equals ``reference`` (a final answer, not a solution).

    Metrics: ``extracted`` (1.0 when any answer was found, to tell "wrong" from "no answer"),
    ``symbolic`` (1.0 when only the symbolic check found the answers equal) and ``symbolic_timeout``
    (1.0 when that check was stopped at ``timeout_s``; the answer then scores 0).
    """
    extracted = extract_math_answer(completion)
    verdict = compare_math_answers(extracted, reference, timeout_s)
    return RewardResult(float(verdict.equal), {
        "extracted": float(extracted is not None),
        "symbolic": float(verdict.equal and verdict.method == "symbolic"),
        "symbolic_timeout": float(verdict.method == "timeout"),
    })


def _looks_symbolic(s: str) -> bool:
    """Short, and no two letters in a row outside LaTeX commands: mathematics, not a word answer."""
    return len(s) <= _SYMBOLIC_MAX_CHARS and bool(s.strip()) and not _WORD.search(_COMMAND.sub(" ", s))


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
