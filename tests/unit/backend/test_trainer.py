"""The local trainer's loss_fn_config extension: KL to the base model, entropy bonus, clip, mismatch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tinker import types

from rlrunbook.backend.lora import adapter_parameters
from rlrunbook.engines.filters import SamplingFilters
from rlrunbook.engines.scoring import teacher_forced_logprobs
from rlrunbook.errors import ConfigError, InputError
from rlrunbook.tokens import build_datum_arrays

PROMPT = [5, 17, 42, 9, 11]
LENGTHS = (8, 5, 7, 3)  # unequal completions, so chunks pad differently
ADVANTAGES = (1.0, -1.0, 0.5, -0.25)


def rl_datum(completion, logprobs, advantage):
    a = build_datum_arrays(PROMPT, completion, logprobs, [advantage] * len(completion))
    return types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens),
                       loss_fn_inputs={"target_tokens": a.target_tokens, "logprobs": a.logprobs,
                                       "advantages": a.advantages})


def sft_datum(completion):
    a = build_datum_arrays(PROMPT, completion)
    return types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens),
                       loss_fn_inputs={"target_tokens": a.target_tokens, "weights": a.weights})


@pytest.fixture
def client(local_service):
    return local_service.create_lora_training_client("tiny", rank=4, seed=0)


@pytest.fixture
def rollouts(client):
    """(completion tokens, sampler logprobs) of four samples of the fresh adapter, of unequal lengths."""
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop=[])
    sampler = client.save_weights_and_get_sampling_client()
    sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    return [(list(s.tokens[:n]), list(s.logprobs[:n])) for s, n in zip(sequences, LENGTHS, strict=True)]


def rl_batch(rollouts):
    return [rl_datum(tokens, lps, adv) for (tokens, lps), adv in zip(rollouts, ADVANTAGES, strict=True)]


def train_steps(client, data, steps=2, lr=0.05):
    for _ in range(steps):
        client.forward_backward(data, "importance_sampling")
        client.optim_step(types.AdamParams(learning_rate=lr)).result()


def adapter_grads(client):
    return {n: p.grad.detach().clone() for n, p in adapter_parameters(client._host.model).items()}


def assert_grads_close(got, expected, rel):
    """Largest elementwise gap within ``rel`` of the largest entry (float32 sums reordered differ ~1e-6)."""
    for name in expected:
        scale = expected[name].abs().max().item()
        gap = (got[name] - expected[name]).abs().max().item()
        assert gap <= rel * scale, (name, gap, scale)


def completion_logprobs(output, rollouts):
    """The trainer's logprobs of each datum's completion tokens, concatenated."""
    n_prompt = len(PROMPT) - 1
    return torch.cat([r["logprobs"].to_torch()[n_prompt:n_prompt + len(tokens)]
                      for r, (tokens, _) in zip(output.loss_fn_outputs, rollouts, strict=True)])


def test_kl_is_zero_on_a_fresh_adapter_and_grows_with_training(client, rollouts):
    data = rl_batch(rollouts)
    config = {"kl_coef": 0.1, "kl_estimator": "k3"}
    fresh = client.forward_backward(data, "importance_sampling", config).result()
    # LoRA B starts at zero: policy == reference exactly, so every k3 term is e^0 - 0 - 1 = 0
    assert fresh.metrics["kl_divergence:mean"] == pytest.approx(0.0, abs=1e-7)
    assert fresh.metrics["loss_kl:sum"] == pytest.approx(0.0, abs=1e-7)
    client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    train_steps(client, data, steps=2)
    moved = client.forward(data, "importance_sampling", config).result()
    assert moved.metrics["kl_divergence:mean"] > 1e-3
    mean_kl = moved.metrics["kl_divergence:mean"]
    assert moved.metrics["loss_kl:sum"] == pytest.approx(0.1 * mean_kl * sum(LENGTHS), rel=1e-5)


def test_reference_is_the_base_model_and_the_adapter_comes_back(client, rollouts, tiny_host):
    data = rl_batch(rollouts)
    train_steps(client, data)
    plain = client.forward(data, "importance_sampling").result()
    with_kl = client.forward(data, "importance_sampling", {"kl_coef": 1.0, "kl_estimator": "k1"}).result()
    # k1 = lp - ref, so its mean is mean(trainer lp) - mean(base lp) over the trained (completion) tokens;
    # the base logprobs come from an independent plain copy of tiny, never wrapped in LoRA.
    sequences = [PROMPT + tokens for tokens, _ in rollouts]
    base = torch.cat([lp[len(PROMPT) - 1:] for lp in teacher_forced_logprobs(tiny_host.model, sequences, 0)])
    trainer_lp = completion_logprobs(plain, rollouts)
    assert (trainer_lp - base).abs().max() > 1e-2, "training should have moved the policy off the base"
    assert with_kl.metrics["kl_divergence:mean"] == pytest.approx((trainer_lp - base).mean().item(), abs=1e-5)
    # the adapter is active again after the reference pass: same logprobs as without the extension
    for a, b in zip(plain.loss_fn_outputs, with_kl.loss_fn_outputs, strict=True):
        assert torch.equal(a["logprobs"].to_torch(), b["logprobs"].to_torch())
    # position by position; no graph back to the adapter even with grad enabled (base weights are frozen
    # and the adapter bypassed, so this holds with or without the no_grad the trainer adds to save memory)
    tokens = sequences[0]
    item = SimpleNamespace(input_tokens=tokens[:-1], targets=torch.tensor(tokens[1:]),
                           mask=torch.ones(len(tokens) - 1, dtype=torch.bool))
    with torch.enable_grad():
        scores = client._trainer.scoring.score([item], SamplingFilters(), with_entropy=False, with_reference=True)
    ref = scores.seen_reference
    assert not ref.requires_grad
    assert all(p.grad is None for p in adapter_parameters(client._host.model).values())
    expected = teacher_forced_logprobs(tiny_host.model, sequences[:1], 0)[0]
    assert torch.allclose(ref, expected, atol=1e-5)


def test_k1_gradient_is_scaled_cross_entropy(client, rollouts):
    """CE + c*k1 = -sum lp + c*sum(lp - ref) = -(1 - c) sum lp + const: the gradient is (1 - c) * CE's."""
    train_steps(client, rl_batch(rollouts))
    data = [sft_datum(tokens) for tokens, _ in rollouts]
    before = {n: p.detach().clone() for n, p in adapter_parameters(client._host.model).items()}
    client.forward_backward(data, "cross_entropy").result()
    ce = adapter_grads(client)
    client._host.model.zero_grad(set_to_none=True)
    out = client.forward_backward(data, "cross_entropy", {"kl_coef": 0.25, "kl_estimator": "k1"}).result()
    scaled = adapter_grads(client)
    assert_grads_close(scaled, {n: 0.75 * g for n, g in ce.items()}, rel=1e-5)
    for name in ce:
        assert torch.equal(before[name], client._host.model.get_parameter(name).detach()), name
    # only the completion tokens (weight 1) are regularized, not the prompt positions (weight 0)
    mean_kl = out.metrics["kl_divergence:mean"]
    assert out.metrics["loss_kl:sum"] == pytest.approx(0.25 * sum(LENGTHS) * mean_kl, rel=1e-5)


def test_gradient_equals_autograd_of_hand_assembled_total(client, rollouts, tiny_host):
    train_steps(client, rl_batch(rollouts))
    tokens = rollouts[0][0]
    kl_coef, entropy_coef = 0.3, 0.05
    config = {"kl_coef": kl_coef, "kl_estimator": "k3", "entropy_coef": entropy_coef}
    out = client.forward_backward([sft_datum(tokens)], "cross_entropy", config).result()
    trainer_grads = adapter_grads(client)
    client._host.model.zero_grad(set_to_none=True)

    # By hand: completion positions only; logits at position i predict token i + 1.
    ids = torch.tensor([PROMPT + tokens])
    start = len(PROMPT) - 1
    targets = ids[0, start + 1:]
    logits = client._host.model(input_ids=ids[:, :-1]).logits[0, start:]  # [T, V]
    log_p = torch.log_softmax(logits.float(), dim=-1)
    lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        ref_logits = tiny_host.model(input_ids=ids[:, :-1]).logits[0, start:]  # the plain base model
        ref_log_p = torch.log_softmax(ref_logits.float(), dim=-1)
    ref = ref_log_p.gather(-1, targets[:, None]).squeeze(-1)
    k3 = torch.exp(ref - lp) - (ref - lp) - 1
    entropy = -(log_p.exp() * log_p).sum(-1)
    total = -lp.sum() + kl_coef * k3.sum() - entropy_coef * entropy.sum()
    total.backward()
    assert_grads_close(trainer_grads, adapter_grads(client), rel=1e-5)
    m = out.metrics
    assert m["loss_pg:sum"] == pytest.approx(-lp.sum().item(), rel=1e-5)
    assert m["loss_kl:sum"] == pytest.approx(kl_coef * k3.sum().item(), rel=1e-4)
    assert m["loss_entropy:sum"] == pytest.approx(-entropy_coef * entropy.sum().item(), rel=1e-5)
    assert m["kl_divergence:mean"] == pytest.approx(k3.mean().item(), rel=1e-4)
    assert m["entropy:mean"] == pytest.approx(entropy.mean().item(), rel=1e-5)
    assert m["loss:sum"] == pytest.approx(total.item(), rel=1e-5)
    parts = m["loss_pg:sum"] + m["loss_kl:sum"] + m["loss_entropy:sum"]
    assert m["loss:sum"] == pytest.approx(parts, rel=1e-6)


@pytest.mark.parametrize("loss", ["ppo", "cross_entropy"])
def test_chunked_equals_unchunked(client, rollouts, loss):
    train_steps(client, rl_batch(rollouts))
    if loss == "ppo":
        data, config = rl_batch(rollouts), {"kl_coef": 0.2, "entropy_coef": 0.01, "clip_high_threshold": 1.1}
        expected = {"clip_fraction:mean", "mismatch/abs_logprob_diff:mean", "mismatch/kl:mean"}
    else:  # regularized positions (weight 1) are fewer than the loss's (all): means weigh by their own count
        data, config = [sft_datum(tokens) for tokens, _ in rollouts], {"kl_coef": 0.2, "entropy_coef": 0.01}
        expected = set()
    expected |= {"loss:sum", "loss_pg:sum", "loss_kl:sum", "loss_entropy:sum", "kl_divergence:mean",
                 "entropy:mean"}
    whole = client.forward_backward(data, loss, config).result()
    grads_whole = adapter_grads(client)
    client._host.model.zero_grad(set_to_none=True)
    client._trainer.grad_accum_chunks = 2
    chunked = client.forward_backward(data, loss, config).result()
    assert_grads_close(adapter_grads(client), grads_whole, rel=1e-5)
    assert expected <= set(whole.metrics) and set(whole.metrics) == set(chunked.metrics)
    # Two chunks share their prompt in other attention layouts, so fp32 logprobs differ by ~1e-7-1e-6 per
    # token; a loss summed over ~25 tokens with |advantage| <= 1 (which cancel) moves by <= 25 * 4e-7 = 1e-5.
    assert (whole.metrics["micro_batches:sum"], chunked.metrics["micro_batches:sum"]) == (1, 2)  # the split itself
    for key, value in whole.metrics.items():
        if not key.startswith("micro_batch"):
            assert chunked.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert whole.metrics["kl_divergence:mean"] > 0


def test_metrics_when_the_extension_is_off(client, rollouts):
    out = client.forward(rl_batch(rollouts), "importance_sampling").result()
    m = out.metrics
    assert "kl_divergence:mean" not in m and "entropy:mean" not in m
    assert (m["loss_kl:sum"], m["loss_entropy:sum"]) == (0.0, 0.0)
    assert m["loss:sum"] == pytest.approx(m["loss_pg:sum"], rel=1e-6)
    sft = client.forward([sft_datum(rollouts[0][0])], "cross_entropy").result().metrics
    assert "clip_fraction:mean" not in sft and "mismatch/kl:mean" not in sft  # no sampler logprobs to compare


@pytest.mark.parametrize("config, match", [
    ({"kl_coef": -1.0}, r"kl_coef.*>= 0.*0 switches the term off"),
    ({"kl_coef": 0.1, "kl_estimator": "k9"}, r"unknown kl_estimator 'k9'; pass one of: k1, k3, low_var_kl"),
    ({"entropy_coef": -0.01}, r"entropy_coef.*>= 0"),
    ({"kl_coeff": 0.1}, r"kl_coeff.*not used by loss"),
])
def test_bad_extension_config_trains_nothing(client, rollouts, config, match):
    with pytest.raises(ConfigError, match=match):
        client.forward_backward(rl_batch(rollouts), "importance_sampling", config).result()
    assert all(p.grad is None for p in adapter_parameters(client._host.model).values())
    with pytest.raises(InputError, match="forward_backward first"):
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_mismatch_and_clip_fraction_by_hand(client, rollouts):
    own = completion_logprobs(client.forward(rl_batch(rollouts), "importance_sampling").result(), rollouts)

    def metrics_with_sampler_shift(shift, loss="importance_sampling", config=None):
        # sampler logprobs q = lp - shift on every completion token: d = lp - q = shift, ratio e^shift
        q, data, start = own - shift, [], 0
        for (tokens, _), adv in zip(rollouts, ADVANTAGES, strict=True):
            data.append(rl_datum(tokens, q[start:start + len(tokens)].tolist(), adv))
            start += len(tokens)
        return client.forward(data, loss, config).result().metrics

    same = metrics_with_sampler_shift(0.0)
    assert same["mismatch/abs_logprob_diff:mean"] == pytest.approx(0.0, abs=1e-6)
    assert same["mismatch/kl:mean"] == pytest.approx(0.0, abs=1e-6)
    assert same["clip_fraction:mean"] == 0.0
    # shift 0.1: |d| = 0.1, k3 = e^0.1 - 0.1 - 1 = 0.0051709, ratio 1.105 inside [0.8, 1.2]
    small = metrics_with_sampler_shift(0.1)
    assert small["mismatch/abs_logprob_diff:mean"] == pytest.approx(0.1, abs=1e-5)
    assert small["mismatch/kl:mean"] == pytest.approx(math.exp(0.1) - 1.1, abs=1e-5)
    assert small["clip_fraction:mean"] == 0.0
    # shift -0.3: ratio e^-0.3 = 0.741 < 0.8 for every token; ppo's own lower bound 0.7 keeps them all inside
    assert metrics_with_sampler_shift(-0.3)["clip_fraction:mean"] == 1.0
    ppo = metrics_with_sampler_shift(-0.3, "ppo", {"clip_low_threshold": 0.7})
    assert ppo["clip_fraction:mean"] == 0.0
    assert ppo["mismatch/kl:mean"] == pytest.approx(math.exp(-0.3) + 0.3 - 1, abs=1e-5)


def _with_sampler_logprobs(rollouts, q, advantages=ADVANTAGES, per_token_advantages=None):
    data, start = [], 0
    for i, ((tokens, _), adv) in enumerate(zip(rollouts, advantages, strict=True)):
        n = len(tokens)
        token_adv = [adv] * n if per_token_advantages is None else per_token_advantages[start:start + n].tolist()
        a = build_datum_arrays(PROMPT, tokens, q[start:start + n].tolist(), token_adv)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(a.input_tokens), loss_fn_inputs={
            "target_tokens": a.target_tokens, "logprobs": a.logprobs, "advantages": a.advantages}))
        start += n
    return data


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_truncated_importance_correction_by_hand(client, rollouts, loss):
    """Every other token was drawn by a sampler that gave it a third of the trainer's probability:
    p / q = 3, capped at 2; the rest agree (p / q = 1). With is_correction=truncate the gradient is
    that of the same loss with q := the trainer's own logprobs and advantages x (2, 1, 2, 1, ...)."""
    train_steps(client, rl_batch(rollouts))  # move off the fresh adapter so gradients are generic
    own = completion_logprobs(client.forward(rl_batch(rollouts), loss).result(), rollouts)
    shifted = torch.arange(len(own)) % 2 == 0
    q = own - shifted.float() * math.log(3.0)
    advantages = torch.cat([torch.full((len(tokens),), adv) for (tokens, _), adv in zip(rollouts, ADVANTAGES,
                                                                                         strict=True)])
    client._host.model.zero_grad(set_to_none=True)
    out = client.forward_backward(_with_sampler_logprobs(rollouts, q), loss, {"is_correction": "truncate"}).result()
    corrected = adapter_grads(client)
    assert out.metrics["mismatch/corrected_fraction:mean"] == pytest.approx(shifted.float().mean().item())
    assert out.metrics["mismatch/abs_logprob_diff:mean"] == pytest.approx(
        shifted.float().mean().item() * math.log(3.0), abs=1e-5)
    assert out.metrics["clip_fraction:mean"] == 0.0, "the loss's ratio is the trainer's own: exactly 1"
    client._host.model.zero_grad(set_to_none=True)
    weights = torch.where(shifted, 2.0, 1.0)
    client.forward_backward(_with_sampler_logprobs(rollouts, own, per_token_advantages=advantages * weights),
                            loss).result()
    assert_grads_close(corrected, adapter_grads(client), rel=1e-5)
    client._host.model.zero_grad(set_to_none=True)


def test_mask_correction_drops_tokens_outside_the_bounds(client, rollouts):
    """p / q = 10 on every third token: outside [1/8, 8], so those tokens carry no gradient."""
    own = completion_logprobs(client.forward(rl_batch(rollouts), "importance_sampling").result(), rollouts)
    far = torch.arange(len(own)) % 3 == 0
    advantages = torch.cat([torch.full((len(tokens),), adv) for (tokens, _), adv in zip(rollouts, ADVANTAGES,
                                                                                         strict=True)])
    out = client.forward_backward(_with_sampler_logprobs(rollouts, own - far.float() * math.log(10.0)),
                                  "importance_sampling", {"is_correction": "mask"}).result()
    masked = adapter_grads(client)
    assert out.metrics["mismatch/corrected_fraction:mean"] == pytest.approx(far.float().mean().item())
    client._host.model.zero_grad(set_to_none=True)
    client.forward_backward(_with_sampler_logprobs(rollouts, own, per_token_advantages=advantages * (~far).float()),
                            "importance_sampling").result()
    assert_grads_close(masked, adapter_grads(client), rel=1e-5)
    client._host.model.zero_grad(set_to_none=True)


def test_mismatch_compares_like_with_like_under_temperature(client):
    """Sampled at T = 0.7 with top-p 0.9: told the transform, the trainer agrees with the sampler (fp32);
    comparing its T = 1 logprobs instead (the Tinker loss's ratio) is off by far more."""
    params = types.SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=5, stop=[])
    sampler = client.save_weights_and_get_sampling_client()
    sequences = sampler.sample(types.ModelInput.from_ints(PROMPT), 4, params).result().sequences
    rollouts = [(list(s.tokens), list(s.logprobs)) for s in sequences]
    data = [rl_datum(tokens, lps, 1.0) for tokens, lps in rollouts]
    told = client.forward(data, "importance_sampling", {"sampling_temperature": 0.7, "sampling_top_p": 0.9}).result()
    assert told.metrics["mismatch/abs_logprob_diff:mean"] <= 1e-5
    untold = client.forward(data, "importance_sampling").result()
    assert untold.metrics["mismatch/abs_logprob_diff:mean"] > 0.1
    for output, (tokens, lps) in zip(told.loss_fn_outputs, rollouts, strict=True):
        values = output["sampling_logprobs"].to_torch()
        assert torch.allclose(values[-len(tokens):], torch.tensor(lps), atol=1e-5)
        assert torch.isnan(values[:-len(tokens)]).all(), "NaN where the loss does not read"


@pytest.mark.parametrize("config, match", [
    ({"is_correction": "clip"}, "is_correction"),
    ({"is_correction": "truncate", "is_cap": 0.5}, "is_cap"),
    ({"is_correction": "mask", "is_mask_low": 2.0}, "is_mask_low"),
    ({"sampling_temperature": "hot"}, "sampling_temperature"),
])
def test_bad_mismatch_config_is_named(client, rollouts, config, match):
    with pytest.raises(ConfigError, match=match):
        client.forward(rl_batch(rollouts), "importance_sampling", config).result()
