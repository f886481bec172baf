"""Projections that read one input (q/k/v, gate/up) run as one product over their stacked base weights
(engines/stacked_projections.py, Decoder.linears).

What must hold: the numbers do not change (each output column is the same dot product, so on CPU the
stacked product equals the module-by-module one to the bit), the model's weights become views of the
stack (no second copy; transformers' own forward still reads them), every Decoder of a model shares
one stack, a replaced weight is stacked again, and a trainable base weight is never stacked (its
gradient would be lost).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from rlrunbook.engines.decoder import Decoder
from rlrunbook.engines.stacked_projections import stackable, stacked_weights

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_model(tiny_folder, dtype=torch.float32):
    from rlrunbook.models import load_causal_lm

    torch.manual_seed(0)
    model = get_peft_model(load_causal_lm(tiny_folder, dtype=dtype),
                           LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for name, param in model.named_parameters():  # B starts at zero: move it so the adapters count
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.5)
    return model


def _groups(model):
    for layer in model.get_base_model().model.layers:
        yield (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        yield (layer.mlp.gate_proj, layer.mlp.up_proj)


@pytest.mark.parametrize("numerics", ["invariant", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stacked_products_equal_module_by_module_bitwise(tiny_folder, dtype, numerics):
    model = _lora_model(tiny_folder, dtype)
    decoder = Decoder(model, numerics)
    x = torch.randn(5, model.config.hidden_size, dtype=dtype)
    with torch.no_grad():
        for modules in _groups(model):
            alone = [decoder.linear(module, x) for module in modules]
            stacked = decoder.linears(modules, x)
            assert all(torch.equal(a, b) for a, b in zip(alone, stacked, strict=True))
            for a, module in zip(alone, modules, strict=True):  # as peft computes: F.linear's own kernels
                expected = module(x)
                if numerics == "native":
                    assert torch.equal(a, expected)
                else:  # the fixed-order kernels: the same sums to the dtype's rounding
                    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
                    assert torch.allclose(a.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_weights_become_views_of_one_stack_shared_by_every_decoder(tiny_folder):
    model = _lora_model(tiny_folder)
    ids = torch.tensor([[1, 285, 201, 279, 261, 223]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        first, second = Decoder(model), Decoder(model)
        x = torch.randn(3, model.config.hidden_size)
        group = next(_groups(model))
        q, k, v = (m.base_layer for m in group)
        first.linears(group, x)
        pointers = [m.weight.data_ptr() for m in (q, k, v)]
        second.linears(group, x)
        assert [m.weight.data_ptr() for m in (q, k, v)] == pointers, "a second decoder must not re-stack"
        row_bytes = q.weight.shape[1] * q.weight.element_size()
        assert pointers[1] - pointers[0] == q.out_features * row_bytes  # k's rows follow q's in one matrix
        assert pointers[2] - pointers[1] == k.out_features * row_bytes
        for modules in _groups(model):
            first.linears(modules, x)
        assert torch.equal(model(input_ids=ids).logits, before), "transformers' forward reads the same weights"


def test_a_replaced_weight_is_stacked_again(tiny_folder):
    model = _lora_model(tiny_folder)
    decoder = Decoder(model)
    group = next(_groups(model))
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        decoder.linears(group, x)
        group[1].base_layer.weight.data = torch.zeros_like(group[1].base_layer.weight)  # e.g. weights loaded anew
        k = decoder.linears(group, x)[1]
    lora = group[1]
    expected = lora.lora_B["default"](lora.lora_A["default"](x)) * lora.scaling["default"]
    assert torch.allclose(k, expected, atol=1e-6), "the new (zero) base weight must be what runs"


def test_trainable_base_weights_are_not_stacked_and_get_gradients(tiny_folder):
    from rlrunbook.models import load_causal_lm

    model = load_causal_lm(tiny_folder, dtype=torch.float32)  # no adapter: full fine-tuning
    decoder = Decoder(model)
    attn = model.model.layers[0].self_attn
    assert not stackable([attn.q_proj, attn.k_proj, attn.v_proj])
    x = torch.randn(3, model.config.hidden_size)
    q, k, v = decoder.linears((attn.q_proj, attn.k_proj, attn.v_proj), x)
    (q.sum() + k.sum() + v.sum()).backward()
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):  # d(sum W x)/dW: every row is the sum of x's rows
        assert torch.allclose(module.weight.grad, x.sum(0).expand_as(module.weight), atol=1e-6)


def test_biases_are_stacked_with_their_weights():
    torch.manual_seed(1)
    modules = [torch.nn.Linear(8, n, bias=True).requires_grad_(False) for n in (8, 4, 4)]
    x = torch.randn(3, 8)
    alone = torch.cat([m(x) for m in modules], dim=1)
    weight, bias = stacked_weights(modules)
    assert weight.shape == (16, 8) and bias.shape == (16,)
    # The biases' layout and values; bitwise agreement of the products is the test above's, at the model's shapes
    # (at toy shapes like these MKL may pick kernels for the 16-row and 4-row matrices that round differently in
    # the last bit: seen on an Intel Xeon, not on an AMD EPYC).
    torch.testing.assert_close(torch.nn.functional.linear(x, weight, bias), alone, rtol=1e-6, atol=1e-6)
    assert torch.equal(bias, torch.cat([m.bias for m in modules]))
    assert modules[1].bias.data_ptr() == modules[0].bias.data_ptr() + 8 * 4


def test_mixed_groups_are_not_stackable():
    with_bias = torch.nn.Linear(8, 4, bias=True).requires_grad_(False)
    without = torch.nn.Linear(8, 4, bias=False).requires_grad_(False)
    other_input = torch.nn.Linear(6, 4, bias=False).requires_grad_(False)
    half = torch.nn.Linear(8, 4, bias=False).requires_grad_(False).to(torch.bfloat16)
    assert not stackable([with_bias, without])
    assert not stackable([without, other_input])
    assert not stackable([without, half])
    assert stackable([without, torch.nn.Linear(8, 2, bias=False).requires_grad_(False)])
