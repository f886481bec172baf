"""fused.decode_layers: a decode step's layers in one call give the bits of the fused calls made one by one (as the
fused pass made them per layer), in the residual stream, the final norm's output, the caches and the kept
products; with adapter slots, shared-prefix parts, q/k/v biases and groups without adapters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.engines.prefix_sharing import Sharing, decode_parts
from rlrunbook.kernels import fused


def _values(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * scale).to(dtype)


def _group(generator, sizes, width, dtype, slots, rank, bias, without):
    """A projection group of ``sizes`` over inputs of ``width``: per slot, one adapter per projection (none for the
    projection ``without`` names in slot 0)."""
    weight = _values(generator, (sum(sizes), width), dtype, width ** -0.5)
    adapters = [[None if (s == 0 and i == without) else
                 (_values(generator, (rank, width), dtype, 0.3), _values(generator, (size, rank), dtype, 0.3), 1.5 + s)
                 for i, size in enumerate(sizes)] for s in range(slots)]
    bias_values = _values(generator, (sum(sizes),), dtype) if bias else None
    group = fused.LoraLinears.prepare(weight, bias_values, sizes, *adapters)
    assert group is not None
    return group


def _layers(generator, count, hidden, inner, heads, kv_heads, dim, dtype, slots, rank, bias, without):
    plans = []
    for _ in range(count):
        norms = [(_values(generator, (hidden,), dtype, 0.2) + 1).to(dtype) for _ in range(2)]
        plans.append(fused.LayerPlan(
            _group(generator, [heads * dim, kv_heads * dim, kv_heads * dim], hidden, dtype, slots, rank, bias, without),
            _group(generator, [hidden], heads * dim, dtype, slots, rank, False, without),
            _group(generator, [inner, inner], hidden, dtype, slots, rank, False, without),
            _group(generator, [hidden], inner, dtype, slots, rank, False, without),
            (norms[0], 1e-5), (norms[1], 1e-6), dim ** -0.5))
    return plans


def _one_by_one(h, x, plans, keys, values, cache_args, cos, sin, parts, bounds, kept, heads, kv_heads, dim):
    """The fused calls a layer made before decode_layers, in their order (engines/fused_pass.py)."""
    for index, plan in enumerate(plans):
        qkv = fused.lora_linears(x, plan.qkv, bounds, kept[4 * index])
        fused.rotary_(qkv, heads + kv_heads, dim, cos, sin)
        attended = fused.cached_attention(qkv, keys[index], values[index], *cache_args, heads, kv_heads, dim,
                                          plan.scale, parts)
        out = fused.lora_linears(attended, plan.o, bounds, kept[4 * index + 1])
        h, x = fused.add_rms_norm(h, out, *plan.post_norm)
        act = fused.silu_mul(fused.lora_linears(x, plan.gate_up, bounds, kept[4 * index + 2]))
        h, x = fused.add_rms_norm(h, fused.lora_linears(act, plan.down, bounds, kept[4 * index + 3]), *plan.next_norm)
    return h, x


@settings(max_examples=25, deadline=None)
@given(count=st.integers(1, 3), rows=st.integers(1, 6), kv_heads=st.integers(1, 2), per_kv=st.integers(1, 2),
       dim=st.sampled_from([8, 16]), hidden=st.sampled_from([24, 72]), inner=st.sampled_from([40, 96]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), two_slots=st.booleans(), shared=st.booleans(),
       bias=st.booleans(), without=st.integers(-1, 2), keep=st.integers(0, 2), threads=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_decode_layers_give_the_bits_of_the_calls_one_by_one(count, rows, kv_heads, per_kv, dim, hidden, inner, dtype,
                                                            two_slots, shared, bias, without, keep, threads, seed):
    """Everything the step writes is compared: the final norm's output, the residual stream, each layer's cache
    (the new key and value at each row's length) and the kept outputs (all, none, or every other group). A
    shared-prefix plan is given over caches that do not hold the copies it claims, so that a step reading each
    row's own cache would not match."""
    generator = torch.Generator().manual_seed(seed)
    heads, slots = per_kv * kv_heads, 2 if two_slots else 1
    plans = _layers(generator, count, hidden, inner, heads, kv_heads, dim, dtype, slots, 4, bias, without)
    layers = fused.DecodeLayers.prepare(plans, heads, kv_heads, dim)
    prefix, capacity = 5, 16
    lengths = prefix + torch.randint(0, 4, (rows,), generator=generator)
    keys = [_values(generator, (rows, capacity, kv_heads, dim), dtype) for _ in range(count)]
    values = [_values(generator, (rows, capacity, kv_heads, dim), dtype) for _ in range(count)]
    parts = None
    if shared:  # rows claim the row before's first entries without holding them: the plan is read, or the bits differ
        plan = decode_parts(Sharing(order=tuple(range(rows)), reload=(0, *[prefix] * (rows - 1))), kv_heads, threads)
        parts = (plan.order, plan.starts, plan.reload)
    window = int(lengths.max()) + 1
    cache_args = (lengths, torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8), window)
    cos, sin = (_values(generator, (rows, dim), dtype) for _ in range(2))
    bounds = (0, rows // 2, rows) if two_slots else None
    widths = layers.group_widths
    kept_at = [keep == 1 or (keep == 2 and index % 2 == 0) for index in range(4 * count)]
    h = _values(generator, (rows, hidden), dtype)
    x = fused.rms_norm(h, plans[0].post_norm[0], 1e-5)

    torch.set_num_threads(threads)
    try:
        expected_kept = [torch.full((rows, widths[i % 4]), float("nan"), dtype=dtype) if at else None
                         for i, at in enumerate(kept_at)]
        expected_keys, expected_values = [k.clone() for k in keys], [v.clone() for v in values]
        expected_h, expected_x = _one_by_one(h.clone(), x.clone(), plans, expected_keys, expected_values, cache_args,
                                             cos, sin, parts, bounds, expected_kept, heads, kv_heads, dim)
        kept = [None if base is None else torch.full_like(base, float("nan")) for base in expected_kept]
        got_h, got_x = h.clone(), x.clone()
        returned = fused.decode_layers(got_h, got_x, layers, keys, values, *cache_args, cos, sin, parts, bounds,
                                       kept if keep else None)
    finally:
        torch.set_num_threads(2)
    assert returned is got_x
    assert torch.equal(got_x, expected_x) and torch.equal(got_h, expected_h)
    for mine, theirs in zip(keys + values, expected_keys + expected_values, strict=True):
        assert torch.equal(mine, theirs)
    if keep:
        for mine, theirs in zip(kept, expected_kept, strict=True):
            assert (mine is None) == (theirs is None) and (mine is None or torch.equal(mine, theirs))


def test_decode_layers_refuse_what_they_cannot_run_as_the_calls_would():
    generator = torch.Generator().manual_seed(0)
    plans = _layers(generator, 2, 24, 40, 2, 1, 8, torch.float32, 1, 4, False, -1)
    layers = fused.DecodeLayers.prepare(plans, 2, 1, 8)
    assert layers is not None and layers.group_widths == (32, 24, 80, 24)
    assert fused.DecodeLayers.prepare(plans, 3, 1, 8) is None  # q/k/v not as wide as 3 heads make it
    second = plans[1]
    halves = [fused.LoraLinears.prepare(g.weight.bfloat16(), None, g.sizes, [None] * len(g.sizes))
              for g in (second.qkv, second.o, second.gate_up, second.down)]
    mixed = [plans[0], fused.LayerPlan(*halves, second.post_norm, second.next_norm, second.scale)]
    assert fused.DecodeLayers.prepare(mixed, 2, 1, 8) is None  # one dtype for every layer
    rows, capacity = 3, 8
    keys = [torch.zeros(rows, capacity, 1, 8) for _ in plans]
    cache = (torch.full((rows,), 2), torch.arange(capacity), torch.ones(capacity, dtype=torch.uint8), 4)
    h, cos = torch.zeros(rows, 24), torch.zeros(rows, 8)
    with pytest.raises(ValueError, match="row bounds"):
        fused.decode_layers(h, h.clone(), layers, keys, keys, *cache, cos, cos, None, (0, 1, 3))
    with pytest.raises(ValueError, match="keys and values"):
        fused.decode_layers(h, h.clone(), layers, keys, [k.bfloat16() for k in keys], *cache, cos, cos)
    with pytest.raises(ValueError, match="cos"):
        fused.decode_layers(h, h.clone(), layers, keys, keys, *cache, cos[:2], cos[:2])
    with pytest.raises(ValueError, match="kept products"):
        fused.decode_layers(h, h.clone(), layers, keys, keys, *cache, cos, cos, None, None, [None] * 7)
    with pytest.raises(ValueError, match="kept product 5"):
        fused.decode_layers(h, h.clone(), layers, keys, keys, *cache, cos, cos, None, None,
                            [None] * 5 + [torch.zeros(rows, 25)] + [None] * 2)
