"""Runbook §§0, 8 on the training side: a GPU step has a learning signal and moves only the adapter.

Through the public local backend (``LocalServiceClient`` on ``cuda``, bf16 by default): sample a
group, centre a reward with spread into advantages, ``forward_backward`` with
``importance_sampling``, ``optim_step``. Then the base weights are bit-identical and the LoRA
weights moved; a group whose advantages are all zero is refused with NoLearningSignalError.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_support import DEVICE, chat_prompts
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.errors import NoLearningSignalError
from rlrunbook.tokens import build_datum_arrays

pytestmark = pytest.mark.gpu

GROUP = 8
MAX_TOKENS = 24


def _datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    arrays = build_datum_arrays(prompt, tokens, logprobs, [advantage] * len(tokens))
    return types.Datum(
        model_input=types.ModelInput.from_ints(arrays.input_tokens),
        loss_fn_inputs={"target_tokens": arrays.target_tokens, "logprobs": arrays.logprobs,
                        "advantages": arrays.advantages},
    )


@pytest.fixture
def training_client(model_name, tmp_path):
    service = LocalServiceClient(LocalSettings(device=DEVICE, storage_dir=tmp_path / "tinker"))
    yield service.create_lora_training_client(model_name, rank=8, seed=0)
    service.close()
    torch.cuda.empty_cache()


def _group(training_client):
    """One sampled group: the prompt and its completions (tokens, logprobs)."""
    prompt = chat_prompts(training_client.get_tokenizer(), 2)[1]
    sampler = training_client.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0)
    response = sampler.sample(types.ModelInput.from_ints(prompt), GROUP, params).result()
    return prompt, [(list(map(int, s.tokens)), list(map(float, s.logprobs))) for s in response.sequences]


def test_step_trains_the_adapter_only(training_client, record_property):
    """Non-zero advantages give trained tokens, a finite loss and gradient; only LoRA weights change."""
    prompt, samples = _group(training_client)
    # Reward with spread whatever the model: length plus distinct tokens (a random model rarely
    # emits EOS, so length alone is often constant across the group).
    rewards = [len(tokens) + len(set(tokens)) / 100 for tokens, _ in samples]
    mean = sum(rewards) / len(rewards)
    advantages = [r - mean for r in rewards]
    assert any(a != 0 for a in advantages), f"rewards {rewards} have no spread; pick another seed"
    data = [_datum(prompt, t, lp, a) for (t, lp), a in zip(samples, advantages, strict=True)]

    # The one white-box reach: the live peft model, to compare weights before and after.
    model = training_client._host.model
    assert next(model.parameters()).device.type == DEVICE
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    out = training_client.forward_backward(data, "importance_sampling").result()
    step = training_client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    metrics = {**out.metrics, **step.metrics}
    for key, value in metrics.items():
        record_property(key, value)

    expected_trained = sum(len(t) for (t, _), a in zip(samples, advantages, strict=True) if a != 0)
    assert metrics["num_trained_tokens:sum"] == expected_trained > 0
    assert math.isfinite(metrics["loss:sum"])
    # With centred advantages and equal lengths the loss is ~0 at ratio 1; its gradient is not.
    assert math.isfinite(metrics["grad_norm:mean"]) and metrics["grad_norm:mean"] > 0
    # Sampler and learner agree on the sampled tokens (bf16): mean ratio ~1, see test_gpu_1's tolerances.
    ratio = metrics["ratio:mean"]
    assert abs(ratio - 1) < 0.05, f"sampler/learner mismatch: ratio:mean {ratio}"

    after = dict(model.named_parameters())
    base = [n for n in before if "lora_" not in n]
    lora_b = [n for n in before if "lora_B" in n]
    assert base and lora_b
    moved_base = [n for n in base if not torch.equal(before[n], after[n])]
    assert moved_base == [], f"base weights changed: {moved_base[:5]}"
    still_b = [n for n in lora_b if torch.equal(before[n], after[n])]
    assert still_b == [], f"LoRA B weights did not move: {still_b[:5]}"


def test_zero_advantages_are_refused(training_client):
    """A group with all-zero advantages raises NoLearningSignalError instead of a silent no-op step."""
    prompt, samples = _group(training_client)
    data = [_datum(prompt, t, lp, 0.0) for t, lp in samples]
    with pytest.raises(NoLearningSignalError, match="No non-zero advantages"):
        training_client.forward_backward(data, "importance_sampling").result()


def _weighted_nll(data, logprobs):
    """``cross_entropy`` as a Tinker user writes it: the logprobs times the datum's weights (a CPU tensor)."""
    assert all(lp.device.type == "cpu" and lp.dtype == torch.float32 for lp in logprobs), \
        "the SDK hands a custom loss float32 CPU tensors"
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
    return loss, {}


def test_custom_loss_written_for_tinker_trains_on_the_gpu(training_client):
    """``forward_backward_custom`` on CUDA: the loss gets CPU logprobs as the SDK gives them, its value is the
    built-in ``cross_entropy``'s on the same batch, and its gradient reaches the adapter on the GPU."""
    prompt, samples = _group(training_client)
    data = []
    for tokens, _ in samples:
        arrays = build_datum_arrays(prompt, tokens)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights}))
    builtin = training_client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    model = training_client._host.model
    for p in model.parameters():  # the built-in call's gradient is not part of what is checked next
        p.grad = None
    custom = training_client.forward_backward_custom(data, _weighted_nll).result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin, rel=1e-4)
    grads = [p.grad for name, p in model.named_parameters() if "lora_B" in name]
    assert grads and all(g is not None and g.device.type == DEVICE for g in grads)
    assert sum(float(g.float().norm()) for g in grads) > 0
