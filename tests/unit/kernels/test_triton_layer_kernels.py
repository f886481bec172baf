"""A layer's single kernels on CUDA (Triton: the norm, the rotation, the gated activation, a LoRA update added to its
base product), run on this CPU under ``TRITON_INTERPRET=1``: their arithmetic against the chain of operations they
replace, and a decode step equal to the training pass through them, with the kernels a decode step runs counted.

Interpreted, float32 steps are numpy's IEEE arithmetic, so in float32 the rotation and the LoRA addition give the
chain's bits here; the interpreter rounds float32 to bfloat16 by truncation (a GPU rounds to nearest), so in bfloat16
they are compared to within a bfloat16 ulp. On a GPU the trainer and the sampler run the same kernels, which is what
their agreement rests on there (the GPU tier checks it). Needs triton (installed by scripts/setup.sh on Linux with a
CPU torch).
"""

from __future__ import annotations

import collections
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # set by conftest.py where there is no CUDA, before triton loads
    pytest.skip("on a machine with CUDA the gpu tier runs these kernels on the GPU", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux)")

from rlrunbook.kernels import gpu, ops

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _grads(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


@DTYPES
def test_the_rotation_is_the_chains_bit_for_bit_each_way(dtype, on_triton):
    from rlrunbook.engines.decoder import rotate

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=generator).to(dtype)
    angles = torch.randn(5, 32, generator=generator)
    cos, sin = (torch.cat([f, f], -1).to(dtype) for f in (angles.cos(), angles.sin()))
    sin[:, 32:] *= 0.5  # halves that differ: each half of the output reads its own half of the table
    grad = torch.randn(5, 3, 64, generator=generator).to(dtype)
    chain, (chain_dx,) = _grads(lambda t: rotate(t, cos[:, None], sin[:, None]), [x], grad)
    fused, (fused_dx,) = _grads(lambda t: ops.rotary(t, cos, sin), [x], grad)
    strided = torch.randn(5, 7, 64, generator=generator).to(dtype)[:, 2:5]  # q or k inside a wider row
    pairs = [(fused, chain), (fused_dx, chain_dx),
             (gpu.rotary(strided, cos, sin), rotate(strided, cos[:, None], sin[:, None]))]
    _equal_as_the_interpreter_rounds(pairs, dtype)


def _equal_as_the_interpreter_rounds(pairs, dtype):
    """Bit for bit in float32; in bfloat16 within two ulps of the largest value (the interpreter truncates at each
    rounding step, and a sum can cancel)."""
    for got, expected in pairs:
        if dtype == torch.float32:
            assert torch.equal(got, expected)
        else:
            assert (got.float() - expected.float()).abs().max() <= 2 ** -6 * expected.float().abs().max()


@pytest.mark.parametrize(("base_dtype", "lora_dtype"), [(torch.float32, torch.float32),
                                                        (torch.bfloat16, torch.float32),
                                                        (torch.bfloat16, torch.bfloat16)],
                         ids=["fp32", "bf16-model-fp32-lora", "bf16"])
def test_a_lora_update_added_in_one_kernel_is_the_chains_bit_for_bit(base_dtype, lora_dtype, on_triton):
    """``base + linear(xa, b) * scaling`` rounded to base's dtype: the one-kernel op against the chain of
    :func:`ops.linear` and :func:`ops.add_scaled` on the same product kernel, values and both gradients."""
    generator = torch.Generator().manual_seed(1)
    stacked = torch.randn(70, 200, generator=generator).to(base_dtype)
    base = stacked[:, 40:130]  # a projection's columns of a stacked product: rows strided
    xa = torch.randn(70, 8, generator=generator).to(lora_dtype)
    b = torch.randn(90, 8, generator=generator).to(lora_dtype)
    grad = torch.randn(70, 90, generator=generator).to(base_dtype)

    def chain(base, xa, b):
        return ops.add_scaled(base, ops.linear(xa, b), 0.375).to(base.dtype)

    expected, expected_grads = _grads(chain, [base, xa, b], grad)
    got, got_grads = _grads(lambda *t: ops.lora_added(*t, 0.375), [base, xa, b], grad)
    assert got.dtype == base_dtype
    _equal_as_the_interpreter_rounds([(got, expected)], base_dtype)
    _equal_as_the_interpreter_rounds(zip(got_grads, expected_grads), lora_dtype)  # the gradients: the chain's kernels
    assert torch.equal(gpu.lora_added(base[[3]], xa[[3]], b, 0.375), got[[3]])  # a row alone: its bits


def test_a_bf16_input_read_as_float32_by_the_product_gives_the_casts_values_and_gradients(on_triton):
    """LoRA's first factor (float32) beside a bf16 model: the product kernel reads x as float32, which is exact, so the
    product and both gradients are the bits of casting x first, without the float32 copy of x kept for backward."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(37, 200, generator=generator).bfloat16()
    a = torch.randn(8, 200, generator=generator)
    grad = torch.randn(37, 8, generator=generator)
    expected, expected_grads = _grads(lambda x, a: ops.linear(x.float(), a), [x, a], grad)
    got, got_grads = _grads(ops.linear_float32, [x, a], grad)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    assert got_grads[0].dtype == torch.bfloat16 and all(torch.equal(g, e) for g, e in zip(got_grads, expected_grads))
    with pytest.raises(TypeError, match="not float32"):
        ops.linear_float32(x, a.bfloat16())


@DTYPES
def test_the_norm_against_float64_and_a_row_alone(dtype, on_triton):
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 1500, generator=generator) * 3).to(dtype)  # two blocks of the row
    weight = (1 + torch.randn(1500, generator=generator) / 4).to(dtype)
    grad = torch.randn(6, 1500, generator=generator).to(dtype)

    def reference(x, weight):
        x64 = x.double()
        return weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5))

    expected, (dx64, dw64) = _grads(reference, [x, weight], grad.double())
    got, (dx, dw) = _grads(lambda x, w: ops.rms_norm(x, w, 1e-5), [x, weight], grad)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()
    assert (dx.double() - dx64).abs().max() <= tolerance * dx64.abs().max()
    assert (dw.double() - dw64).abs().max() <= tolerance * dw64.abs().max()
    out, rstd = gpu.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, got) and torch.equal(gpu.rms_norm(x[[4]], weight, 1e-5)[0], out[[4]])
    assert torch.equal(gpu.rms_norm_backward(x[[4]], weight, rstd[[4]], grad[[4]]), dx[[4]])


@DTYPES
def test_the_gated_activation_against_float64_and_the_chains_steps(dtype, on_triton):
    generator = torch.Generator().manual_seed(3)
    gate, up = ((torch.randn(5, 1100, generator=generator) * 4).to(dtype) for _ in range(2))
    grad = torch.randn(5, 1100, generator=generator).to(dtype)
    expected, (dg64, du64) = _grads(lambda g, u: torch.nn.functional.silu(g) * u, [gate.double(), up.double()],
                                    grad.double())
    got, (d_gate, d_up) = _grads(ops.silu_mul, [gate, up], grad)
    chain, (chain_gate, chain_up) = _grads(lambda g, u: ops.silu(g) * u, [gate, up], grad)
    ulp = 2e-7 if dtype == torch.float32 else 1e-2
    for value, exact, steps in ((got, expected, chain), (d_gate, dg64, chain_gate), (d_up, du64, chain_up)):
        assert (value.double() - exact).abs().max() <= 8 * ulp * exact.abs().max()
        # the chain's steps and roundings, up to the sigmoid's exp (numpy's here, PyTorch's in the chain) and the
        # interpreter's truncation to bfloat16
        assert (value.double() - steps.double()).abs().max() <= 2 * ulp * steps.double().abs().max()
    assert torch.equal(gpu.silu_mul(gate[[2]], up[[2]]), got[[2]])


def _lora_decoder(tiny_folder):
    from rlrunbook.backend.lora import wrap_with_lora
    from rlrunbook.engines.decoder import Decoder
    from rlrunbook.models import load_causal_lm

    model = wrap_with_lora(load_causal_lm(tiny_folder, dtype=torch.bfloat16), rank=4, alpha=8, seed=0)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: an update of zero would hide the addition
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / 8)
    return model, Decoder(model, "invariant")


def test_a_lora_models_decode_steps_equal_its_training_pass_through_the_layer_kernels(tiny_folder, on_triton):
    """bf16 `tiny` with LoRA r4 (float32 factors, as peft keeps them) on the Triton kernels: each decode step's hidden
    state equals the training pass's (recording gradients) at that token, bit for bit."""
    from rlrunbook.testing.decode_parity import assert_decode_steps_equal_the_training_pass

    _, decoder = _lora_decoder(tiny_folder)
    assert_decode_steps_equal_the_training_pass(decoder, [1, 285, 201, 279, 261, 223, 40], record_grad=True,
                                                capacity=16)


def test_a_decode_step_runs_one_kernel_per_norm_rotation_activation_and_lora_update(tiny_folder, on_triton):
    """The ops one decode layer runs on the CUDA path (in a sampling call's block of fixed weights), counted as
    scripts/profile_decode_ops.py counts them: each layer kernel replaces its chain, and the adapters' input is cast to
    the factors' dtype once per projection group."""
    from torch.profiler import profile

    from rlrunbook.engines.layouts import RowCache
    from rlrunbook.testing.decode_ops import _top_level

    model, decoder = _lora_decoder(tiny_folder)
    layers = len(model.get_base_model().model.layers)
    cache = RowCache(layers, 2, 16, decoder.num_kv_heads, decoder.head_dim, torch.bfloat16, torch.device("cpu"))
    cache.lengths[:] = 3
    with torch.no_grad(), decoder.weights_fixed():
        decoder.hidden(torch.tensor([5, 6]), cache.lengths.clone(), cache)  # builds the block's stacked weights
        with profile() as trace:
            decoder.hidden(torch.tensor([5, 6]), cache.lengths.clone(), cache)
    events = trace.events()
    top = collections.Counter(e.name for e in _top_level(events))
    per_layer = {name: count / layers for name, count in top.items()}
    assert per_layer["rlrunbook::rotary"] == 2 and per_layer["rlrunbook::silu_mul"] == 1
    assert per_layer["rlrunbook::lora_added"] == 7 and top["rlrunbook::rms_norm"] == 2 * layers + 1
    assert sum(per_layer.get(f"aten::{name}", 0) for name in ("mul", "rsqrt", "sigmoid", "neg", "cat")) == 0, top
    copies = sum(e.name == "aten::to" and any(c.name == "aten::_to_copy" for c in e.cpu_children)
                 for e in _top_level(events)) / layers
    assert copies == 0, top  # the float32 factors read the bf16 input as float32 in the product kernel
    assert sum(top.values()) / layers <= 90, top  # 180 through the chains (views included; 2026-11-29)
