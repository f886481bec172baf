"""Tests of rlrunbook.rl.evaluation.passk: pass@k (Chen et al. 2021, eq. 1), mean@k, best-of-k, bootstrap CIs.

Expected values are derived by hand in comments, and every estimator is checked against an
independent brute force that enumerates all k-subsets of the n samples (hypothesis, n <= 8).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction
from statistics import fmean

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.rl.evaluation.passk import (
    EvalSummary,
    bootstrap_ci,
    expected_max_at_k,
    mean_at_k,
    pass_at_k,
    pass_at_k_dataset,
    summarize_eval,
)


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    """Share of the k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def brute_subset_stat(rewards: list[float], k: int, stat) -> float:
    return fmean(stat(s) for s in itertools.combinations(rewards, k))


samples = st.lists(st.booleans(), min_size=1, max_size=8)
reward_lists = st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=7)


def test_hand_derived_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # c/n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 4) == 1.0  # n - c = 3 < k: every 4-subset holds a correct one
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)  # 1 - C(9,5)/C(10,5) = 1 - 126/252


def test_stable_for_large_n():
    # The binomials of n=2000 overflow a float (C(2000, 1000) ~ 1e600); the product form does not.
    exact = 1 - Fraction(math.comb(1990, 1000), math.comb(2000, 1000))
    assert pass_at_k(2000, 10, 1000) == pytest.approx(float(exact), rel=1e-12)
    assert 0.0 < pass_at_k(2000, 1, 1) < 1e-3


@given(samples, st.data())
def test_pass_at_k_matches_enumeration(correct, data):
    k = data.draw(st.integers(1, len(correct)))
    assert pass_at_k(len(correct), sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


@given(st.integers(1, 40), st.data())
def test_monotone_in_k_and_c(n, data):
    c, k = data.draw(st.integers(0, n)), data.draw(st.integers(1, n))
    by_k = [pass_at_k(n, c, kk) for kk in range(1, n + 1)]
    by_c = [pass_at_k(n, cc, k) for cc in range(n + 1)]
    for series in (by_k, by_c):
        assert all(0.0 <= v <= 1.0 for v in series)
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(series))


@given(reward_lists, st.data())
def test_mean_and_best_of_k_match_enumeration(rewards, data):
    k = data.draw(st.integers(1, len(rewards)))
    # mean@k does not depend on k: the mean of a random k-subset has the sample mean as expectation.
    assert mean_at_k([rewards], k) == pytest.approx(brute_subset_stat(rewards, k, fmean), abs=1e-9)
    assert expected_max_at_k(rewards, k) == pytest.approx(brute_subset_stat(rewards, k, max), abs=1e-9)


@given(samples, st.data())
def test_best_of_k_of_binary_rewards_is_pass_at_k(correct, data):
    k = data.draw(st.integers(1, len(correct)))
    assert expected_max_at_k([float(x) for x in correct], k) == pytest.approx(
        pass_at_k(len(correct), sum(correct), k), abs=1e-12)


def test_dataset_averages_problems_of_different_sizes():
    # (pass@2 of 1/4 correct = 1 - C(3,2)/C(4,2) = 1/2) and (0/2 correct = 0) -> 1/4.
    assert pass_at_k_dataset([[True, False, False, False], [False, False]], 2) == pytest.approx(0.25)
    assert mean_at_k([[1.0, 0.0], [0.5, 0.5, 0.5]], 2) == pytest.approx(0.5)  # (0.5 + 0.5) / 2


def test_summarize_eval_hand_example():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.1, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    summary = summarize_eval(rewards, ks=(4, 1, 2), resamples=500)
    assert isinstance(summary, EvalSummary)
    assert (summary.num_problems, summary.samples_per_problem) == (3, 4)
    # per-problem means 0.5, 0.025, 1.0; 0.1 < threshold 1.0 does not pass.
    assert summary.mean_reward == pytest.approx(1.525 / 3)
    assert list(summary.pass_at) == [1, 2, 4]
    assert summary.pass_at[1] == pytest.approx((0.5 + 0 + 1) / 3)
    assert summary.pass_at[2] == pytest.approx((5 / 6 + 0 + 1) / 3)  # 1 - C(2,2)/C(4,2) = 5/6
    assert summary.pass_at[4] == pytest.approx(2 / 3)
    assert summary.mean_at == {1: summary.mean_reward, 2: summary.mean_reward, 4: summary.mean_reward}
    for k, (low, high) in summary.pass_ci.items():
        assert low <= summary.pass_at[k] <= high
    assert summary.to_dict()["pass@2"] == summary.pass_at[2]
    # A lower threshold lets the 0.1 pass: problem 1 now has pass@1 = 1/4.
    assert summarize_eval(rewards, ks=(1,), threshold=0.1).pass_at[1] == pytest.approx((0.5 + 0.25 + 1) / 3)


def test_bootstrap_contains_estimate_narrows_and_is_deterministic():
    rng = np.random.default_rng(1)
    small, large = rng.random(20), rng.random(2000)
    for values in (small, large):
        low, high = bootstrap_ci(values)
        assert low < values.mean() < high
    width = [high - low for low, high in (bootstrap_ci(small), bootstrap_ci(large))]
    assert width[1] < width[0] / 5  # ~ 1/sqrt(100) of the width
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    assert bootstrap_ci(small, seed=3) != bootstrap_ci(small, seed=4)
    assert bootstrap_ci([0.25]) == (0.25, 0.25)
    narrow, wide = bootstrap_ci(small, confidence=0.5), bootstrap_ci(small, confidence=0.99)
    assert wide[0] < narrow[0] < narrow[1] < wide[1]


def test_bootstrap_chunks_agree_with_one_draw(monkeypatch):
    from rlrunbook.rl.evaluation import passk

    values = np.random.default_rng(0).random(51)
    whole = bootstrap_ci(values, resamples=300)
    monkeypatch.setattr(passk, "_BOOTSTRAP_CHUNK_ENTRIES", 51 * 7)  # 7 resamples (an odd 357 draws) per chunk
    # Same generator stream consumed in row order: chunking changes memory, not the result.
    assert bootstrap_ci(values, resamples=300) == whole


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: pass_at_k(5, 2, 6), ConfigError, ["k=6", "5 samples"]),
        (lambda: pass_at_k(5, 6, 1), InputError, ["c=6", "n=5"]),
        (lambda: pass_at_k(-1, 0, 1), InputError, ["n=-1"]),
        (lambda: pass_at_k(5, -2, 1), InputError, ["c=-2"]),
        (lambda: pass_at_k(5, 2, 0), ConfigError, ["k=0"]),
        (lambda: pass_at_k(5, 2, True), ConfigError, ["k=True"]),
        (lambda: mean_at_k([[1.0, 0.0], [1.0]], 2), ConfigError, ["k=2", "1 samples"]),
        (lambda: pass_at_k_dataset([], 1), InputError, ["empty"]),
        (lambda: summarize_eval([[1.0, 0.0]] * 3, ks=(1, 4, 8)), ConfigError, ["[4, 8]", "2 samples"]),
        (lambda: summarize_eval([[1.0, 0.0], [1.0]], ks=[1]), InputError, ["problem 1 has 1", "0 has 2"]),
        (lambda: summarize_eval([[1.0, float("nan")]], ks=(1,)), InputError, ["NaN", "index 1"]),
        (lambda: summarize_eval([[1.0]], ks=()), ConfigError, ["ks is empty"]),
        (lambda: bootstrap_ci([0.5], confidence=1.0), ConfigError, ["confidence=1.0"]),
        (lambda: bootstrap_ci([], resamples=10), InputError, ["non-empty"]),
        (lambda: bootstrap_ci([0.5], resamples=0), ConfigError, ["resamples=0"]),
        (lambda: mean_at_k([["a"]], 1), InputError, ["must be numbers"]),
    ],
)
def test_errors_name_the_values(call, error, words):
    with pytest.raises(error) as caught:
        call()
    for word in words:
        assert word in str(caught.value)
