"""Fused fixed-order operations for passes that record no gradient (``c/fused.c``), CPU only.

Each function stands for a chain of :mod:`rlrunbook.kernels.ops` operations and elementwise PyTorch steps that the
decoder runs when it records gradients (the trainer's pass), and gives the same bits: the sums are computed by the
same kernels, the elementwise steps round where the chain rounds (tested against the chain). A chain of a dozen
operations per projection group, norm or rotation becomes one call, which is what a decode step of a few rows
pays for (docs/performance.md, kernels per decode step).

Tensors are float32 or bfloat16 CPU tensors of one dtype per call (the LoRA factors may be float32 beside a
bfloat16 model, as peft keeps them); :func:`applies` says whether a pass can use them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from rlrunbook.kernels import cpu, ops
from rlrunbook.kernels.build import load_library
from rlrunbook.kernels.cpu import SMALL_K, _check, _code, _profiled, _ptr, _threads

DTYPES = (torch.float32, torch.bfloat16)


def applies(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a pass over hidden states of ``dtype`` on ``device`` may use these kernels: no gradient recorded,
    float32 or bfloat16 on CPU, where :mod:`rlrunbook.kernels.ops` computes with the C kernels."""
    return (not torch.is_grad_enabled() and device.type == "cpu" and dtype in DTYPES
            and ops._backend(device) is cpu)


def _same_dtype(*tensors: torch.Tensor) -> int:
    code = _code(tensors[0], "fused")
    if any(t.dtype != tensors[0].dtype for t in tensors):
        raise TypeError(f"fused kernels take one dtype, got {[t.dtype for t in tensors]}")
    return code


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 and x.stride(0) >= x.shape[1] else x.contiguous()


@_profiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of ``[M, E]`` ``x`` as the decoder computes it under fixed numerics: the mean of
    squares in lanes16 order, ``x * rsqrt(mean + eps)`` in float32 rounded to ``x``'s dtype, times ``weight``."""
    x = _contiguous_rows(x)
    t = _same_dtype(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.numel():
        _check(load_library().rms_norm(_ptr(x), x.stride(0), x.shape[0], x.shape[1], _ptr(weight.contiguous()),
                                       eps, _ptr(out), out.stride(0), t, _threads()), "rms_norm")
    return out


@_profiled
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rms_norm(h + delta))``: a residual connection and the next norm, ``[M, E]`` each."""
    h, delta = h.contiguous(), delta.contiguous()
    t = _same_dtype(h, delta, weight)
    total, normed = torch.empty_like(h), torch.empty_like(h)
    if h.numel():
        _check(load_library().add_rms_norm(_ptr(h), _ptr(delta), _ptr(total), h.shape[0], h.shape[1],
                                           _ptr(weight.contiguous()), eps, _ptr(normed), t, _threads()),
               "add_rms_norm")
    return total, normed


@_profiled
def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``heads`` heads of each row of ``[N, W]`` ``x`` in place (``q * cos + rotate_half(q) * sin``,
    each step rounded to ``x``'s dtype); ``cos``, ``sin``: ``[N, head_dim]`` in ``x``'s dtype. Returns ``x``."""
    if x.stride(-1) != 1 or heads * head_dim > x.shape[1]:
        raise ValueError(f"rotary_: {heads} heads of {head_dim} in rows of {tuple(x.shape)} (stride {x.stride()})")
    cos, sin = cos.contiguous(), sin.contiguous()
    t = _same_dtype(x, cos, sin)
    if x.numel():
        _check(load_library().rotary(_ptr(x), x.stride(0), x.shape[0], heads, head_dim, _ptr(cos), _ptr(sin), t,
                                     _threads()), "rotary")
    return x


@_profiled
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``[N, 2 I]`` ``gate_up`` (gate the first half of each row): ``[N, I]``, silu as
    :func:`rlrunbook.kernels.ops.silu` computes it."""
    gate_up = _contiguous_rows(gate_up)
    t = _code(gate_up, "silu_mul")
    n, width = gate_up.shape
    out = torch.empty(n, width // 2, dtype=gate_up.dtype)
    if out.numel():
        _check(load_library().silu_mul(_ptr(gate_up), gate_up.stride(0), n, width // 2, _ptr(out), t, _threads()),
               "silu_mul")
    return out


Adapter = tuple[torch.Tensor, torch.Tensor, float]  # LoRA (A [r, in], B [out, r], scaling)


@dataclass(frozen=True)
class LoraLinears:
    """A projection group prepared for :func:`lora_linears`: the stacked base weight ``[N, K]`` (and bias), each
    projection's output columns, and per adapter slot each projection's LoRA adapter ``(A, B, scaling)`` or
    ``None`` (one slot: one adapter for every row; several: see :func:`lora_linears`'s ``bounds``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    slots: tuple[tuple[Adapter | None, ...], ...]
    adapter_dtype: torch.dtype
    _args: tuple  # the C arrays, the adapters' storage code and the factors they point to, built once

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int],
                *slots: Sequence[Adapter | None]) -> LoraLinears | None:
        """The prepared group, or ``None`` where these kernels cannot compute it as the decoder's chain does
        (mixed or unsupported dtypes, non-contiguous factors, a float32 model with bfloat16 factors). Each of
        ``slots`` gives one adapter per projection (``None``: none); at least one slot."""
        if not slots or any(len(adapters) != len(sizes) for adapters in slots):
            raise ValueError(f"LoraLinears.prepare: {len(slots)} slots of adapters for {len(sizes)} projections")
        present = [a for adapters in slots for a in adapters if a is not None]
        adapter_dtype = present[0][0].dtype if present else weight.dtype
        if (weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.stride(-1) != 1
                or adapter_dtype not in DTYPES or (weight.dtype == torch.float32 and adapter_dtype != torch.float32)):
            return None
        for a, b, _ in present:
            if a.dtype != adapter_dtype or b.dtype != adapter_dtype or not (a.is_contiguous() and b.is_contiguous()):
                return None
        count = len(sizes)
        flat = [adapters[p] for p in range(count) for adapters in slots]  # projection p, slot s at p * S + s
        cols = (ctypes.c_int64 * (count + 1))(*[sum(sizes[:i]) for i in range(count + 1)])
        a_ptrs = (ctypes.c_void_p * len(flat))(*[None if a is None else a[0].data_ptr() for a in flat])
        # the second factor as the C kernel reads it: transposed ([r, out]) where its sum is sequential (r <= 64)
        seconds = [None if a is None else a[1].t().contiguous() if a[1].shape[1] <= SMALL_K else a[1] for a in flat]
        b_ptrs = (ctypes.c_void_p * len(flat))(*[None if b is None else b.data_ptr() for b in seconds])
        ranks = (ctypes.c_int64 * len(flat))(*[0 if a is None else a[0].shape[0] for a in flat])
        scalings = (ctypes.c_float * len(flat))(*[0.0 if a is None else a[2] for a in flat])
        bias32 = None if bias is None else bias.detach().float().contiguous()
        code = 0 if adapter_dtype == torch.float32 else 1
        return cls(weight, bias32, tuple(sizes), tuple(tuple(adapters) for adapters in slots), adapter_dtype,
                   (cols, a_ptrs, b_ptrs, ranks, scalings, code, seconds))


@_profiled
def lora_linears(x: torch.Tensor, group: LoraLinears, bounds: Sequence[int] | None = None,
                 base: torch.Tensor | None = None) -> torch.Tensor:
    """The group's outputs side by side (``[M, N]``, ``x``'s dtype): the base product over the stacked weights,
    then each adapter's update added in peft's order (see ``c/fused.c``).

    ``bounds`` (``S + 1`` ints from 0 to ``M``, not decreasing) cuts the rows into the group's ``S`` slots: rows
    ``bounds[s]`` to ``bounds[s + 1]`` get slot ``s``'s adapters, with the bits a one-slot group of those adapters
    gives them. ``None``: a one-slot group's adapters for every row.

    ``base`` (a contiguous ``[M, N]`` tensor of ``x``'s dtype): also receives the base product alone, before the
    updates (what the trainer's pass computes first; :mod:`rlrunbook.engines.kept_products`)."""
    x = _contiguous_rows(x)
    if x.dtype != group.weight.dtype:
        raise TypeError(f"lora_linears: input {x.dtype}, weights {group.weight.dtype}")
    m, k = x.shape
    n = group.weight.shape[0]
    count = len(group.slots)
    bounds = (0, m) if bounds is None and count == 1 else bounds
    if (bounds is None or len(bounds) != count + 1 or bounds[0] != 0 or bounds[-1] != m
            or any(b < a for a, b in pairwise(bounds))):
        raise ValueError(f"lora_linears: row bounds {bounds} do not cut {m} rows into {count} slots")
    if base is not None and (base.shape != (m, n) or base.dtype != x.dtype or not base.is_contiguous()):
        raise ValueError(f"lora_linears: base {tuple(base.shape)} {base.dtype} is not a contiguous [{m}, {n}] "
                         f"{x.dtype} tensor")
    out = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        cols, a_ptrs, b_ptrs, ranks, scalings, adapter_code, _ = group._args
        t = _code(x, "x")
        _check(load_library().lora_linears(
            _ptr(x), t, x.stride(0), m, k, _ptr(group.weight), group.weight.stride(0), _ptr(group.bias), n,
            _ptr(out), t, n, len(group.sizes), cols, a_ptrs, b_ptrs, ranks, scalings,
            adapter_code, count, (ctypes.c_int64 * (count + 1))(*bounds), _ptr(base), _threads()), "lora_linears")
    return out


@_profiled
def cached_attention(qkv: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     key_positions: torch.Tensor, key_valid: torch.Tensor, window: int, heads: int, kv_heads: int,
                     head_dim: int, scale: float,
                     parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One decode step over per-row caches (:class:`rlrunbook.engines.layouts.RowCache`): each row's key and value
    (the heads after its ``heads`` query heads in ``[R, (H + 2 Hkv) D]`` ``qkv``) stored at cache index
    ``lengths[r]`` of ``keys``/``values`` (``[R, capacity, Hkv, D]``), then its queries over the first ``window``
    entries: ``[R, H * D]`` (rows strided as ``qkv``'s). ``key_positions`` (int64) and ``key_valid`` (uint8) hold at
    least ``window`` entries.

    ``parts`` (int64 ``order``, ``starts``, ``reload``; :class:`rlrunbook.engines.prefix_sharing.DecodeParts`): rows
    whose caches hold copies of one prefix read it once per part, with the same bits. The caller guarantees the
    copies: a row that does not hold at indices below ``reload[r]`` what the row before it in its part holds gets
    that row's keys and values there."""
    rows = qkv.shape[0]
    if (qkv.stride(-1) != 1 or keys.shape[0] != rows or keys.stride() != values.stride() or keys[0].stride(0)
            != kv_heads * head_dim or qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or window > keys.shape[1]):
        raise ValueError(f"cached_attention: qkv {tuple(qkv.shape)}, cache {tuple(keys.shape)}, window {window}")
    t = _same_dtype(qkv, keys, values)
    # the kernel writes each query's output where the query sits in its row (q's strides): rows as wide as qkv's
    out = torch.empty(rows, qkv.stride(0), dtype=qkv.dtype)
    order = starts = reload = None
    count = 0
    if parts is not None:
        order, starts, reload = parts
        count = starts.numel() - 1
        if (order.numel() != rows or reload.numel() != rows or int(starts[-1]) != rows
                or any(t.dtype != torch.int64 or not t.is_contiguous() for t in parts)):
            raise ValueError(f"cached_attention: parts for {order.numel()} rows ({int(starts[-1])} in parts, "
                             f"{reload.numel()} reload lengths) over a cache of {rows} rows")
    if rows:
        _check(load_library().cached_attention(
            _ptr(qkv), qkv.stride(0), _ptr(keys), _ptr(values), keys.stride(0), _ptr(lengths), _ptr(key_positions),
            _ptr(key_valid), _ptr(out), rows, window, heads, kv_heads, head_dim, t, scale, _ptr(order), _ptr(starts),
            _ptr(reload), count, _threads()), "cached_attention")
    return out[:, :heads * head_dim]
