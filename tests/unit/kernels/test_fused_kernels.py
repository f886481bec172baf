"""The fused kernels (kernels/fused.py) against the decoder's chains of operations they stand for: the same bits
for any shape, dtype and values (hypothesis), including rows of odd widths, zero rows, large and tiny values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.engines.decoder import fixed_norm, gated, rotate
from rlrunbook.kernels import fused
from rlrunbook.kernels import ops as fixed

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _values(seed: int, shape: tuple[int, ...], dtype: torch.dtype, spread: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(shape, generator=generator) * spread)  # magnitudes over several decades
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 200), dtype=DTYPES, seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-5, 1e-6, 0.3]))
def test_norms_give_the_chain_bits(rows, width, dtype, seed, eps):
    x, delta = _values(seed, (rows, width), dtype, 2.0), _values(seed + 1, (rows, width), dtype)
    weight = _values(seed + 2, (width,), dtype)
    x[0, : width // 2] = 0  # a row partly zero
    assert torch.equal(fused.rms_norm(x, weight, eps), fixed_norm(x, weight, eps))
    total, normed = fused.add_rms_norm(x, delta, weight, eps)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, fixed_norm(x + delta, weight, eps))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 7), heads=st.integers(1, 5), kv_heads=st.integers(1, 3), half=st.integers(1, 40),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_rotary_gives_the_chain_bits_and_leaves_the_values(rows, heads, kv_heads, half, dtype, seed):
    dim = 2 * half
    qkv = _values(seed, (rows, (heads + 2 * kv_heads) * dim), dtype, 2.0)
    cos, sin = _values(seed + 1, (rows, dim), dtype), _values(seed + 2, (rows, dim), dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    expected_q = rotate(q.view(rows, heads, dim), cos[:, None], sin[:, None]).reshape(rows, -1)
    expected_k = rotate(k.view(rows, kv_heads, dim), cos[:, None], sin[:, None]).reshape(rows, -1)
    expected_v = v.clone()
    out = fused.rotary_(qkv, heads + kv_heads, dim, cos, sin)
    assert out is qkv
    assert torch.equal(qkv, torch.cat([expected_q, expected_k, expected_v], dim=-1))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 150), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_silu_mul_gives_the_chain_bits(rows, width, dtype, seed):
    gate_up = _values(seed, (rows, 2 * width), dtype, 1.5)
    gate, up = gate_up.split([width, width], dim=-1)
    assert torch.equal(fused.silu_mul(gate_up), gated(gate, up))


def _lora_chain(x, weight, bias, sizes, adapters):
    """Decoder.linears + Decoder._with_adapters under fixed numerics, for one adapter per projection."""
    outputs = fixed.linear(x, weight, bias).split(sizes, dim=-1)
    result = []
    for out, adapter in zip(outputs, adapters, strict=True):
        if adapter is not None:
            a, b, scaling = adapter
            delta = fixed.linear(fixed.linear(x.to(a.dtype), a), b) * scaling
            out = (out + delta).to(out.dtype)
        result.append(out)
    return torch.cat(result, dim=-1)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), width=st.sampled_from([24, 64, 65, 130]), sizes=st.lists(st.integers(1, 70), min_size=1,
       max_size=3), rank=st.sampled_from([1, 4, 16, 65]), pair=st.sampled_from(
       [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]),
       with_bias=st.booleans(), skip=st.integers(-1, 2), scaling=st.sampled_from([2.0, 3.0, 0.37]),
       seed=st.integers(0, 2**16))
def test_lora_linears_give_the_chain_bits(rows, width, sizes, rank, pair, with_bias, skip, scaling, seed):
    """Widths on both sides of SMALL_K (sequential products below), ranks too; a projection without adapter."""
    dtype, adapter_dtype = pair
    x = _values(seed, (rows, width), dtype)
    weight = _values(seed + 1, (sum(sizes), width), dtype) / 8
    bias = _values(seed + 2, (sum(sizes),), dtype) if with_bias else None
    adapters = [None if i == skip else (_values(seed + 3 + i, (rank, width), adapter_dtype) / 4,
                                        _values(seed + 9 + i, (size, rank), adapter_dtype), scaling)
                for i, size in enumerate(sizes)]
    group = fused.LoraLinears.prepare(weight, bias, sizes, adapters)
    expected = _lora_chain(x, weight, bias, sizes, adapters)
    assert torch.equal(fused.lora_linears(x, group), expected)
    kept = torch.full((rows, sum(sizes)), float("nan"), dtype=dtype)  # the outputs kept for the trainer
    assert torch.equal(fused.lora_linears(x, group, kept=kept), expected)
    assert torch.equal(kept, expected)


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 5), min_size=1, max_size=4), width=st.sampled_from([24, 65]),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3), ranks=st.lists(st.sampled_from([1, 4, 16]),
       min_size=4, max_size=4), dtype=st.sampled_from([torch.float32, torch.bfloat16]), absent=st.integers(-1, 3),
       seed=st.integers(0, 2**16))
def test_lora_linears_of_several_slots_give_each_slot_its_own_adapters_bits(cuts, width, sizes, ranks, dtype, absent,
                                                                          seed):
    """Rows cut into slots (some empty), each slot its own adapters (one slot with none): every slot's rows are what
    a one-slot group of its adapters gives them alone."""
    slots = len(cuts)
    bounds = [0]
    for rows in cuts:
        bounds.append(bounds[-1] + rows)
    x = _values(seed, (bounds[-1], width), dtype)
    weight = _values(seed + 1, (sum(sizes), width), dtype) / 8
    per_slot = [[None if s == absent else (_values(seed + 10 * s + i, (ranks[s], width), dtype) / 4,
                                           _values(seed + 10 * s + 5 + i, (size, ranks[s]), dtype), 2.0 + s)
                 for i, size in enumerate(sizes)] for s in range(slots)]
    group = fused.LoraLinears.prepare(weight, None, sizes, *per_slot)
    mixed = fused.lora_linears(x, group, bounds)
    kept = torch.full((bounds[-1], sum(sizes)), float("nan"), dtype=dtype)
    assert torch.equal(fused.lora_linears(x, group, bounds, kept), mixed)
    assert torch.equal(kept, mixed)
    for s in range(slots):
        rows = slice(bounds[s], bounds[s + 1])
        alone = fused.lora_linears(x[rows], fused.LoraLinears.prepare(weight, None, sizes, per_slot[s]))
        assert torch.equal(mixed[rows], alone)
        assert torch.equal(alone, _lora_chain(x[rows], weight, None, sizes, per_slot[s]))


def test_lora_linears_refuse_a_kept_buffer_of_another_shape_or_dtype():
    x = _values(0, (3, 24), torch.float32)
    group = fused.LoraLinears.prepare(_values(1, (10, 24), torch.float32), None, [10], [None])
    for kept in (torch.empty(3, 9), torch.empty(3, 10, dtype=torch.bfloat16), torch.empty(10, 3).t()):
        with pytest.raises(ValueError, match="kept"):
            fused.lora_linears(x, group, kept=kept)


def test_lora_linears_refuse_bounds_that_do_not_cut_the_rows_into_the_slots():
    weight = torch.randn(8, 16)
    group = fused.LoraLinears.prepare(weight, None, [8], [None], [None])
    x = torch.randn(5, 16)
    for bounds in (None, (0, 5), (0, 2, 4), (1, 2, 5), (0, 4, 2, 5)):
        with pytest.raises(ValueError, match="row bounds"):
            fused.lora_linears(x, group, bounds)


def test_lora_linears_refuse_what_the_chain_computes_otherwise():
    """A float32 model with bfloat16 factors (the chain rounds the input to bfloat16 first): left to the chain."""
    weight = torch.randn(8, 16)
    adapters = [(torch.randn(2, 16).bfloat16(), torch.randn(8, 2).bfloat16(), 2.0)]
    assert fused.LoraLinears.prepare(weight, None, [8], adapters) is None
    assert fused.LoraLinears.prepare(weight, None, [8], [(torch.randn(16, 2).t(), torch.randn(8, 2), 2.0)]) is None


def test_fused_kernels_apply_only_where_no_gradient_is_recorded():
    with torch.no_grad():
        assert fused.applies(torch.bfloat16, torch.device("cpu"))
        assert fused.applies(torch.float32, torch.device("cpu"))
        assert not fused.applies(torch.float16, torch.device("cpu"))
        assert not fused.applies(torch.float32, torch.device("meta"))
    with torch.enable_grad():
        assert not fused.applies(torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_mismatched_dtype_is_refused_by_name(dtype):
    with pytest.raises(TypeError, match="one dtype"):
        fused.rms_norm(torch.ones(2, 4, dtype=dtype), torch.ones(4, dtype=torch.float64 if dtype == torch.float32
                                                                      else torch.float32), 1e-6)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 100), rank=st.sampled_from([1, 3, 16, 33, 64]), pair=st.sampled_from(
       [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]),
       scaling=st.sampled_from([2.0, 0.37, 1.0]), seed=st.integers(0, 2**16))
def test_lora_added_gives_the_chain_bits_and_gradients(rows, cols, rank, pair, scaling, seed):
    """ops.lora_added on CPU (the C kernel: gemm_seq's sums with peft's addition in their epilogue) against the
    trainer's chain, a product then add_scaled (or PyTorch's promoted sum for float32 factors beside a bfloat16
    model): values and the gradients of the base, the first product and the second factor, bit for bit."""
    dtype, factor_dtype = pair
    base = _values(seed, (rows, cols), dtype).requires_grad_()
    xa = (_values(seed + 1, (rows, rank), factor_dtype) / 4).requires_grad_()
    b = _values(seed + 2, (cols, rank), factor_dtype).requires_grad_()
    grad = _values(seed + 3, (rows, cols), dtype)
    assert fixed.lora_added_applies(torch.device("cpu"), rank)

    def chain(base, xa, b):
        delta = fixed.linear(xa, b)
        return fixed.add_scaled(base, delta, scaling) if dtype == factor_dtype else (base + delta * scaling).to(dtype)

    results = []
    for function in (fixed.lora_added, chain):
        leaves = [t.detach().clone().requires_grad_() for t in (base, xa, b)]
        out = function(*leaves, scaling) if function is fixed.lora_added else function(*leaves)
        out.backward(grad)
        results.append([out.detach(), *(leaf.grad for leaf in leaves)])
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_lora_added_on_cpu_is_for_the_sequential_ranks():
    """Ranks over SMALL_K sum in lanes16 order: the C kernel refuses them and the decoder keeps the chain there."""
    from rlrunbook.engines.decoder import lora_added_applies

    cpu = torch.device("cpu")
    assert fixed.lora_added_applies(cpu, fixed.SMALL_K) and not fixed.lora_added_applies(cpu, fixed.SMALL_K + 1)
    base, b = torch.zeros(2, 3), torch.zeros(3, fixed.SMALL_K + 1)
    assert not lora_added_applies(base, b) and lora_added_applies(base, b[:, :fixed.SMALL_K])
    assert not lora_added_applies(base.double(), b[:, :4])
    with pytest.raises(ValueError, match="rank at most 64"):
        from rlrunbook.kernels import cpu as kernels

        kernels.lora_added(base, torch.zeros(2, fixed.SMALL_K + 1), b, 2.0)


def test_lora_added_reads_a_factor_changed_in_place():
    """The C kernel reads the second factor transposed, a copy kept per factor (the output layer's is made once per
    snapshot, not per decode step): a factor changed in place (an optimizer step, a load) is read as it is now,
    and an unchanged one is not copied again."""
    from rlrunbook.kernels import cpu as kernels

    base, xa, b = _values(0, (3, 40), torch.float32), _values(1, (3, 4), torch.float32), _values(2, (40, 4), torch.float32)

    def want() -> torch.Tensor:
        return fixed.add_scaled(base, fixed.linear(xa, b), 0.5)

    assert torch.equal(kernels.lora_added(base, xa, b, 0.5), want())
    assert kernels._transposed(b) is kernels._transposed(b)  # kept
    with torch.no_grad():
        b.mul_(-3.0)  # in place, as AdamW steps a factor
    assert torch.equal(kernels.lora_added(base, xa, b, 0.5), want())
    b.data = _values(3, (40, 4), torch.float32)  # new storage under the same tensor
    assert torch.equal(kernels.lora_added(base, xa, b, 0.5), want())
