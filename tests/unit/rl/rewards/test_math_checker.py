r"""Tests of rlrunbook.rl.rewards.math: answer extraction, parsing, equality and the math reward.

Decisions pinned here (see the module docstring): percent signs are units, so ``50%`` equals ``50``
(GSM8K writes percentages as bare numbers) and not ``0.5``; numbers compare exactly, so ``0.333``
is not ``1/3``; what does not parse as a number compares as a normalised string, then symbolically
(``test_math_symbolic.py`` holds the symbolic pairs).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlrunbook.rl.data import load_gsm8k
from rlrunbook.rl.rewards import (
    RewardResult,
    extract_math_answer,
    math_answers_equal,
    math_reward,
    parse_math_value,
)
from rlrunbook.testing.data import real_data_path

EQUALITY = [
    # (pred, ref, equal)
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    ("1,000", "1000", True),
    ("$5", "5", True),
    (r"\$5.00", "5", True),
    ("50%", "50", True),  # percent is a unit: GSM8K answers are bare numbers
    (r"50\%", "50", True),
    ("50%", "0.5", False),
    ("3/4", "0.75", True),
    (r"\dfrac{3}{4}", "0.75", True),
    (r"\tfrac{3}{4}", "3/4", True),
    (r"\frac34", "0.75", True),  # LaTeX shorthand with one-digit arguments
    (r"-\frac{1}{2}", "-0.5", True),
    (r"\frac{-1}{2}", "-1/2", True),
    (r"\boxed{\boxed{5}}", "5", True),  # nested boxes
    ("x = 5", "5", True),
    (r"\left( \frac{1}{2} \right)", "0.5", True),
    ("(7)", "7", True),
    (r"$\frac{1}{2}$", "1/2", True),
    (r"5 \text{ cm}", "5", True),
    (r"90^\circ", "90", True),
    (r"10{,}000", "10000", True),  # LaTeX's {,} separator: not a number here, but math-verify reads it
    ("5.", "5", True),
    ("0.50", ".5", True),
    ("+3", "3", True),
    ("\u22123", "-3", True),  # U+2212 minus
    ("1,234,567.5", "1234567.5", True),
    ("0.333", "1/3", False),  # exact comparison, no tolerance
    ("4", "5", False),
    ("-5", "5", False),
    ("1/0", "0", False),  # not a number: compared as strings
    ("1,00", "100", False),  # not a thousands grouping
    (r"\sqrt{2}", r"\sqrt{2}", True),  # not numbers: normalised string equality
    (r"\sqrt{2}", r"\sqrt{3}", False),
    (r"\dfrac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}", True),
    (r"\left[ 1, 2 \right]", "[1,2]", True),
    (r"\text{Evelyn}", "Evelyn", True),
    (r"x^2 + 1.", "x^2+1", True),
    (r"\pi", "3.14159", False),
    (None, "5", False),
]


@pytest.mark.parametrize(("pred", "ref", "expected"), EQUALITY)
def test_math_answers_equal(pred, ref, expected):
    assert math_answers_equal(pred, ref) is expected
    if pred is not None:
        assert math_answers_equal(ref, pred) is expected  # the check is symmetric


@pytest.mark.parametrize(("text", "expected"), [
    (r"So the result is \boxed{\frac{\sqrt{3}}{2}}.", r"\frac{\sqrt{3}}{2}"),
    (r"First \boxed{3}, then corrected: \boxed{4}", "4"),  # the last box
    (r"\boxed{\boxed{5}}", "5"),  # the inner box is the last one to open
    (r"\boxed{1} and an unclosed \boxed{2", "1"),  # a box that never closes is skipped
    (r"\boxed 7.", "7"),
    (r"\boxed{} but 12 anyway", "12"),  # an empty box is no answer
    ("She makes $18.\n#### 18", "18"),
    ("work\n#### 1,000\nextra line", "1,000"),
    ("The answer is 18 dollars.", "18"),
    (r"The answer is: $\frac{1}{2}$ cup.", r"$\frac{1}{2}$"),
    ("Final answer: 3, because 1 + 2 = 3.", "3"),
    ("The answer is x = 5.", "x = 5"),
    ("7 * 8 = 56", "56"),
    ("half is 3/4 of it", "3/4"),
    ("it rose 50%", "50%"),
    ("no answer here", None),
    ("", None),
])
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


@pytest.mark.parametrize(("completion", "reference", "reward", "extracted"), [
    (r"The area is \boxed{\dfrac{3}{4}}.", "0.75", 1.0, 1.0),
    ("Janet makes 9 * 2 = 18 dollars.\n#### 18", "18", 1.0, 1.0),
    ("The answer is 17.", "18", 0.0, 1.0),
    ("I cannot tell.", "18", 0.0, 0.0),
    ("so the total is $1,000", "1000", 1.0, 1.0),
])
def test_math_reward(completion, reference, reward, extracted):
    assert math_reward(completion, reference) == RewardResult(
        reward, {"extracted": extracted, "symbolic": 0.0, "symbolic_timeout": 0.0})


# ---- round trips -------------------------------------------------------------------------------

fractions = st.builds(Fraction, st.integers(-10**6, 10**6), st.integers(1, 10**4))


@settings(max_examples=300, deadline=None)
@given(value=fractions)
def test_parse_round_trips_fraction_renderings(value):
    a, b = value.numerator, value.denominator
    sign = "-" if a < 0 else ""
    renderings = [f"{a}/{b}", rf"\frac{{{a}}}{{{b}}}", rf"{sign}\dfrac{{{abs(a)}}}{{{b}}}",
                  rf"$\boxed{{{sign}\tfrac{{{abs(a)}}}{{{b}}}}}$", rf"\left( {a}/{b} \right)"]
    for text in renderings:
        assert parse_math_value(text) == value, text


@settings(max_examples=300, deadline=None)
@given(whole=st.integers(-10**9, 10**9), places=st.integers(0, 6), digits=st.integers(0, 999_999))
def test_parse_round_trips_decimals_and_thousands(whole, places, digits):
    fraction_part = str(digits).zfill(6)[:places]
    sign = "-" if whole < 0 else ""
    text = f"{sign}{abs(whole):,}" + (f".{fraction_part}" if places else "")
    expected = Fraction(f"{sign}{abs(whole)}" + (f".{fraction_part}" if places else ""))
    assert parse_math_value(text) == expected
    assert parse_math_value(text.replace(",", "")) == expected
    assert parse_math_value(f"{sign}${abs(whole):,}") == abs(whole) * (-1 if sign else 1)
    assert math_answers_equal(rf"\boxed{{{text}}}", text.replace(",", ""))


@settings(max_examples=200, deadline=None)
@given(value=fractions)
def test_a_different_value_is_never_equal(value):
    assert not math_answers_equal(str(value), str(value + Fraction(1, 10**5)))


# ---- the real GSM8K solutions ------------------------------------------------------------------

@pytest.mark.data("gsm8k")
def test_gsm8k_reference_solutions_score_full_reward_against_their_answers():
    records = load_gsm8k(real_data_path("gsm8k"))
    failures = [r.id for r in records if math_reward(r.solution, r.answers[0]).reward != 1.0]
    assert failures == []
    # Every reference answer is a plain number the checker parses.
    assert all(parse_math_value(r.answers[0]) is not None for r in records)
    # Hand-checked rows: Janet's eggs (#### 18) and line 147 (#### 2,125), as a model might write them.
    assert math_reward(r"She makes \boxed{18} dollars", records[0].answers[0]).reward == 1.0
    assert math_reward("The answer is 2,125.", records[146].answers[0]).reward == 1.0


_LATEX_CHARS = "0123456789.,-+$%/\\{}()[]=^ \n#:boxedfracltighnswr\u2212"
_LATEXISH = st.text(alphabet=st.sampled_from(list(_LATEX_CHARS)), max_size=60)


@settings(max_examples=500, deadline=None)
@example(completion=r"\boxed{\frac{}{}}", reference="2")  # once raised: an empty \frac group became None
@given(completion=_LATEXISH, reference=_LATEXISH)
def test_the_checker_never_raises_on_arbitrary_text(completion, reference):
    # A reward runs on whatever the policy wrote: malformed LaTeX must score, not crash the step.
    result = math_reward(completion, reference)
    assert result.reward in (0.0, 1.0) and result.metrics["extracted"] in (0.0, 1.0)
    value = parse_math_value(completion)
    assert value is None or isinstance(value, Fraction)
