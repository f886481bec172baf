r"""The multi-signal RLVR reward: ``reward = α·verify + β·format + γ·reflect``, each signal 0 or 1.

After the single-H100 RLVR run notes (α=1.0, β=0.5, γ=0.5). The three signals, for a task whose
final answers follow an :class:`AnswerForm` (``BOXED`` for ``math``, ``TRAILING_NUMBER`` for ``qa``):

``verify``
    The task's own correctness: the math checker (``math_reward``) or the numeric answer match
    (``qa_numeric_reward``, without its format bonus). Computed by the task and passed in.

``format``
    The final answer is given in the task's final-answer form, exactly once as one answer:

    * ``BOXED`` (math): at least one well-formed, non-empty ``\boxed{...}``, and every boxed
      answer in the completion equals the last one (``math_answers_equal``). Two different boxed
      answers, an empty ``\boxed{}`` or an unclosed brace score 0; a bare "the answer is 5" scores 0.
    * ``TRAILING_NUMBER`` (qa, whose prompt says "End with the final answer"): the completion,
      stripped of whitespace and closing punctuation (``. ! ) ] * "``), ends with a number.

``reflect``
    An explicit self-check of the final answer, detected conservatively: there is a final
    answer ``A`` (the form's parser over the whole completion), and some verification cue
    (a word of the check / verify family, case-insensitive: "check", "checking", "checked",
    "double-check", "recheck", "verify", "verifying", "verified", "verification") such that
    the text *before* the cue already states ``A`` (the parser applied to that prefix) and the
    text *after* the cue states ``A`` again (the parser applied to that suffix). In words:
    answer, check, same answer.

    Limits: it sees the form of a check, not its substance: "5. Check: 5." scores 1 and a real
    verification phrased without a cue word ("Substituting back, 3·4 = 12 ✓") scores 0. A check
    that ends on another number (qa: "check: 12 / 3 = 4") scores 0 because the last number after
    the cue is what the parser reads. It does not require the answer to be right (that is
    ``verify``'s job), so a model can collect γ by restating a wrong answer; keep γ ≤ α.

Not normalised: the reward lies in ``[0, α+β+γ]`` (2.0 with the notes' weights), the notes' formula
as written, so GRPO's group-centred advantages keep its scale. With α = β+γ a correct answer
with neither format nor check ties a wrong one with both; raise α to break the tie. A validation
threshold meant as "correct" should read the ``verify`` metric, not the total.

Metrics: ``verify``, ``format``, ``reflect`` (0.0 / 1.0) and ``extracted`` (1.0 when any final answer
was found).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from rlrunbook.errors import ConfigError
from rlrunbook.rl.rewards.base import RewardResult
from rlrunbook.rl.rewards.math import extract_math_answer, math_answers_equal
from rlrunbook.rl.rewards.qa import NUMBER_PATTERN, extract_last_number

SIGNALS = ("verify", "format", "reflect")

_CUE = re.compile(r"\b(?:double[- ]?check(?:s|ed|ing)?|re-?check(?:s|ed|ing)?|check(?:s|ed|ing)?"
                  r"|verif(?:y|ies|ied|ying|ication))\b", re.IGNORECASE)
_BOXED_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(NUMBER_PATTERN)
_CLOSING = " \t\r\n.!)]*\"'"


@dataclass(frozen=True)
class SignalWeights:
    """α, β, γ of the multi-signal reward (``reward.verify_weight`` / ``format_weight`` / ``reflect_weight``)."""

    verify: float = 1.0
    format: float = 0.5
    reflect: float = 0.5

    def __post_init__(self) -> None:
        for name in SIGNALS:
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"reward.{name}_weight={value!r} must be >= 0. Use e.g. 1.0 / 0.5 / 0.5.")

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> SignalWeights:
        """The weights a task received in its ``options`` (``verify_weight`` ...), defaults where absent."""
        return cls(**{name: float(options.get(f"{name}_weight", getattr(cls, name))) for name in SIGNALS})


@dataclass(frozen=True)
class AnswerForm:
    """How one task writes final answers: ``extract`` the final answer, compare two with ``same``,
    and judge ``formatted`` (the completion gives its answer in the expected form)."""

    name: str
    extract: Callable[[str], str | None]
    same: Callable[[str, str], bool]
    formatted: Callable[[str], bool]


def _boxed_contents(text: str) -> list[str | None]:
    """Every ``\\boxed{...}``'s content in order; None for an empty or unclosed one."""
    contents: list[str | None] = []
    for match in _BOXED_START.finditer(text):
        depth, content = 0, None
        for i in range(match.end() - 1, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                content = text[match.end():i].strip() or None
                break
        contents.append(content)
    return contents


def _boxed_formatted(text: str) -> bool:
    contents = _boxed_contents(text)
    if not contents or any(c is None for c in contents):
        return False
    last = contents[-1]
    return all(math_answers_equal(c, last) for c in contents)


def _same_number(a: str, b: str) -> bool:
    return Fraction(a) == Fraction(b)


def _ends_with_number(text: str) -> bool:
    stripped = text.rstrip(_CLOSING)
    matches = list(_NUMBER.finditer(stripped))
    return bool(matches) and matches[-1].end() == len(stripped)


BOXED = AnswerForm("boxed", extract_math_answer, math_answers_equal, _boxed_formatted)
TRAILING_NUMBER = AnswerForm("trailing_number", extract_last_number, _same_number, _ends_with_number)


def format_signal(text: str, form: AnswerForm) -> float:
    """1.0 when ``text`` gives its final answer in ``form`` (see the module docstring), else 0.0."""
    return float(form.formatted(text))


def reflect_signal(text: str, form: AnswerForm) -> float:
    """1.0 for "answer, verification cue, same answer" (see the module docstring), else 0.0."""
    final = form.extract(text)
    if final is None:
        return 0.0
    for cue in _CUE.finditer(text):
        before, after = form.extract(text[:cue.start()]), form.extract(text[cue.end():])
        if before is not None and after is not None and form.same(before, final) and form.same(after, final):
            return 1.0
    return 0.0


def multi_signal_reward(text: str, verified: bool, form: AnswerForm, weights: SignalWeights) -> RewardResult:
    """``α·verify + β·format + γ·reflect`` of ``text``; ``verified`` is the task's correctness verdict."""
    signals = {"verify": float(verified), "format": format_signal(text, form), "reflect": reflect_signal(text, form)}
    reward = sum(getattr(weights, name) * signals[name] for name in SIGNALS)
    return RewardResult(reward, {**signals, "extracted": float(form.extract(text) is not None)})
