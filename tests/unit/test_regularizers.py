"""KL estimators, token entropy, sampler mismatch and clip fraction against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from rlrunbook.errors import ConfigError
from rlrunbook.regularizers import (
    KL_ESTIMATORS,
    RegularizerConfig,
    clip_fraction,
    get_kl_estimator,
    importance_correction,
    kl_k1,
    kl_k3,
    kl_low_var,
    sampler_mismatch,
    split_regularizer_config,
    token_entropy,
)


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_kl_estimators_by_hand():
    # lp = -1, ref = -2: k1 = -1 - (-2) = 1; x = ref - lp = -1, k3 = e^-1 - (-1) - 1 = e^-1 = 0.36788
    lp, ref = t(-1.0), t(-2.0)
    assert kl_k1(lp, ref).item() == pytest.approx(1.0)
    assert kl_k3(lp, ref).item() == pytest.approx(math.exp(-1), abs=1e-6)
    assert kl_low_var(lp, ref).item() == pytest.approx(0.36788, abs=1e-5)
    # the other way round, lp = -2, ref = -1: k1 = -1 (negative), x = 1, k3 = e - 1 - 1 = 0.71828
    assert kl_k1(ref, lp).item() == pytest.approx(-1.0)
    assert kl_k3(ref, lp).item() == pytest.approx(math.e - 2, abs=1e-6)


def test_kl_estimators_are_zero_and_flat_at_equal_policies():
    lp = t(-0.5, -3.0).requires_grad_()
    for name, estimator in KL_ESTIMATORS.items():
        value = estimator(lp, lp.detach())
        assert value.tolist() == [0.0, 0.0], name
    # d k3 / d lp = 1 - e^(ref - lp) = 0 at lp == ref: no pull at the reference; k1's gradient is 1
    (grad_k3,) = torch.autograd.grad(kl_k3(lp, lp.detach()).sum(), lp)
    (grad_k1,) = torch.autograd.grad(kl_k1(lp, lp.detach()).sum(), lp)
    assert grad_k3.tolist() == [0.0, 0.0] and grad_k1.tolist() == [1.0, 1.0]


# Inputs that once made an estimate negative (exp(x) - x - 1 loses the sign near x = 0; expm1 does not).
# The report (float64): lp = -2.97e-9, ref = 0 gave -1.1e-16; -2.342525139448394e-09 is one such
# value found again by a search. The float32 pair (lp, q) is a sampler-mismatch token whose
# exp(d) - d - 1 with d = lp - q gave -5.96e-08.
F64_ONCE_NEGATIVE = (-2.97e-9, -2.342525139448394e-09)
F32_ONCE_NEGATIVE = (-0.2302287369966507, -0.23032605648040771)
LOGPROBS = st.floats(-30, 0)
# Near-equal pairs: where cancellation happens (log ratios from 1e-12 up to 1e-3).
NEAR = st.tuples(LOGPROBS, st.floats(-1e-3, 1e-3))


@example(F64_ONCE_NEGATIVE[0], 0.0)
@example(F64_ONCE_NEGATIVE[1], 0.0)
@example(0.0, F64_ONCE_NEGATIVE[1])
@given(LOGPROBS, LOGPROBS)
def test_k3_is_never_negative(lp, ref):
    value = kl_k3(torch.tensor([lp], dtype=torch.float64), torch.tensor([ref], dtype=torch.float64))
    assert value.item() >= 0.0


@example((F64_ONCE_NEGATIVE[1], 0.0), torch.float64)
@example((F32_ONCE_NEGATIVE[0], F32_ONCE_NEGATIVE[1] - F32_ONCE_NEGATIVE[0]), torch.float32)  # ref - lp = d
@given(NEAR, st.sampled_from([torch.float32, torch.float64]))
def test_k3_and_low_var_kl_are_never_negative_near_the_reference(pair, dtype):
    ref, delta = pair
    lp = torch.tensor([ref + delta], dtype=dtype)
    ref_t = torch.tensor([ref], dtype=dtype)
    assert kl_k3(lp, ref_t).item() >= 0.0
    assert kl_low_var(lp, ref_t).item() >= 0.0


@example(-1.5, 0.0)  # identical: exactly 0
@example(F32_ONCE_NEGATIVE[1], F32_ONCE_NEGATIVE[0] - F32_ONCE_NEGATIVE[1])  # q, then lp - q
@given(LOGPROBS, st.floats(-1e-3, 1e-3))
def test_mismatch_kl_is_never_negative_in_float32(q, delta):
    # The sampler and the trainer disagree by |delta| <= 1e-3, the regime of a healthy run (float32 as logged).
    lp = torch.tensor([q + delta], dtype=torch.float32)
    assert sampler_mismatch(lp, torch.tensor([q], dtype=torch.float32)).kl.item() >= 0.0


def test_old_form_was_negative_on_the_examples():
    """The examples above fail the formula this module used before (so they do test something)."""
    x64 = torch.tensor([0.0 - F64_ONCE_NEGATIVE[1]], dtype=torch.float64)  # x = ref - lp
    assert (torch.exp(x64) - x64 - 1).item() < 0
    lp32, q32 = (torch.tensor([v], dtype=torch.float32) for v in F32_ONCE_NEGATIVE)
    d = lp32 - q32
    assert (torch.exp(d) - d - 1).item() < 0
    assert kl_k3(torch.tensor([F64_ONCE_NEGATIVE[1]], dtype=torch.float64),
                 torch.zeros(1, dtype=torch.float64)).item() >= 0


def test_low_var_kl_clamps_at_ten_with_finite_gradient():
    # x = ref - lp = 5: k3 = e^5 - 6 = 142.4 -> 10; x = 100 would overflow exp in float32 without the bound
    lp = t(-5.0, -100.0, -1.0).requires_grad_()
    ref = t(0.0, 0.0, -1.5)
    value = kl_low_var(lp, ref)
    expected_last = math.exp(-0.5) + 0.5 - 1  # x = -0.5: 0.10653
    assert value.tolist() == pytest.approx([10.0, 10.0, expected_last], abs=1e-6)
    assert kl_k3(lp, ref)[0].item() == pytest.approx(math.exp(5) - 6, rel=1e-6)
    value.sum().backward()
    # clamped tokens get no gradient; the last: d/d lp (e^x - x - 1) = 1 - e^x with x = -0.5
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, 1 - math.exp(-0.5)], abs=1e-6)


def test_unknown_estimator_names_the_valid_ones():
    assert get_kl_estimator("k3") is kl_k3
    with pytest.raises(ConfigError, match="k9.*k1, k3, low_var_kl"):
        get_kl_estimator("k9")


def test_entropy_of_uniform_and_peaked_rows():
    v = 7
    logits = torch.stack([torch.zeros(v), torch.full((v,), 3.5), torch.tensor([50.0] + [0.0] * (v - 1))])
    h = token_entropy(logits)
    assert h[:2].tolist() == pytest.approx([math.log(v)] * 2, abs=1e-6)  # uniform: log V whatever the offset
    assert h[2].item() == pytest.approx(0.0, abs=1e-12)  # one-hot-like: ~0 (terms of order 50 e^-50)
    # two logits (0, ln 3): p = (1/4, 3/4), H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.56234
    two = token_entropy(torch.tensor([[0.0, math.log(3)]], dtype=torch.bfloat16))
    assert two.dtype == torch.float32
    assert two.item() == pytest.approx(0.56234, abs=2e-3)  # bf16 input rounds ln 3


def test_clip_fraction_on_hand_made_ratios():
    # ratios 0.5, 0.8, 1.0, 1.2, 1.5: outside [0.8, 1.2] strictly are 0.5 and 1.5 -> 2/5
    ratios = t(0.5, 0.8, 1.0, 1.2, 1.5)
    q = t(-1.0, -2.0, -0.5, -3.0, -1.0)
    lp = q + ratios.log()
    assert clip_fraction(lp, q, 0.79999, 1.20001).item() == pytest.approx(0.4)
    assert clip_fraction(lp, q, 0.0, 4.0).item() == 0.0
    assert clip_fraction(lp, q, 0.9, 1.1).item() == pytest.approx(0.8)


def test_mismatch_by_hand():
    lp = t(-1.0, -2.0, -0.5)
    zero = sampler_mismatch(lp, lp.clone())
    assert (zero.abs_logprob_diff.item(), zero.kl.item()) == (0.0, 0.0)
    # d = lp - q = (0.1, -0.2, 0.0): mean |d| = 0.1
    # k3 = e^d - d - 1 = (0.0051709, 0.0187308, 0) -> mean 0.0079672
    q = lp - t(0.1, -0.2, 0.0)
    m = sampler_mismatch(lp.requires_grad_(), q)
    assert m.abs_logprob_diff.item() == pytest.approx(0.1, abs=1e-6)
    assert m.kl.item() == pytest.approx(0.0079672, abs=1e-6)
    assert not m.kl.requires_grad and not m.abs_logprob_diff.requires_grad


def test_split_regularizer_config():
    reg, rest = split_regularizer_config({"kl_coef": 0.1, "entropy_coef": 0.01, "clip_high_threshold": 1.3})
    assert reg == RegularizerConfig(kl_coef=0.1, kl_estimator="low_var_kl", entropy_coef=0.01)
    assert rest == {"clip_high_threshold": 1.3}
    assert split_regularizer_config(None) == (RegularizerConfig(), {})


@pytest.mark.parametrize("config, match", [
    ({"kl_coef": -1.0}, r"kl_coef.*-1.0.*>= 0"),
    ({"entropy_coef": -0.5}, r"entropy_coef.*>= 0"),
    ({"kl_coef": float("nan")}, "kl_coef.*finite"),
    ({"kl_coef": "a lot"}, "kl_coef.*'a lot'"),
    ({"kl_estimator": "k9"}, "unknown kl_estimator 'k9'; pass one of: k1, k3, low_var_kl"),
])
def test_bad_regularizer_config_is_named(config, match):
    with pytest.raises(ConfigError, match=match):
        split_regularizer_config(config)


def test_importance_correction_by_hand():
    ratios = torch.tensor([0.1, 0.5, 1.0, 2.0, 3.0, 10.0])
    log_ratio = ratios.log()
    # truncate at 2: min(ratio, 2); the cap binds for 3 and 10 (2 of 6 tokens)
    truncated = importance_correction(log_ratio, "truncate", cap=2.0)
    assert torch.allclose(truncated.weights, torch.tensor([0.1, 0.5, 1.0, 2.0, 2.0, 2.0]), atol=1e-6)
    assert truncated.corrected_fraction.item() == pytest.approx(2 / 6)
    # mask outside [1/8, 8]: 0.1 and 10 are dropped, the rest keep weight 1
    masked = importance_correction(log_ratio, "mask", low=0.125, high=8.0)
    assert masked.weights.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert masked.corrected_fraction.item() == pytest.approx(2 / 6)
    none = importance_correction(log_ratio, "none")
    assert none.weights.tolist() == [1.0] * 6 and none.corrected_fraction.item() == 0.0
    with pytest.raises(ConfigError, match="truncate"):
        importance_correction(log_ratio, "clip")


def test_importance_weights_carry_no_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    weights = importance_correction(lp - torch.tensor([-1.5, -1.0]), "truncate").weights
    assert not weights.requires_grad
