"""The parity gates of rlrunbook.diagnostics, pinned by hand: the gpu tier and ``check-logprobs`` read them from the
code under test, so a change to them must show here.

The gates (diagnostics' docstring): float32 max |Δ| <= 1e-4, no boundary flips; half precision max |Δ| <= 0.1 and
mean |Δ| <= 0.01 at T = 1, both divided by T below 1 (the sampled scores are logits / T, so a logit error δ is a
logprob error δ / T), and at most 1% of the sampled tokens flipped across a top-p/top-k boundary.
"""

from __future__ import annotations

import pytest
import torch

from rlrunbook.diagnostics import Gates, compare_logprobs, default_tolerance, parity_gates


def test_float32_gates():
    assert parity_gates(torch.float32) == Gates(max_abs=1e-4, mean_abs=1e-4, max_flip_fraction=0.0)
    assert parity_gates(torch.float32, 0.7) == Gates(1e-4, 1e-4, 0.0)  # no 1 / T in float32
    assert default_tolerance(torch.float32) == 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_gates_at_t1(dtype):
    assert parity_gates(dtype) == Gates(max_abs=0.1, mean_abs=0.01, max_flip_fraction=0.01)
    assert default_tolerance(dtype) == 0.1


@pytest.mark.parametrize(("temperature", "max_abs", "mean_abs"), [
    (0.7, 0.1 / 0.7, 0.01 / 0.7),   # 0.142857..., 0.0142857...: the tier's T = 0.7 case
    (0.5, 0.2, 0.02),
    (0.25, 0.4, 0.04),
    (1.0, 0.1, 0.01),
    (1.5, 0.1, 0.01),               # above 1 the gates do not shrink: logits / T only narrows the gaps
    (0.0, 0.1, 0.01),               # greedy is scored as T = 1
])
def test_half_precision_gates_divide_by_t_below_one(temperature, max_abs, mean_abs):
    gates = parity_gates(torch.bfloat16, temperature)
    assert gates.max_abs == pytest.approx(max_abs, rel=1e-12)
    assert gates.mean_abs == pytest.approx(mean_abs, rel=1e-12)
    assert gates.max_flip_fraction == 0.01


def test_a_report_is_judged_by_every_gate():
    """Four tokens with gaps 0, 0.05, 0.05, 0.1 (mean 0.05): inside the max gate at bf16 T = 1 (0.1), outside the
    mean gate (0.01); at T = 0.2 (max 0.5, mean 0.05) inside both."""
    sampled = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5, -3.0])]
    recomputed = [torch.tensor([-1.0, -2.05]), torch.tensor([-0.45, -3.1])]
    t1, t02 = parity_gates(torch.bfloat16, 1.0), parity_gates(torch.bfloat16, 0.2)
    report = compare_logprobs(sampled, recomputed, [[1, 2], [3, 4]], t1.max_abs, t1.max_flip_fraction, t1.mean_abs)
    assert report.max_abs_diff == pytest.approx(0.1, abs=1e-6) and report.mean_abs_diff == pytest.approx(0.05, abs=1e-6)
    assert not report.ok
    report = compare_logprobs(sampled, recomputed, [[1, 2], [3, 4]], t02.max_abs, t02.max_flip_fraction,
                              t02.mean_abs)
    assert report.ok
    # one flipped token of four (a recomputed -inf) is 25% of the tokens: above the 1% the half gates allow
    flipped = [torch.tensor([-1.0, float("-inf")]), torch.tensor([-0.5, -3.0])]
    report = compare_logprobs(sampled, flipped, [[1, 2], [3, 4]], t02.max_abs, t02.max_flip_fraction, t02.mean_abs)
    assert report.boundary_flips == 1 and report.max_abs_diff == 0.0 and not report.ok
