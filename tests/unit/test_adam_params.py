"""An optim_step's AdamW hyperparameters are checked before anything is applied: a NaN, infinite or
out-of-range value is refused naming the field, and the weights stay as they were."""

from __future__ import annotations

import math

import pytest
import torch
from tinker import types

from rlrunbook.adam_params import check_adam_params
from rlrunbook.errors import InputError

GOOD = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0, grad_clip_norm=0.0)


@pytest.mark.parametrize(("field", "value"), [
    ("learning_rate", math.nan), ("learning_rate", math.inf), ("learning_rate", -1e30), ("learning_rate", -1e-9),
    ("learning_rate", 1.5), ("beta1", 1.0), ("beta2", -0.1), ("beta2", math.nan), ("eps", 0.0), ("eps", -1e-8),
    ("weight_decay", -0.01), ("weight_decay", math.inf), ("grad_clip_norm", -1.0), ("grad_clip_norm", math.nan),
])
def test_a_value_outside_its_rule_is_refused_naming_the_field(field, value):
    with pytest.raises(InputError, match=f"AdamParams.{field}="):
        check_adam_params(types.AdamParams(**{**GOOD, field: value}))


@pytest.mark.parametrize(("field", "value"), [
    ("learning_rate", 0.0), ("learning_rate", 1.0), ("beta1", 0.0), ("beta2", 0.999), ("eps", 1e-30),
    ("weight_decay", 0.1), ("grad_clip_norm", 1.0),
])
def test_the_edges_of_each_rule_are_accepted(field, value):
    check_adam_params(types.AdamParams(**{**GOOD, field: value}))


def test_a_refused_step_leaves_the_weights_and_the_next_step_works(local_service):
    """After one normal step, optim_step with lr NaN is refused at once and changes no weight."""
    from rlrunbook.backend.lora import adapter_parameters
    from rlrunbook.tokens import build_datum_arrays

    training = local_service.create_lora_training_client("tiny", rank=4, seed=0)
    arrays = build_datum_arrays([5, 17, 42, 9], [11, 12, 13])
    datum = types.Datum(model_input=types.ModelInput.from_ints(arrays.input_tokens),
                        loss_fn_inputs={"target_tokens": arrays.target_tokens, "weights": arrays.weights})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    training.forward_backward([datum], "cross_entropy").result()
    model = training._host.model
    before = {name: p.detach().clone() for name, p in adapter_parameters(model).items()}
    for bad in (math.nan, math.inf, -1e30):
        with pytest.raises(InputError, match="learning_rate"):
            training.optim_step(types.AdamParams(learning_rate=bad))
    after = adapter_parameters(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    loss = training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert math.isfinite(loss)
