"""``forward_backward_custom`` and ``create_custom_loss`` on the local backend, against the built-in losses.

A custom loss that computes the weighted negative log-likelihood is ``cross_entropy``: from the same start it
must give the same loss and, after one AdamW step, the same logprobs (fp32, 1e-6), in one pass and split into
micro-batches; a loss that couples datums (DPO's pairs) gets the same gradient either way.
"""

from __future__ import annotations

import math

import pytest
import torch
from tinker import types

from rlrunbook.backend import LocalServiceClient, LocalSettings
from rlrunbook.backend.custom_loss import CustomLossError
from rlrunbook.errors import ConfigError

SEQUENCES = [[5, 17, 42, 9, 11, 3, 7, 8], [5, 17, 42, 9, 30, 31, 32], [6, 2, 44, 12, 13, 14, 15, 16, 17]]
PROMPT = 4
ADAM = types.AdamParams(learning_rate=1e-2)


def _datum(sequence: list[int]) -> types.Datum:
    weights = [0.0] * (PROMPT - 1) + [1.0] * (len(sequence) - PROMPT)
    return types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=sequence[1:], dtype="int64",
                                                                         shape=[len(sequence) - 1]),
                                       "weights": types.TensorData(data=weights, dtype="float32",
                                                                   shape=[len(weights)])})


DATA = [_datum(s) for s in SEQUENCES]


def weighted_nll(data, logprobs):
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs, strict=True))
    return loss, {"custom/nll:sum": float(loss.detach())}


def _client(tmp_path, name: str, **settings):
    service = LocalServiceClient(LocalSettings(device="cpu", dtype=torch.float32, storage_dir=tmp_path / name,
                                               **settings))
    return service, service.create_lora_training_client("tiny", rank=4, seed=0)


def _logprobs_after_one_step(training, step) -> tuple[float, list[list[float]]]:
    out = step(training).result()
    training.optim_step(ADAM).result()
    after = training.forward(DATA, "cross_entropy").result()
    return out.metrics["loss:sum"], [o["logprobs"].tolist() for o in after.loss_fn_outputs]


def _close(a: list[list[float]], b: list[list[float]], tol: float) -> bool:
    return all(math.isclose(x, y, abs_tol=tol) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.parametrize("micro_batch_tokens", [None, 8])
def test_a_custom_weighted_nll_trains_exactly_as_cross_entropy(tmp_path, micro_batch_tokens):
    """8 tokens a micro-batch: each datum is its own micro-batch (the two-pass path)."""
    settings = {} if micro_batch_tokens is None else {"micro_batch_tokens": micro_batch_tokens}
    service_a, built_in = _client(tmp_path, "a")
    service_b, custom = _client(tmp_path, "b", **settings)
    try:
        before = built_in.forward(DATA, "cross_entropy").result()
        loss_a, after_a = _logprobs_after_one_step(built_in, lambda t: t.forward_backward(DATA, "cross_entropy"))
        out = custom.forward_backward_custom(DATA, weighted_nll).result()
        custom.optim_step(ADAM).result()
        after_b = [o["logprobs"].tolist() for o in custom.forward(DATA, "cross_entropy").result().loss_fn_outputs]
    finally:
        service_a.close()
        service_b.close()
    assert out.metrics["micro_batches:sum"] == (1 if micro_batch_tokens is None else 3)
    assert math.isclose(out.metrics["loss:sum"], loss_a, rel_tol=1e-6)
    assert out.metrics["custom/nll:sum"] == out.metrics["loss:sum"]
    # the logprobs the loss was given are those of the targets before the step
    assert _close([o["logprobs"].tolist() for o in out.loss_fn_outputs],
                  [o["logprobs"].tolist() for o in before.loss_fn_outputs], 1e-6)
    # one pass: the same arithmetic as cross_entropy; micro-batches sum the gradient in another order (Adam
    # then turns its last bits into ~1e-6 of logprob)
    assert _close(after_b, after_a, 1e-6 if micro_batch_tokens is None else 1e-5)
    assert not _close(after_b, [o["logprobs"].tolist() for o in before.loss_fn_outputs], 1e-4)  # the step moved them


def dpo_like(data, logprobs):
    """A loss that couples datums: the first sequence against the second (DPO's chosen and rejected)."""
    chosen, rejected = logprobs[0][PROMPT - 1:].sum(), logprobs[1][PROMPT - 1:].sum()
    loss = -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)) + 0.0 * logprobs[2].sum()
    return loss, {"custom/margin:mean": float((chosen - rejected).detach())}


def test_a_loss_that_couples_datums_gets_the_same_gradient_in_micro_batches(tmp_path):
    service_a, one_pass = _client(tmp_path, "a")
    service_b, split = _client(tmp_path, "b", micro_batch_tokens=8)
    try:
        before = [o["logprobs"].tolist() for o in one_pass.forward(DATA, "cross_entropy").result().loss_fn_outputs]
        _, after_a = _logprobs_after_one_step(one_pass, lambda t: t.forward_backward_custom(DATA, dpo_like))
        _, after_b = _logprobs_after_one_step(split, lambda t: t.forward_backward_custom(DATA, dpo_like))
    finally:
        service_a.close()
        service_b.close()
    assert _close(after_a, after_b, 1e-5)
    assert not _close(after_a, before, 1e-4)  # the loss moved the weights


def test_a_loss_handle_from_create_custom_loss_trains_as_the_callable(tmp_path):
    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    service_a, callable_client = _client(tmp_path, "a")
    service_b, handle_client = _client(tmp_path, "b")
    try:
        handle = service_b.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
        loss_a, after_a = _logprobs_after_one_step(callable_client,
                                                   lambda t: t.forward_backward_custom(DATA, weighted_nll))
        loss_b, after_b = _logprobs_after_one_step(handle_client, lambda t: t.forward_backward_custom(DATA, handle))
        with pytest.raises(ConfigError, match="another ServiceClient"):
            callable_client.forward_backward_custom(DATA, handle)
    finally:
        service_a.close()
        service_b.close()
    assert math.isclose(loss_a, loss_b, rel_tol=1e-6)
    assert _close(after_a, after_b, 1e-6)


@pytest.mark.parametrize(("loss_fn", "message"), [
    (lambda data, lps: (_ for _ in ()).throw(ValueError("boom")), "raised ValueError: boom"),
    (lambda data, lps: (torch.stack([lp.sum() for lp in lps]), {}), "must be a scalar tensor"),
    (lambda data, lps: (sum(lp.sum() for lp in lps) * float("nan"), {}), "is nan on this batch"),
    (lambda data, lps: (torch.tensor(1.0), {}), "does not depend on the logprobs"),
    (lambda data, lps: sum(lp.sum() for lp in lps), "must return (loss, metrics)"),
    (lambda data, lps: (sum(lp.sum() for lp in lps), {"x": "high"}), "metric 'x' = 'high', not a number"),
])
def test_a_failing_loss_fails_its_call_and_the_client_refuses_later_training(tmp_path, loss_fn, message):
    service, training = _client(tmp_path, "a")
    try:
        failed = training.forward_backward_custom(DATA, loss_fn)
        queued = training.optim_step(ADAM)  # submitted before the failure is known
        with pytest.raises(CustomLossError) as error:
            failed.result()
        assert message in str(error.value)
        with pytest.raises(ConfigError, match="stopped after a failed forward_backward_custom"):
            queued.result()
        with pytest.raises(ConfigError, match="stopped after a failed forward_backward_custom"):
            training.forward_backward(DATA, "cross_entropy").result()
    finally:
        service.close()
