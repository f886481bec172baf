"""Tests of rlrunbook.rl.rewards: QA and summary rewards against hand-derived values.

The summary cases run on a real CNN/DailyMail article (the project's copy in ../shared/data; tests
marked ``data``) so the claim that degenerate summaries score below a reasonable one is checked where it
matters; ``test_synthetic_news.py`` checks the same claims on the generated articles everywhere.
"""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.errors import InputError
from rlrunbook.rl.data import load_cnn_dailymail
from rlrunbook.rl.rewards import (
    MIN_WORDS,
    RewardResult,
    compression_reward,
    extract_last_number,
    normalize_answer,
    qa_numeric_reward,
    qa_text_reward,
    rouge_reward,
)
from rlrunbook.testing.data import real_data_path


def test_reward_result_refuses_non_finite_rewards():
    assert RewardResult(0.5).metrics == {}
    for bad in (math.nan, math.inf):
        with pytest.raises(InputError, match="finite"):
            RewardResult(bad)


# ---- QA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("The  Eiffel Tower!", "eiffel tower"),
    ("A man, a plan, an apple", "man plan apple"),
    ("Theatre of the Absurd", "theatre of absurd"),  # articles only as whole words
    ("  U.S.A.  ", "usa"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("The result is -3", "-3"),
    ("it costs 1,000 dollars", "1000"),
    ("pay 2.50 now", "2.50"),
    ("That is $5.", "5"),  # a sentence-final period is not a decimal point
    ("a loss of -$5", "-5"),
    ("16 - 3 - 4 = 9", "9"),
    ("5-3", "3"),  # binary minus: 3, not -3
    ("(\u22123)", "-3"),  # U+2212 minus sign
    ("1, 2, and 3", "3"),
    ("it is 1,000,000.", "1000000"),
    ("version v1.2 of x2", None),  # digits glued to letters or dots are not numbers
    ("no numbers here", None),
    ("", None),
])
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(("completion", "answers", "reward", "has_number"), [
    ("7 * 8 = 56", ["56"], 1.0, 1.0),
    ("7 * 8 = 54", ["56"], 0.0, 1.0),
    # Small models restate the question: the first number is an operand; only the last one is the answer.
    ("37 + 48 = 85", ("85",), 1.0, 1.0),
    ("The answer is 85. Or maybe 84", ("85",), 0.0, 1.0),
    ("I am not sure.", ["56"], 0.0, 0.0),
    ("It costs 2.50", ["2.5"], 1.0, 1.0),
    ("Total: $1,000", ["1000"], 1.0, 1.0),
    ("Total: 1000", ["1,000"], 1.0, 1.0),
    ("The result is -3", ["-3"], 1.0, 1.0),
    ("The result is 3", ["-3"], 0.0, 1.0),
    ("so 18", "18", 1.0, 1.0),  # a bare str is one answer, not characters
    ("so 8", "18", 0.0, 1.0),
    ("It is 4", ["four", "4"], 1.0, 1.0),  # non-numeric answers are skipped, not errors
])
def test_qa_numeric_reward(completion, answers, reward, has_number):
    assert qa_numeric_reward(completion, answers) == RewardResult(reward, {"has_number": has_number})


@pytest.mark.parametrize(("completion", "answers", "reward", "exact"), [
    ("It was in December 1972.", ["14 December 1972 UTC", "December 1972"], 1.0, 0.0),
    ("December, 1972", ["December 1972"], 1.0, 1.0),
    ("The Bobby Scott", ["Bobby Scott", "Bob Russell"], 1.0, 1.0),  # articles and case normalised away
    ("in 19720", ["1972"], 0.0, 0.0),  # whole words only
    ("Bob", ["Bobby Scott"], 0.0, 0.0),
    ("the", ["the"], 0.0, 0.0),  # an answer that normalises to nothing never matches
    ("one season", "one", 1.0, 0.0),
    ("", ["x"], 0.0, 0.0),
])
def test_qa_text_reward(completion, answers, reward, exact):
    assert qa_text_reward(completion, answers) == RewardResult(reward, {"exact_match": exact})


# ---- compression -------------------------------------------------------------------------------

GREEK = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi."  # 16 words


def test_compression_reward_hand_values():
    # 4 words of 16: length 4/8, compression 1 - 4/16 = 0.75, all grounded, all distinct.
    r = compression_reward(GREEK, "Alpha, beta; gamma delta!")
    assert r.reward == pytest.approx(0.5 * 0.75 * 1.0 * 1.0)
    assert r.metrics == pytest.approx({"length_factor": 0.5, "compression": 0.75, "grounding": 1.0,
                                       "distinctness": 1.0, "summary_words": 4.0})
    # "alpha alpha beta zzz": grounding 3/4 (zzz is made up), distinctness 3/4 (alpha repeats).
    assert compression_reward(GREEK, "alpha alpha beta zzz").reward == pytest.approx(0.5 * 0.75 * 0.75 * 0.75)
    # 8 distinct grounded words of 16: length 1, compression 0.5.
    assert compression_reward(GREEK, " ".join(GREEK.split()[:MIN_WORDS])).reward == pytest.approx(0.5)


def test_compression_reward_empty_inputs_score_zero():
    assert compression_reward(GREEK, "").reward == 0.0
    assert compression_reward(GREEK, " ... !!! ").reward == 0.0  # no words at all
    assert compression_reward("", "alpha beta").reward == 0.0


@pytest.fixture(scope="module")
def cnn():
    return load_cnn_dailymail(real_data_path("cnn_dailymail"))


@pytest.mark.data("cnn_dailymail")
def test_compression_reward_ranks_a_real_extract_above_degenerate_summaries(cnn):
    document = cnn[0].document  # 551 words about Hillary Clinton's second "Scooby" van
    extract = ("Hillary Clinton's security detail arrived at a suburban Des Moines, Iowa fruit processing "
               "company with a second armored van.")
    assert len(extract.split()) == 19
    made_up = "The weather in Paris was lovely and sunny for the whole summer holiday season this year"
    degenerate = {
        "copy": compression_reward(document, document).reward,
        "empty": compression_reward(document, "").reward,
        "one word": compression_reward(document, "Clinton").reward,
        "spam": compression_reward(document, "Clinton " * 20).reward,
        "made up": compression_reward(document, made_up).reward,
    }
    assert degenerate["copy"] == 0.0 and degenerate["empty"] == 0.0
    assert degenerate["one word"] <= 1 / MIN_WORDS
    assert degenerate["spam"] <= 1 / 20
    good = compression_reward(document, extract).reward
    assert good > 0.9
    assert good > max(degenerate.values()) + 0.5, degenerate


@pytest.mark.data("cnn_dailymail")
def test_compression_reward_spreads_realistic_summaries(cnn):
    # The reference highlights are realistic summaries of varying quality: their rewards must differ,
    # or a GRPO group of such samples would have zero advantages.
    rewards = [compression_reward(r.document, r.highlights).reward for r in cnn]
    assert all(0.0 < x < 1.0 for x in rewards)
    assert statistics.pstdev(rewards) > 0.05
    assert len({round(x, 6) for x in rewards}) > 70


@settings(max_examples=200, deadline=None)
@given(document=st.text(max_size=300), summary=st.text(max_size=120))
def test_compression_reward_is_the_product_of_its_factors_in_unit_range(document, summary):
    r = compression_reward(document, summary)
    m = r.metrics
    assert 0.0 <= r.reward <= 1.0
    assert all(0.0 <= m[k] <= 1.0 for k in ("length_factor", "compression", "grounding", "distinctness"))
    product = m["length_factor"] * m["compression"] * m["grounding"] * m["distinctness"]
    assert r.reward == pytest.approx(product)


# ---- ROUGE -------------------------------------------------------------------------------------

def test_rouge_identical_and_disjoint():
    same = rouge_reward("The cat sat on the mat.", "The cat sat on the mat.")
    assert same == RewardResult(1.0, {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0})
    assert rouge_reward("dogs bark loudly", "the cat sat").reward == 0.0
    assert rouge_reward("", "the cat sat").reward == 0.0


def test_rouge_hand_values_and_stemming():
    # Summary "the cat sat" against "the cat sat on the mat": LCS 3, precision 3/3, recall 3/6,
    # F1 = 2 * 1 * 0.5 / 1.5 = 2/3; bigrams: 2 shared of 2 and 5 -> F1 = 2 * 1 * 0.4 / 1.4 = 4/7.
    r = rouge_reward("the cat sat", "the cat sat on the mat")
    assert r.reward == pytest.approx(2 / 3)
    assert r.metrics["rouge2"] == pytest.approx(4 / 7)
    assert rouge_reward("cats sitting", "cat sits").reward == pytest.approx(1.0)  # Porter: cat, sit
