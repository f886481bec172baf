"""Tests of rlrunbook.engines.filters: the sampling distribution as a function of logits.

The reference is transformers' own warpers, built the way ``generate`` builds them (temperature only when
it is not 1, top-k only when limited, top-p only below 1, min-p always) and applied in the same order; the
hand examples derive their expected masks in comments.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlrunbook.engines.filters import SamplingFilters, apply_filters, sampling_logprobs
from rlrunbook.errors import ConfigError

NEG_INF = float("-inf")
GRID = list(itertools.product([0.5, 1.0, 1.7], [-1, 1, 5], [1.0, 0.9, 0.3], [0.0, 0.05, 0.3]))
SEEDS = [0, 1, 2]
SHAPES = [(4, 50), (2, 3, 50)]


def _hf_reference(logits: torch.Tensor, f: SamplingFilters) -> torch.Tensor:
    """transformers' warpers in generate's order; they take ``[B, V]`` scores, so flatten leading dims."""
    warpers = []
    if f.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(f.temperature)))
    if f.top_k != -1:
        warpers.append(TopKLogitsWarper(top_k=f.top_k, min_tokens_to_keep=1))
    if f.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=f.top_p, min_tokens_to_keep=1))
    warpers.append(MinPLogitsWarper(min_p=f.min_p, min_tokens_to_keep=1))
    scores = logits.reshape(-1, logits.shape[-1])
    input_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)  # unused by these warpers
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores.reshape(logits.shape)


def _kept(scores: torch.Tensor) -> list:
    return torch.isfinite(scores).tolist()


# ---------------------------------------------------------------------------------------------------------
# Against transformers
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), GRID)
def test_apply_filters_matches_transformers_warpers(shape, seed, temperature, top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=generator) * 3.0  # a spread wide enough for every filter to bite
    f = SamplingFilters(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = apply_filters(logits, f)
    theirs = _hf_reference(logits, f)
    assert ours.shape == logits.shape
    removed = torch.isneginf(ours)
    assert torch.equal(removed, torch.isneginf(theirs))
    assert torch.equal(ours[~removed], theirs[~removed])
    assert not removed.all(dim=-1).any()  # every row keeps at least one token
    if f.filters_tokens is False:
        assert not removed.any()


def test_the_grid_exercises_every_filter():
    # Guards the comparison above against a grid where nothing is ever removed (which would compare
    # only temperature scaling): each filter alone removes tokens on the seeded logits.
    logits = torch.randn((4, 50), generator=torch.Generator().manual_seed(0)) * 3.0
    for f in (SamplingFilters(top_k=5), SamplingFilters(top_p=0.3), SamplingFilters(min_p=0.3)):
        assert torch.isneginf(apply_filters(logits, f)).any(), f


# ---------------------------------------------------------------------------------------------------------
# Hand-derived cases
# ---------------------------------------------------------------------------------------------------------


def test_top_p_hand_example():
    # probs [0.5, 0.3, 0.2], top_p = 0.6. Sorted ascending: [0.2, 0.3, 0.5], cumulative [0.2, 0.5, 1.0].
    # A token is removed when its ascending cumulative mass is <= 1 - top_p = 0.4: only 0.2 is (0.5 > 0.4).
    # What is left, {0.5, 0.3}, is the smallest set of top tokens holding at least 0.6 of the mass.
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    out = apply_filters(logits, SamplingFilters(top_p=0.6))
    assert _kept(out) == [True, True, False]
    assert torch.equal(out[:2], logits[:2])


def test_top_p_boundary_mass_equal_to_one_minus_top_p_is_removed():
    # probs [0.25, 0.25, 0.5] (exact in float32), top_p = 0.75 -> 1 - top_p = 0.25. Ascending cumulative
    # [0.25, 0.5, 1.0]: the first 0.25 sits exactly on the threshold and "<=" removes it, so the kept set
    # {0.5, 0.25} holds exactly top_p. (The sort is stable, so index 0 is the one removed.)
    logits = torch.tensor([-math.log(2), -math.log(2), 0.0])
    out = apply_filters(logits, SamplingFilters(top_p=0.75))
    assert _kept(out) == [False, True, True]


def test_top_p_keeps_the_top_token_even_when_top_p_is_tiny():
    # probs [0.5, 0.3, 0.2], top_p = 0.01: 1 - top_p = 0.99 and the ascending cumulative [0.2, 0.5, 1.0]
    # removes 0.2 and 0.3; the top token's cumulative is 1.0 > 0.99, and it is always kept anyway.
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    assert _kept(apply_filters(logits, SamplingFilters(top_p=0.01))) == [True, False, False]


def test_top_p_keeps_the_top_token_when_cumsum_rounds_below_one_minus_top_p():
    # On these 1000 logits (seed 3) the float32 ascending cumulative mass ends at 1 - 2^-24, below
    # 1 - top_p = 1 - 1e-9, so the "<=" rule alone would remove every token, the top one included; the
    # guard that always keeps the most likely token must leave exactly the argmax.
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    assert logits.sort().values.softmax(-1).cumsum(-1)[-1] <= 1 - 1e-9  # the rounding does happen
    out = apply_filters(logits, SamplingFilters(top_p=1e-9))
    assert torch.isfinite(out).nonzero().flatten().tolist() == [int(logits.argmax())]


def test_top_k_one_keeps_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [5.0, 4.0, 3.0, 2.0]])
    out = apply_filters(logits, SamplingFilters(top_k=1))
    assert _kept(out) == [[False, True, False, False], [True, False, False, False]]
    assert out[0, 1] == 2.0 and out[1, 0] == 5.0


def test_top_k_keeps_ties_at_the_boundary():
    # top_k = 1 on [1, 3, 3, 2]: the 1st largest is 3, and everything >= 3 stays -> two tokens.
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    assert _kept(apply_filters(logits, SamplingFilters(top_k=1))) == [False, True, True, False]
    # top_k = 2 on [1, 3, 2, 2]: the 2nd largest is 2; both 2s tie with it -> three tokens stay.
    logits = torch.tensor([1.0, 3.0, 2.0, 2.0])
    assert _kept(apply_filters(logits, SamplingFilters(top_k=2))) == [False, True, True, True]


def test_top_k_larger_than_the_vocabulary_removes_nothing():
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert torch.equal(apply_filters(logits, SamplingFilters(top_k=10)), logits)


def test_min_p_hand_example():
    # probs [0.5, 0.3, 0.2], min_p = 0.5: threshold = 0.5 * max p = 0.25; keep p >= 0.25 -> 0.5 and 0.3.
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    out = apply_filters(logits, SamplingFilters(min_p=0.5))
    assert _kept(out) == [True, True, False]
    assert torch.equal(out[:2], logits[:2])


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    # Weights [4, 2, 1] -> probs [4/7, 2/7, 1/7] (2/7 is exactly half of 4/7 in float32 here).
    # min_p = 0.5: threshold = 2/7, so 2/7 stays (the rule is p < threshold is removed) and 1/7 goes.
    logits = torch.tensor([math.log(4.0), math.log(2.0), 0.0])
    assert _kept(apply_filters(logits, SamplingFilters(min_p=0.5))) == [True, True, False]


def test_temperature_divides_the_logits():
    # T = 2: [2, -4, 1] / 2 = [1, -2, 0.5], nothing removed.
    logits = torch.tensor([2.0, -4.0, 1.0])
    assert apply_filters(logits, SamplingFilters(temperature=2.0)).tolist() == [1.0, -2.0, 0.5]


def test_filters_apply_to_tempered_scores():
    # Order matters: min-p reads the tempered distribution. probs [0.5, 0.3, 0.2] at T = 0.5 become
    # proportional to [0.25, 0.09, 0.04] -> top 0.25/0.38; min_p = 0.5 keeps p >= 0.125/0.38, i.e. only the
    # top token (0.09/0.38 < 0.125/0.38). At T = 1 the same min_p keeps two tokens (see the hand example).
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.2)])
    out = apply_filters(logits, SamplingFilters(temperature=0.5, min_p=0.5))
    assert _kept(out) == [True, False, False]
    assert torch.allclose(out[0], logits[0] / 0.5)


def test_greedy_returns_the_logits_unchanged():
    # T = 0 reports the T = 1 policy's logprobs, whatever the other knobs say.
    logits = torch.randn((3, 20), generator=torch.Generator().manual_seed(3))
    greedy_filters = [
        SamplingFilters(temperature=0.0),
        SamplingFilters(temperature=0.0, top_k=1, top_p=0.3, min_p=0.3),
    ]
    for f in greedy_filters:
        out = apply_filters(logits, f)
        assert torch.equal(out, logits)
        assert torch.equal(sampling_logprobs(logits, f), torch.log_softmax(logits, dim=-1))


def test_top_p_one_removes_nothing_even_where_cumsum_rounds_past_one():
    # On these 1000 logits (seed 33, found by search) the float32 ascending cumulative mass ends at
    # 1 + 2^-23, not 1; and logit -200 underflows to probability exactly 0, whose cumulative mass 0 is
    # <= 1 - top_p = 0, so running the nucleus rule at top_p = 1 would drop it (transformers' warper
    # does; generate never builds it at 1.0). top_p = 1 must be a no-op: every token kept, scores as given.
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(33))
    logits[0] = -200.0
    probs = logits.sort().values.softmax(-1)
    assert probs[0] == 0.0
    assert probs.cumsum(-1)[-1] > 1.0  # the rounding this test is about does happen
    out = apply_filters(logits, SamplingFilters(top_p=1.0))
    assert torch.equal(out, logits)
    out = apply_filters(logits, SamplingFilters(temperature=1.7, top_p=1.0))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), GRID)
def test_sampling_logprobs_is_a_distribution_over_the_kept_tokens(temperature, top_k, top_p, min_p):
    logits = torch.randn((2, 3, 50), generator=torch.Generator().manual_seed(7)) * 3.0
    f = SamplingFilters(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    lp = sampling_logprobs(logits, f)
    kept = torch.isfinite(lp)
    assert torch.equal(kept, torch.isfinite(apply_filters(logits, f)))
    mass = torch.where(kept, lp.exp(), torch.zeros_like(lp)).sum(dim=-1)
    torch.testing.assert_close(mass, torch.ones_like(mass))


def test_sampling_logprobs_upcasts_half_precision():
    logits = torch.randn((2, 10), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    lp = sampling_logprobs(logits, SamplingFilters(top_k=3))
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, sampling_logprobs(logits.float(), SamplingFilters(top_k=3)))


# ---------------------------------------------------------------------------------------------------------
# SamplingFilters
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature=-0.1 must be >= 0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": 0}, "top_k=0 must be -1"),
        ({"top_k": -2}, "top_k=-2 must be -1"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
        ({"min_p": 1.0}, r"min_p=1.0 must be in \[0, 1\)"),
        ({"min_p": -0.1}, r"min_p=-0.1 must be in \[0, 1\)"),
    ],
)
def test_sampling_filters_rejects(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SamplingFilters(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{}, {"temperature": 0.0}, {"top_k": -1}, {"top_k": 1}, {"top_p": 1.0}, {"min_p": 0.0}]
)
def test_sampling_filters_accepts_the_edges(kwargs):
    f = SamplingFilters(**kwargs)
    for key, value in kwargs.items():
        assert getattr(f, key) == value


@pytest.mark.parametrize(
    ("kwargs", "filters_tokens", "greedy"),
    [
        ({}, False, False),
        ({"temperature": 0.5}, False, False),
        ({"temperature": 1.7}, False, False),
        ({"temperature": 0.0}, False, True),
        ({"top_k": 5}, True, False),
        ({"top_p": 0.9}, True, False),
        ({"min_p": 0.05}, True, False),
        ({"temperature": 0.0, "top_k": 1}, True, True),
    ],
)
def test_sampling_filters_properties(kwargs, filters_tokens, greedy):
    f = SamplingFilters(**kwargs)
    assert f.filters_tokens is filters_tokens
    assert f.greedy is greedy
