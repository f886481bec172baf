"""The local backend's on-policy step reads the sampler's kept base products (engines/kept_products.py): a
``forward_backward`` over the tokens just sampled, before any ``optim_step``, gives the bits of one that computes
every product (``TINKER_LOCAL_KEPT_PRODUCTS_MB=0``), and a step whose weights moved computes them again."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.tokens import build_datum_arrays

PROMPTS = ([5, 17, 42, 9, 11, 300, 7], [5, 17, 42, 8])
PARAMS = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3)


@pytest.fixture
def settings(tmp_path):
    return LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / "tinker")


def _rl_batch(sampler) -> list[types.Datum]:
    data = []
    for prompt in PROMPTS:
        for index, sequence in enumerate(sampler.sample(types.ModelInput.from_ints(prompt), 3, PARAMS).result()
                                         .sequences):
            tokens = list(sequence.tokens)
            arrays = build_datum_arrays(prompt, tokens, list(sequence.logprobs), [index - 1.0] * len(tokens))
            data.append(types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                                    loss_fn_inputs={"target_tokens": arrays.target_tokens,
                                                    "logprobs": arrays.logprobs, "advantages": arrays.advantages}))
    return data


def _steps(settings: LocalSettings, config: dict | None, steps: int = 2) -> tuple[list, list[int]]:
    """Per step: the logprobs ``forward_backward`` returned and the adapter's gradient; and how many tokens of its
    last pass read kept products."""
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        results, read = [], []
        for _ in range(steps):
            data = _rl_batch(training.save_weights_and_get_sampling_client())
            output = training.forward_backward(data, "importance_sampling", config).result()
            read.append(output.metrics["kept_product_tokens:sum"])
            grads = [p.grad.clone() for p in training._trainer.trained_parameters().values()]
            results.append(([o["logprobs"].tolist() for o in output.loss_fn_outputs], grads))
            training.optim_step(types.AdamParams(learning_rate=0.05)).result()
        return results, read


@pytest.mark.parametrize("config", [None, {"kl_coef": 0.05}], ids=["plain", "kl"])  # KL: a reference pass too
def test_an_on_policy_step_reads_the_kept_products_with_the_same_bits(settings, config):
    kept, read = _steps(settings, config)
    computed, none_read = _steps(dataclasses.replace(settings, kept_products_mb=0), config)
    assert all(count > 0 for count in read) and none_read == [0, 0]
    for (logprobs, grads), (expected_logprobs, expected_grads) in zip(kept, computed, strict=True):
        assert logprobs == expected_logprobs
        assert all(torch.equal(got, expected) for got, expected in zip(grads, expected_grads, strict=True))


def test_a_step_after_the_weights_moved_computes_its_products(settings):
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        data = _rl_batch(training.save_weights_and_get_sampling_client())
        on_policy = training.forward_backward(data, "importance_sampling").result()
        assert on_policy.metrics["kept_product_tokens:sum"] > 0
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
        first = training.forward_backward(data, "importance_sampling").result()  # the weights moved: computed
        assert first.metrics["kept_product_tokens:sum"] == 0
        assert training._host.engine.kept is None  # freed by the step: no pass could read them any more
    with LocalServiceClient(dataclasses.replace(settings, kept_products_mb=0)) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        training.forward_backward(data, "importance_sampling").result()
        training.optim_step(types.AdamParams(learning_rate=0.05)).result()
        expected = training.forward_backward(data, "importance_sampling").result()
    assert ([o["logprobs"].tolist() for o in first.loss_fn_outputs]
            == [o["logprobs"].tolist() for o in expected.loss_fn_outputs])
