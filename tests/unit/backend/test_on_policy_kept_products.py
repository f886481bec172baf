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


def _two_calls(settings: LocalSettings) -> tuple[list, list, object]:
    """Two ``forward_backward`` calls over one sampled batch, no optimizer step between: their outputs, the adapter's
    gradient after each, and the engine's kept products after the first."""
    with LocalServiceClient(settings) as service:
        training = service.create_lora_training_client("tiny", rank=4, seed=0)
        data = _rl_batch(training.save_weights_and_get_sampling_client())
        outputs, grads, kept = [], [], None
        for _ in range(2):
            outputs.append(training.forward_backward(data, "importance_sampling").result())
            grads.append([p.grad.clone() for p in training._trainer.trained_parameters().values()])
            kept = kept or training._host.engine.kept
        return outputs, grads, (kept, [datum.model_input.to_ints() for datum in data])


def test_the_last_pass_of_a_forward_backward_frees_the_kept_products_and_a_later_call_computes(settings):
    """A batch in several micro-batches: every pass reads the kept products, the last frees them as it reads them,
    and a second ``forward_backward`` over the same data before the optimizer step computes its products: both
    calls give the bits of calls that compute every product."""
    from rlrunbook.backend.micro_batches import micro_batches

    split = dataclasses.replace(settings, micro_batch_tokens=24)
    outputs, grads, (kept, sequences) = _two_calls(split)
    expected_outputs, expected_grads, _ = _two_calls(dataclasses.replace(split, kept_products_mb=0))
    batches = micro_batches(sequences, 24)
    distinct = sum(len({tuple(s[:end]) for s in sequences[b.start:b.stop] for end in range(1, len(s) + 1)})
                   for b in batches)
    assert len(batches) > 1 and outputs[0].metrics["micro_batches:sum"] == len(batches)
    assert outputs[0].metrics["kept_product_tokens:sum"] == distinct  # every pass read them
    assert kept.released and outputs[1].metrics["kept_product_tokens:sum"] == 0  # the last freed them
    for output, expected in zip(outputs, expected_outputs, strict=True):
        assert ([o["logprobs"].tolist() for o in output.loss_fn_outputs]
                == [o["logprobs"].tolist() for o in expected.loss_fn_outputs])
    for got, expected in zip(grads, expected_grads, strict=True):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("micro_batch_tokens", [None, 24], ids=["one-pass", "micro-batches"])
def test_a_custom_loss_reads_the_kept_products_in_its_passes_with_gradients_and_frees_them(settings,
                                                                                         micro_batch_tokens,
                                                                                         monkeypatch):
    """``forward_backward_custom``: each pass with gradients reads the kept products (in micro-batches, after the
    passes without gradients), the last frees them; the gradient is the bits of a call that computes every
    product."""
    from rlrunbook.backend.chunk_scores import SharedPrefixScoring

    read: list[int] = []  # per pass with gradients, the tokens it read
    score = SharedPrefixScoring._score

    def counted(self, *args):
        result = score(self, *args)
        if torch.is_grad_enabled():
            read.append(self.kept_tokens)
        return result

    monkeypatch.setattr(SharedPrefixScoring, "_score", counted)

    def gradient(kept_mb: int):
        with LocalServiceClient(dataclasses.replace(settings, kept_products_mb=kept_mb,
                                                    micro_batch_tokens=micro_batch_tokens)) as service:
            training = service.create_lora_training_client("tiny", rank=4, seed=0)
            data = _rl_batch(training.save_weights_and_get_sampling_client())
            kept = training._host.engine.kept
            training.forward_backward_custom(
                data, lambda data, logprobs: (sum((lp * (i + 1)).sum() for i, lp in enumerate(logprobs)), {})).result()
            return [p.grad.clone() for p in training._trainer.trained_parameters().values()], kept

    grads, kept = gradient(4096)
    passes = len(read)
    expected, _ = gradient(0)
    assert kept is not None and kept.released
    assert (passes == 1) == (micro_batch_tokens is None) and all(read[:passes])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))
