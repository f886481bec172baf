"""Tests of rlrunbook.losses: hand-derived values, independent references, gradients, token-sum semantics.

The hand examples derive every expected number in a comment; the references are written differently from
the module (explicit per-token loops with piecewise branches in numpy, torch's own cross_entropy).
"""

from __future__ import annotations

import dataclasses
import math
import typing

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.errors import ConfigError, InputError
from rlrunbook.losses import (
    LOSSES,
    LossOutput,
    cispo,
    cross_entropy,
    dro,
    get_loss,
    gspo,
    importance_sampling,
    ppo,
    resolve_loss_config,
    validate_loss_inputs,
)

LN2 = math.log(2.0)
RL_LOSSES = ["importance_sampling", "ppo", "cispo", "dro"]  # token-level; gspo is tested on its own


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _leaf(values) -> torch.Tensor:
    return _t(values).requires_grad_()


# The shared RL example: lp = [log 0.5, log 0.25], q = [log 0.25, log 0.5], A = [1, -2]
#   => r = exp(lp - q) = [0.5/0.25, 0.25/0.5] = [2, 0.5]
def _rl_example() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lp = _leaf([math.log(0.5), math.log(0.25)])
    return lp, {"logprobs": _t([math.log(0.25), math.log(0.5)]), "advantages": _t([1.0, -2.0])}


# ---------------------------------------------------------------------------------------------------------
# Hand-derived values
# ---------------------------------------------------------------------------------------------------------


def test_cross_entropy_hand_example():
    # lp = [log 1/2, log 1/4, log 1/8] = [-ln2, -2 ln2, -3 ln2], w = [0, 1, 2]
    # loss = -(0 * -ln2 + 1 * -2ln2 + 2 * -3ln2) = 2 ln2 + 6 ln2 = 8 ln2 ≈ 5.5452  (a sum: no division by 3)
    lp = _leaf([math.log(0.5), math.log(0.25), math.log(0.125)])
    out = cross_entropy(lp, {"weights": _t([0.0, 1.0, 2.0])}, {})
    assert out.loss.item() == pytest.approx(8 * LN2)
    # weights:sum = 0 + 1 + 2 = 3; weighted_tokens:sum counts the non-zero weights = 2
    assert out.metrics == {"weights:sum": pytest.approx(3.0), "weighted_tokens:sum": pytest.approx(2.0)}


def test_importance_sampling_hand_example():
    # r = [2, 0.5], A = [1, -2]: r*A = [2, -1]; loss = -(2 - 1) = -1
    lp, inputs = _rl_example()
    out = importance_sampling(lp, inputs, {})
    assert out.loss.item() == pytest.approx(-1.0)
    # ratio:mean = (2 + 0.5) / 2 = 1.25; ratio:max = 2
    assert out.metrics == {"ratio:mean": pytest.approx(1.25), "ratio:max": pytest.approx(2.0)}


def test_ppo_hand_example_default_clip():
    # defaults lo = 0.8, hi = 1.2: clip(r) = [1.2, 0.8]
    # token 0: min(r*A, clip*A) = min(2*1, 1.2*1)       = 1.2
    # token 1: min(r*A, clip*A) = min(0.5*-2, 0.8*-2)   = min(-1, -1.6) = -1.6
    # loss = -(1.2 - 1.6) = 0.4; both ratios lie outside [0.8, 1.2] => clip_fraction:mean = 2/2 = 1
    lp, inputs = _rl_example()
    out = ppo(lp, inputs, {})
    assert out.loss.item() == pytest.approx(0.4)
    assert out.metrics == {"ratio:mean": pytest.approx(1.25), "clip_fraction:mean": pytest.approx(1.0)}


def test_ppo_hand_example_wide_clip_equals_importance_sampling():
    # lo = 0.25, hi = 3 contain both ratios, so clip(r) = r and the loss is the IS loss: -(2 - 1) = -1
    lp, inputs = _rl_example()
    out = ppo(lp, inputs, {"clip_low_threshold": 0.25, "clip_high_threshold": 3.0})
    assert out.loss.item() == pytest.approx(-1.0)
    assert out.metrics["clip_fraction:mean"] == 0.0


def test_cispo_hand_example():
    # lo = 0.8, hi = 1.2: coefficient sg(clip(r)) = [1.2, 0.8]
    # token 0: 1.2 * lp0 * A0 = 1.2 * (-ln2) * 1    = -1.2 ln2
    # token 1: 0.8 * lp1 * A1 = 0.8 * (-2ln2) * -2  = +3.2 ln2
    # loss = -(-1.2 ln2 + 3.2 ln2) = -2 ln2 ≈ -1.3863; both ratios clipped => clip_fraction:mean = 1
    lp, inputs = _rl_example()
    out = cispo(lp, inputs, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    assert out.loss.item() == pytest.approx(-2 * LN2)
    assert out.metrics == {"ratio:mean": pytest.approx(1.25), "clip_fraction:mean": pytest.approx(1.0)}


def test_cispo_hand_example_default_one_sided_clip():
    # defaults lo = 0, hi = 4 contain both ratios: coefficient = r = [2, 0.5]
    # token 0: 2 * (-ln2) * 1 = -2 ln2;  token 1: 0.5 * (-2 ln2) * -2 = +2 ln2;  loss = -(0) = 0
    lp, inputs = _rl_example()
    out = cispo(lp, inputs, {})
    assert out.loss.item() == pytest.approx(0.0, abs=1e-12)
    assert out.metrics["clip_fraction:mean"] == 0.0


@pytest.mark.parametrize(
    ("config", "beta"),
    [({}, 0.05), ({"beta": 1.0}, 1.0)],
)
def test_dro_hand_example(config, beta):
    # lp*A = (-ln2)(1) + (-2ln2)(-2) = -ln2 + 4 ln2 = 3 ln2
    # lp - q = [-ln2 + 2ln2, -2ln2 + ln2] = [ln2, -ln2]  => sum of squares = 2 ln2^2
    # penalty:sum = 0.5 * beta * 2 ln2^2 = beta ln2^2;  loss = -(3 ln2 - beta ln2^2)
    #   beta = 0.05: -(2.07944 - 0.02402) ≈ -2.05542;   beta = 1: -(2.07944 - 0.48045) ≈ -1.59899
    lp, inputs = _rl_example()
    out = dro(lp, inputs, config)
    assert out.loss.item() == pytest.approx(-(3 * LN2 - beta * LN2**2))
    assert out.metrics == {"ratio:mean": pytest.approx(1.25), "penalty:sum": pytest.approx(beta * LN2**2)}


# GSPO's example: two sequences (datums). Sequence 0 has positions 0 and 1 with lp - q = [ln 4, 0], so
# its ratio is the geometric mean s_0 = exp((ln 4 + 0) / 2) = 2; sequence 1 has position 2 with
# lp - q = -ln 2, so s_1 = 0.5. Advantages per token A = [1, 1, -2].
def _gspo_example() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    lp = _leaf([math.log(0.8), math.log(0.5), math.log(0.25)])
    q = _t([math.log(0.2), math.log(0.5), math.log(0.5)])
    return lp, {"logprobs": q, "advantages": _t([1.0, 1.0, -2.0]), "sequence_index": _t([0, 0, 1])}


def test_gspo_hand_example_wide_clip():
    # lo = 0.25, hi = 3 contain both sequence ratios: every token's ratio is its sequence's,
    # loss = -(2*1 + 2*1 + 0.5*-2) = -3. Gradient of token t: -s_i A_t = [-2, -2, -0.5*-2] = [-2, -2, 1].
    lp, inputs = _gspo_example()
    out = gspo(lp, inputs, {"clip_low_threshold": 0.25, "clip_high_threshold": 3.0})
    assert out.loss.item() == pytest.approx(-3.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _t([-2.0, -2.0, 1.0]))
    # ratio:mean over sequences = (2 + 0.5) / 2 = 1.25 (a token mean would give (2+2+0.5)/3 = 1.5)
    assert out.metrics == {"ratio:mean": pytest.approx(1.25), "clip_fraction:mean": 0.0}


def test_gspo_hand_example_default_clip_binds_per_sequence():
    # The paper's bounds lo = 1 - 3e-4 = 0.9997, hi = 1 + 4e-4 = 1.0004.
    # sequence 0: s = 2 > hi, A = 1 > 0: min(2, 1.0004) = 1.0004 per token, twice;
    # sequence 1: s = 0.5 < lo, A = -2:  min(0.5*-2, 0.9997*-2) = -1.9994;
    # loss = -(2 * 1.0004 - 1.9994) = -0.0014. The clipped branch binds in both sequences: no gradient at all.
    lp, inputs = _gspo_example()
    out = gspo(lp, inputs, {})
    assert out.loss.item() == pytest.approx(-0.0014, abs=1e-12)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0, 0.0]))
    assert out.metrics["clip_fraction:mean"] == 1.0  # every position's sequence was clipped


def test_gspo_one_token_clipped_means_its_whole_sequence_is_clipped_not_the_token():
    # Sequence 0 again (s_0 = 2 from token ratios [4, 1]) with bounds [0.5, 2.5]: token 0's own ratio 4
    # would be clipped by ppo, but the sequence ratio 2 is inside, so both tokens keep gradient -s_0 A = -2.
    lp, inputs = _gspo_example()
    out = gspo(lp, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 2.5})
    out.loss.backward()
    torch.testing.assert_close(lp.grad[:2], _t([-2.0, -2.0]))
    token_level = _leaf([math.log(0.8), math.log(0.5)])
    ppo(token_level, {k: v[:2] for k, v in inputs.items() if k != "sequence_index"},
        {"clip_low_threshold": 0.5, "clip_high_threshold": 2.5}).loss.backward()
    torch.testing.assert_close(token_level.grad, _t([0.0, -1.0]))  # ppo: token 0 clipped, token 1 r = 1


def test_gspo_gradient_equals_the_papers_sequence_objective_times_length():
    # With one advantage per sequence (GRPO's), d/dlp of -sum_i |y_i| s_i(theta) A_i, where s_i is the
    # differentiable geometric mean, equals gspo's gradient (GSPO-token, eq. 12, summed over tokens).
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 1, 4]
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))  # (8,)
    lp_values = -torch.rand(8, generator=gen, dtype=torch.float64)
    q = lp_values - 0.01 * torch.randn(8, generator=gen, dtype=torch.float64)
    seq_adv = torch.randn(3, generator=gen, dtype=torch.float64)
    inputs = {"logprobs": q, "advantages": seq_adv[seq], "sequence_index": seq.double()}
    lp = lp_values.clone().requires_grad_()
    gspo(lp, inputs, {"clip_low_threshold": 0.0, "clip_high_threshold": 10.0}).loss.backward()

    reference = lp_values.clone().requires_grad_()
    total = reference.new_zeros(())
    for i, n in enumerate(lengths):
        at = seq == i
        s_i = torch.exp((reference[at] - q[at]).mean())
        total = total - n * s_i * seq_adv[i]
    total.backward()
    torch.testing.assert_close(lp.grad, reference.grad)


def test_gspo_positions_outside_the_sequence_ratio_mask_enter_neither_the_ratio_nor_the_loss():
    # A fourth position in sequence 1 with mask 0 and a wild ratio (lp - q = 5): s_1 stays 0.5 and the
    # loss stays -3 (wide clip); the masked position gets no gradient.
    lp, inputs = _gspo_example()
    wild = torch.cat([lp.detach(), _t([-0.1])]).requires_grad_()
    masked = {"logprobs": torch.cat([inputs["logprobs"], _t([-5.1])]),
              "advantages": torch.cat([inputs["advantages"], _t([3.0])]),
              "sequence_index": _t([0, 0, 1, 1]), "sequence_ratio_mask": _t([1, 1, 1, 0])}
    out = gspo(wild, masked, {"clip_low_threshold": 0.25, "clip_high_threshold": 3.0})
    assert out.loss.item() == pytest.approx(-3.0)
    out.loss.backward()
    torch.testing.assert_close(wild.grad, _t([-2.0, -2.0, 1.0, 0.0]))


def test_gspo_needs_the_sequence_index_the_trainer_supplies():
    lp, inputs = _gspo_example()
    del inputs["sequence_index"]
    with pytest.raises(InputError, match="sequence_index"):
        gspo(lp, inputs, {})


# ---------------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_cross_entropy_matches_torch_cross_entropy_value_and_grad(seed):
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 7, 11
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    weights = torch.rand(n, generator=gen, dtype=torch.float64) * (torch.rand(n, generator=gen) > 0.3)

    ours_logits = logits.clone().requires_grad_()
    lp = torch.log_softmax(ours_logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    ours = cross_entropy(lp, {"weights": weights}, {}).loss
    ours.backward()

    ref_logits = logits.clone().requires_grad_()
    ref = (F.cross_entropy(ref_logits, targets, reduction="none") * weights).sum()
    ref.backward()

    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(ours_logits.grad, ref_logits.grad)


def _np_importance_sampling(lp, q, adv, cfg):
    total = 0.0
    for lp_t, q_t, a_t in zip(lp, q, adv, strict=True):
        total -= math.exp(lp_t) / math.exp(q_t) * a_t
    return total


def _np_ppo(lp, q, adv, cfg):
    # The piecewise form of eq. 7: for A >= 0 the objective is min(r, hi) * A, for A < 0 max(r, lo) * A.
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    total = 0.0
    for lp_t, q_t, a_t in zip(lp, q, adv, strict=True):
        r = math.exp(lp_t - q_t)
        if a_t >= 0:
            objective = (min(r, hi)) * a_t
        else:
            objective = (max(r, lo)) * a_t
        total -= objective
    return total


def _np_cispo(lp, q, adv, cfg):
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    total = 0.0
    for lp_t, q_t, a_t in zip(lp, q, adv, strict=True):
        r = math.exp(lp_t - q_t)
        coefficient = lo if r < lo else min(r, hi)
        total -= coefficient * lp_t * a_t
    return total


def _np_dro(lp, q, adv, cfg):
    total = 0.0
    for lp_t, q_t, a_t in zip(lp, q, adv, strict=True):
        total -= lp_t * a_t - cfg["beta"] / 2 * (lp_t - q_t) * (lp_t - q_t)
    return total


NP_REFERENCES = {
    "importance_sampling": _np_importance_sampling,
    "ppo": _np_ppo,
    "cispo": _np_cispo,
    "dro": _np_dro,
}

_logprob = st.floats(min_value=-4.0, max_value=-0.01, allow_nan=False)
_advantage = st.floats(min_value=-3.0, max_value=3.0, allow_nan=False)


@st.composite
def _rl_batch(draw):
    n = draw(st.integers(min_value=1, max_value=16))
    lp = draw(st.lists(_logprob, min_size=n, max_size=n))
    q = draw(st.lists(_logprob, min_size=n, max_size=n))
    adv = draw(st.lists(_advantage, min_size=n, max_size=n))
    return np.array(lp), np.array(q), np.array(adv)


_configs = {
    "importance_sampling": st.just({}),
    "ppo": st.builds(
        lambda lo, hi: {"clip_low_threshold": lo, "clip_high_threshold": hi},
        st.floats(0.0, 1.0),
        st.floats(1.0, 5.0),
    ),
    "cispo": st.builds(
        lambda lo, hi: {"clip_low_threshold": lo, "clip_high_threshold": hi},
        st.floats(0.0, 1.0),
        st.floats(1.0, 5.0),
    ),
    "dro": st.builds(lambda beta: {"beta": beta}, st.floats(0.0, 2.0)),
}


@pytest.mark.parametrize("name", RL_LOSSES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_rl_losses_match_numpy_loop_reference(name, data):
    lp, q, adv = data.draw(_rl_batch())
    config = data.draw(_configs[name])
    full_config = {**LOSSES[name].config_defaults, **config}
    inputs = {"logprobs": torch.from_numpy(q), "advantages": torch.from_numpy(adv)}
    out = LOSSES[name].fn(torch.from_numpy(lp).requires_grad_(), inputs, config)
    expected = NP_REFERENCES[name](lp, q, adv, full_config)
    assert out.loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-9)


# ---------------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------------


def test_importance_sampling_gradient_is_minus_ratio_times_advantage():
    gen = torch.Generator().manual_seed(0)
    lp_values = -torch.rand(9, generator=gen, dtype=torch.float64) * 3
    q = -torch.rand(9, generator=gen, dtype=torch.float64) * 3
    adv = torch.randn(9, generator=gen, dtype=torch.float64)

    lp = lp_values.clone().requires_grad_()
    importance_sampling(lp, {"logprobs": q, "advantages": adv}, {}).loss.backward()

    analytic = -torch.exp(lp_values - q) * adv  # d/dlp of -(e^lp / e^q) A
    independent = lp_values.clone().requires_grad_()
    (-(independent.exp() / q.exp()) * adv).sum().backward()

    torch.testing.assert_close(lp.grad, analytic)
    torch.testing.assert_close(lp.grad, independent.grad)


def test_cispo_gradient_is_minus_clipped_ratio_times_advantage():
    # r = [2, 0.5, 1.1] with lo = 0.8, hi = 1.2 => clip(r) = [1.2, 0.8, 1.1]; A = [1, -2, 3]
    # stop-gradient through the ratio => d loss / d lp = -clip(r) * A = [-1.2, 1.6, -3.3]
    # (no token loses its gradient, unlike PPO, and there is no lp * dr/dlp term)
    q = _t([math.log(0.25), math.log(0.5), math.log(0.5)])
    lp = (q + torch.log(_t([2.0, 0.5, 1.1]))).detach().requires_grad_()
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    cispo(lp, {"logprobs": q, "advantages": _t([1.0, -2.0, 3.0])}, config).loss.backward()
    torch.testing.assert_close(lp.grad, _t([-1.2, 1.6, -3.3]))


def test_ppo_gradient_is_zero_where_the_clipped_branch_binds():
    # lo = 0.8, hi = 1.2
    # token 0: r = 2.0 > hi, A = +1 -> min picks hi*A (constant)   -> grad 0
    # token 1: r = 0.5 < lo, A = -2 -> min picks lo*A (constant)   -> grad 0
    # token 2: r = 2.0 > hi, A = -1 -> min picks r*A (unclipped)   -> grad -r*A = -(2)(-1) = 2
    # token 3: r = 1.0 inside,  A = +3 -> r*A                      -> grad -r*A = -3
    # token 4: r = 0.5 < lo, A = +1 -> min picks r*A (unclipped)   -> grad -r*A = -0.5
    ratios = _t([2.0, 0.5, 2.0, 1.0, 0.5])
    adv = _t([1.0, -2.0, -1.0, 3.0, 1.0])
    q = _t([-1.0, -2.0, -1.5, -0.7, -3.0])
    lp = (q + ratios.log()).detach().requires_grad_()
    out = ppo(lp, {"logprobs": q, "advantages": adv}, {})
    out.loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0, 2.0, -3.0, -0.5]))
    # tokens 0, 1, 2 and 4 have r outside [0.8, 1.2] => clip_fraction:mean = 4/5
    assert out.metrics["clip_fraction:mean"] == pytest.approx(0.8)


def test_dro_gradient_is_minus_advantage_plus_beta_log_ratio():
    # d/dlp of -(lp*A - beta/2 (lp - q)^2) = -A + beta (lp - q)
    gen = torch.Generator().manual_seed(1)
    q = -torch.rand(6, generator=gen, dtype=torch.float64)
    lp_values = -torch.rand(6, generator=gen, dtype=torch.float64)
    adv = torch.randn(6, generator=gen, dtype=torch.float64)
    lp = lp_values.clone().requires_grad_()
    dro(lp, {"logprobs": q, "advantages": adv}, {"beta": 0.3}).loss.backward()
    torch.testing.assert_close(lp.grad, -adv + 0.3 * (lp_values - q))


# ---------------------------------------------------------------------------------------------------------
# Token-sum semantics
# ---------------------------------------------------------------------------------------------------------


def _random_inputs(name, n, gen):
    spec = LOSSES[name]
    values = {
        "weights": torch.rand(n, generator=gen, dtype=torch.float64),
        "logprobs": -torch.rand(n, generator=gen, dtype=torch.float64) * 2,
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
    }
    inputs = {key: values[key] for key in spec.required_inputs}
    if spec.per_sequence:  # one position per sequence: any split falls between sequences, as the trainer's do
        inputs["sequence_index"] = torch.arange(n, dtype=torch.float64)
    return inputs


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("split", [1, 4, 9])
def test_loss_of_a_concatenation_is_the_sum_of_the_parts(name, split):
    # This is what lets two forward_backward calls accumulate the same gradient as one over the union.
    gen = torch.Generator().manual_seed(split)
    n = 10
    lp_values = -torch.rand(n, generator=gen, dtype=torch.float64) * 2
    inputs = _random_inputs(name, n, gen)
    fn = LOSSES[name].fn

    whole = lp_values.clone().requires_grad_()
    whole_loss = fn(whole, inputs, {}).loss
    whole_loss.backward()

    parts = lp_values.clone().requires_grad_()  # one leaf, two backward calls: gradients accumulate
    loss_a = fn(parts[:split], {k: v[:split] for k, v in inputs.items()}, {}).loss
    loss_b = fn(parts[split:], {k: v[split:] for k, v in inputs.items()}, {}).loss
    loss_a.backward()
    loss_b.backward()

    torch.testing.assert_close(loss_a + loss_b, whole_loss)
    torch.testing.assert_close(parts.grad, whole.grad)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_duplicating_the_batch_doubles_the_loss(name):
    # A mean would leave it unchanged; Tinker sums over tokens.
    gen = torch.Generator().manual_seed(3)
    lp = -torch.rand(5, generator=gen, dtype=torch.float64)
    inputs = _random_inputs(name, 5, gen)
    once = LOSSES[name].fn(lp, inputs, {}).loss
    twice = LOSSES[name].fn(torch.cat([lp, lp]), {k: torch.cat([v, v]) for k, v in inputs.items()}, {}).loss
    torch.testing.assert_close(twice, 2 * once)


# ---------------------------------------------------------------------------------------------------------
# Registry, validation and configuration
# ---------------------------------------------------------------------------------------------------------


def test_registry_specs():
    assert sorted(LOSSES) == ["cispo", "cross_entropy", "dro", "gspo", "importance_sampling", "ppo"]
    assert LOSSES["cross_entropy"].required_inputs == ("weights",)
    assert not LOSSES["cross_entropy"].uses_advantages
    for name in [*RL_LOSSES, "gspo"]:
        spec = get_loss(name)
        assert spec is LOSSES[name] and spec.name == name
        assert spec.required_inputs == ("logprobs", "advantages")
        assert spec.uses_advantages
    for spec in LOSSES.values():
        assert spec.citation and spec.doc
    with pytest.raises(dataclasses.FrozenInstanceError):
        LOSSES["ppo"].name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        LOSSES["ppo"].config_defaults["clip_low_threshold"] = 0.5  # type: ignore[index]


def test_config_defaults_are_pinned():
    # From the Tinker docs (tinker/losses/ppo, /cispo, /dro). Do not change without a decision: hosted
    # and local runs must agree when loss_fn_config is omitted.
    assert dict(LOSSES["ppo"].config_defaults) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert dict(LOSSES["cispo"].config_defaults) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert dict(LOSSES["dro"].config_defaults) == {"beta": 0.05}
    # GSPO paper (arXiv 2507.18071, section 5.1): clipping ranges 3e-4 (left) and 4e-4 (right)
    assert dict(LOSSES["gspo"].config_defaults) == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert LOSSES["gspo"].per_sequence and dict(LOSSES["gspo"].optional_inputs) == {"sequence_ratio_mask": 1.0}
    assert dict(LOSSES["cross_entropy"].config_defaults) == {}
    assert dict(LOSSES["importance_sampling"].config_defaults) == {}


def test_every_tinker_loss_name_is_implemented_or_explained():
    from tinker.types import LossFnType

    for name in typing.get_args(LossFnType):
        if name in LOSSES:
            assert get_loss(name).name == name
        else:
            with pytest.raises(ConfigError, match="not supported by the local backend"):
                get_loss(name)


def test_unknown_loss_name_lists_the_supported_ones():
    with pytest.raises(ConfigError) as info:
        get_loss("grpo")
    message = str(info.value)
    assert "'grpo'" in message
    for name in LOSSES:
        assert name in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("name", "alternatives"),
    [
        ("stable_reinforce", ["'cispo'"]),
        ("custom", ["forward_backward_custom"]),
    ],
)
def test_unsupported_tinker_losses_name_a_supported_alternative(name, alternatives):
    with pytest.raises(ConfigError, match="not supported by the local backend") as info:
        get_loss(name)
    for alternative in alternatives:
        assert alternative in str(info.value)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_missing_input_names_the_key(name):
    spec = LOSSES[name]
    inputs = _random_inputs(name, 3, torch.Generator().manual_seed(0))
    missing = spec.required_inputs[-1]
    del inputs[missing]
    with pytest.raises(InputError, match=missing):
        validate_loss_inputs(spec, inputs)
    with pytest.raises(InputError, match=missing):
        spec.fn(_t([-1.0, -1.0, -1.0]), inputs, {})


def test_unequal_lengths_name_the_keys_and_lengths():
    inputs = {"logprobs": _t([-1.0, -1.0, -1.0]), "advantages": _t([1.0, 2.0])}
    with pytest.raises(InputError) as info:
        validate_loss_inputs(get_loss("ppo"), inputs)
    assert "'logprobs': 3" in str(info.value) and "'advantages': 2" in str(info.value)


@pytest.mark.parametrize("key", ["clip_low_threshold", "sequence_ratio_mask"])
def test_per_token_overrides_the_local_backend_does_not_read_are_rejected(key):
    # Ignoring them would silently change the algorithm the caller asked the hosted service for.
    lp, inputs = _rl_example()
    with pytest.raises(InputError, match=key):
        ppo(lp, {**inputs, key: _t([0.9, 0.9])}, {})


def test_target_logprobs_length_must_match_inputs():
    inputs = {"logprobs": _t([-1.0, -1.0]), "advantages": _t([1.0, 2.0])}
    with pytest.raises(InputError, match="'target_logprobs': 3"):
        importance_sampling(_t([-1.0, -1.0, -1.0]), inputs, {})


@pytest.mark.parametrize(
    ("lp", "weights", "match"),
    [
        (_t([[-1.0, -1.0]]), _t([1.0, 1.0]), "target_logprobs must be 1-D"),
        (_t([-1.0, -1.0]), _t([[1.0, 1.0]]), "weights"),
        (_t([]), _t([]), "no token positions"),
    ],
)
def test_malformed_shapes_are_input_errors(lp, weights, match):
    with pytest.raises(InputError, match=match):
        cross_entropy(lp, {"weights": weights}, {})


def test_unknown_config_key_names_the_allowed_keys():
    lp, inputs = _rl_example()
    with pytest.raises(ConfigError) as info:
        ppo(lp, inputs, {"beta": 0.1})
    message = str(info.value)
    assert "'beta'" in message and "clip_high_threshold" in message and "clip_low_threshold" in message
    with pytest.raises(ConfigError, match="allowed keys: none"):
        importance_sampling(lp, inputs, {"clip_low_threshold": 0.8})
    with pytest.raises(ConfigError, match="allowed keys: beta"):
        resolve_loss_config(get_loss("dro"), {"clip_epsilon": 0.2})


@pytest.mark.parametrize(
    ("name", "config", "match"),
    [
        ("ppo", {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2}, "not epsilons"),
        ("cispo", {"clip_low_threshold": 1.3}, "clip_low_threshold <= 1"),
        ("ppo", {"clip_high_threshold": float("nan")}, "not a finite number"),
        ("ppo", {"clip_high_threshold": "wide"}, "not a finite number"),
        ("dro", {"beta": -0.1}, "beta >= 0"),
    ],
)
def test_invalid_config_values_are_config_errors(name, config, match):
    lp, inputs = _rl_example()
    with pytest.raises(ConfigError, match=match):
        LOSSES[name].fn(lp, inputs, config)


def test_resolve_loss_config_merges_defaults_and_accepts_numeric_strings():
    # The SDK types loss_fn_config values as float | str.
    assert resolve_loss_config(get_loss("ppo"), {"clip_high_threshold": "1.28"}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
    }
    assert resolve_loss_config(get_loss("dro"), None) == {"beta": 0.05}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_metrics_are_finite_named_name_reduction_and_never_loss_sum(name):
    gen = torch.Generator().manual_seed(7)
    lp = -torch.rand(4, generator=gen, dtype=torch.float64)
    out = LOSSES[name].fn(lp, _random_inputs(name, 4, gen), {})
    assert isinstance(out, LossOutput) and out.loss.dim() == 0
    assert out.metrics and "loss:sum" not in out.metrics
    for key, value in out.metrics.items():
        metric, reduction = key.split(":")
        assert metric and reduction in {"sum", "mean", "max"}
        assert isinstance(value, float) and math.isfinite(value)
