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
from rlrunbook.kernels.coded_weights import CodedWeight
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
    ``None`` (one slot: one adapter for every row; several: see :func:`lora_linears`'s ``bounds``). ``coded``: the
    stacked weight's coded form (:mod:`rlrunbook.kernels.coded_weights`), which the base product then reads instead
    of ``weight`` (the same values: the same bits), or ``None``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    slots: tuple[tuple[Adapter | None, ...], ...]
    adapter_dtype: torch.dtype
    _args: tuple  # the C arrays, the adapters' storage code and the factors they point to, built once
    coded: CodedWeight | None = None
    _coded_form: ctypes.Structure | None = None  # c/fused.c's coded_form of ``coded``

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None, sizes: Sequence[int],
                *slots: Sequence[Adapter | None], coded: CodedWeight | None = None) -> LoraLinears | None:
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
        if coded is not None and (coded.shape != tuple(weight.shape) or weight.dtype != torch.float32):
            raise ValueError(f"LoraLinears.prepare: a coded weight {coded.shape} for a {tuple(weight.shape)} "
                             f"{weight.dtype} weight")
        form = None if coded is None else _CodedForm(*coded.c_args())
        return cls(weight, bias32, tuple(sizes), tuple(tuple(adapters) for adapters in slots), adapter_dtype,
                   (cols, a_ptrs, b_ptrs, ranks, scalings, code, seconds), coded, form)


def _slot_bounds(name: str, bounds: Sequence[int] | None, rows: int, slots: int) -> Sequence[int]:
    """``bounds`` checked to cut ``rows`` rows into ``slots`` slots (``S + 1`` ints from 0 to ``rows``, not
    decreasing); ``None`` stands for one slot of every row."""
    bounds = (0, rows) if bounds is None and slots == 1 else bounds
    if (bounds is None or len(bounds) != slots + 1 or bounds[0] != 0 or bounds[-1] != rows
            or any(b < a for a, b in pairwise(bounds))):
        raise ValueError(f"{name}: row bounds {bounds} do not cut {rows} rows into {slots} slots")
    return bounds


@_profiled
def lora_linears(x: torch.Tensor, group: LoraLinears, bounds: Sequence[int] | None = None,
                 kept: torch.Tensor | None = None) -> torch.Tensor:
    """The group's outputs side by side (``[M, N]``, ``x``'s dtype): the base product over the stacked weights,
    then each adapter's update added in peft's order (see ``c/fused.c``).

    ``bounds`` (``S + 1`` ints from 0 to ``M``, not decreasing) cuts the rows into the group's ``S`` slots: rows
    ``bounds[s]`` to ``bounds[s + 1]`` get slot ``s``'s adapters, with the bits a one-slot group of those adapters
    gives them. ``None``: a one-slot group's adapters for every row.

    ``kept`` (a contiguous ``[M, N]`` tensor of ``x``'s dtype): also receives the outputs (what the trainer's pass
    over these tokens computes; :mod:`rlrunbook.engines.kept_products`), written where they are stored."""
    x = _contiguous_rows(x)
    if x.dtype != group.weight.dtype:
        raise TypeError(f"lora_linears: input {x.dtype}, weights {group.weight.dtype}")
    m, k = x.shape
    n = group.weight.shape[0]
    count = len(group.slots)
    bounds = _slot_bounds("lora_linears", bounds, m, count)
    if kept is not None and (kept.shape != (m, n) or kept.dtype != x.dtype or not kept.is_contiguous()):
        raise ValueError(f"lora_linears: kept {tuple(kept.shape)} {kept.dtype} is not a contiguous [{m}, {n}] "
                         f"{x.dtype} tensor")
    out = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        cols, a_ptrs, b_ptrs, ranks, scalings, adapter_code, _ = group._args
        t = _code(x, "x")
        form = None if group._coded_form is None else ctypes.byref(group._coded_form)
        _check(load_library().lora_linears(
            _ptr(x), t, x.stride(0), m, k, _ptr(group.weight), group.weight.stride(0), form, _ptr(group.bias), n,
            _ptr(out), t, n, len(group.sizes), cols, a_ptrs, b_ptrs, ranks, scalings,
            adapter_code, count, (ctypes.c_int64 * (count + 1))(*bounds), _ptr(kept), _threads()), "lora_linears")
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


class _CodedForm(ctypes.Structure):
    """``coded_form`` of ``c/fused.c``: a :class:`~rlrunbook.kernels.coded_weights.CodedWeight` (kind 0: none)."""

    _fields_ = [("kind", ctypes.c_int64), ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("offsets", ctypes.c_void_p)]


class _Group(ctypes.Structure):
    """``lora_group`` of ``c/fused.c``: a :class:`LoraLinears` as ``decode_layers`` reads it."""

    _fields_ = [("W", ctypes.c_void_p), ("ldw", ctypes.c_int64), ("N", ctypes.c_int64), ("coded", _CodedForm),
                ("bias", ctypes.c_void_p),
                ("P", ctypes.c_int64), ("cols", ctypes.c_void_p), ("A", ctypes.c_void_p), ("B", ctypes.c_void_p),
                ("ranks", ctypes.c_void_p), ("scalings", ctypes.c_void_p), ("ta", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    """``decode_layer`` of ``c/fused.c``."""

    _fields_ = [("qkv", _Group), ("o", _Group), ("gate_up", _Group), ("down", _Group),
                ("post_norm", ctypes.c_void_p), ("next_norm", ctypes.c_void_p), ("post_eps", ctypes.c_float),
                ("next_eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _group_struct(group: LoraLinears) -> _Group:
    cols, a_ptrs, b_ptrs, ranks, scalings, adapter_code, _ = group._args
    address = ctypes.addressof
    form = _CodedForm() if group._coded_form is None else group._coded_form
    return _Group(group.weight.data_ptr(), group.weight.stride(0), group.weight.shape[0], form,
                  None if group.bias is None else group.bias.data_ptr(), len(group.sizes), address(cols),
                  address(a_ptrs), address(b_ptrs), address(ranks), address(scalings), adapter_code)


@dataclass(frozen=True)
class LayerPlan:
    """One Llama-shaped layer for :func:`decode_layers`: its four projection groups (q/k/v, o, gate/up, down), the
    norm after attention and the norm after the MLP (the next layer's input norm; the final norm after the last
    layer) as ``(weight, eps)``, and the attention's scale."""

    qkv: LoraLinears
    o: LoraLinears
    gate_up: LoraLinears
    down: LoraLinears
    post_norm: tuple[torch.Tensor, float]
    next_norm: tuple[torch.Tensor, float]
    scale: float


@dataclass(frozen=True)
class DecodeLayers:
    """Every layer of a decoder prepared for :func:`decode_layers` (the C structs, and what they point to)."""

    plans: tuple[LayerPlan, ...]
    dtype: torch.dtype
    slots: int
    heads: int
    kv_heads: int
    head_dim: int
    _structs: ctypes.Array
    _norms: tuple[torch.Tensor, ...]

    @classmethod
    def prepare(cls, plans: Sequence[LayerPlan], heads: int, kv_heads: int, head_dim: int) -> DecodeLayers | None:
        """The layers, or ``None`` where ``decode_layers`` cannot run them as :func:`lora_linears` and the other calls
        here would one by one: the groups, norms and hidden states of one dtype, the same adapter slots in every
        group, and each group as wide as the layer's shape says (q/k/v ``(H + 2 Hkv) D``, o and down the hidden
        size, gate/up twice down's input)."""
        if not plans:
            return None
        dtype, slots = plans[0].qkv.weight.dtype, len(plans[0].qkv.slots)
        hidden, inner = plans[0].o.weight.shape[0], plans[0].down.weight.shape[1]
        widths = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                  "gate_up": (2 * inner, hidden), "down": (hidden, inner)}
        for plan in plans:
            for name, shape in widths.items():
                group = getattr(plan, name)
                if (tuple(group.weight.shape) != shape or group.weight.dtype != dtype or len(group.slots) != slots
                        or group.weight.stride(-1) != 1):
                    return None
            if any(norm.dtype != dtype or norm.shape != (hidden,) for norm, _ in (plan.post_norm, plan.next_norm)):
                return None
        norms = tuple(norm.contiguous() for plan in plans for norm, _ in (plan.post_norm, plan.next_norm))
        structs = (_Layer * len(plans))(*[
            _Layer(_group_struct(plan.qkv), _group_struct(plan.o), _group_struct(plan.gate_up),
                   _group_struct(plan.down), norms[2 * i].data_ptr(), norms[2 * i + 1].data_ptr(), plan.post_norm[1],
                   plan.next_norm[1], plan.scale) for i, plan in enumerate(plans)])
        return cls(tuple(plans), dtype, slots, heads, kv_heads, head_dim, structs, norms)

    @property
    def group_widths(self) -> tuple[int, int, int, int]:
        """Each layer's groups' output widths, in the order the groups run (and their outputs are kept)."""
        plan = self.plans[0]
        return tuple(group.weight.shape[0] for group in (plan.qkv, plan.o, plan.gate_up, plan.down))


@_profiled
def decode_layers(h: torch.Tensor, x: torch.Tensor, layers: DecodeLayers, keys: Sequence[torch.Tensor],
                  values: Sequence[torch.Tensor], lengths: torch.Tensor, key_positions: torch.Tensor,
                  key_valid: torch.Tensor, window: int, cos: torch.Tensor, sin: torch.Tensor,
                  parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  bounds: Sequence[int] | None = None,
                  kept: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """A decode step's layers in one call: for each layer, what :func:`lora_linears` (q/k/v) | :func:`rotary_` |
    :func:`cached_attention` | :func:`lora_linears` (o) | :func:`add_rms_norm` | :func:`lora_linears` (gate/up) |
    :func:`silu_mul` | :func:`lora_linears` (down) | :func:`add_rms_norm` give, bit for bit, over ``M`` rows.

    ``h`` ``[M, E]``: the residual stream (the embeddings), changed in place; ``x``: the first layer's normed input,
    changed in place to the final norm's output, which is returned. ``keys[l]``, ``values[l]`` and the cache
    arguments (``lengths`` to ``window``, ``parts``): layer ``l``'s :func:`cached_attention`'s. ``cos``, ``sin``
    ``[M, D]``; ``bounds``: :func:`lora_linears`'s. ``kept`` (4 per layer, in the order the groups run, ``None``
    where not kept): :func:`lora_linears`' ``kept`` of each group."""
    m, e = h.shape
    count = len(layers.plans)
    t = _code(h, "decode_layers")
    bounds = _slot_bounds("decode_layers", bounds, m, layers.slots)
    if (h.dtype != layers.dtype or x.dtype != h.dtype or x.shape != h.shape
            or not (h.is_contiguous() and x.is_contiguous())
            or len(keys) != count or len(values) != count or keys[0].shape[0] != m or window > keys[0].shape[1]):
        raise ValueError(f"decode_layers: hidden {tuple(h.shape)} {h.dtype} for {count} layers of {layers.dtype}, "
                         f"cache of {keys[0].shape[0] if keys else 0} rows, window {window}")
    first = keys[0]
    if any(cache.dtype != h.dtype or cache.shape != first.shape or cache.stride() != first.stride()
           for cache in (*keys, *values)) or first.stride(1) != layers.kv_heads * layers.head_dim:
        raise ValueError(f"decode_layers: every layer's keys and values must be {h.dtype} caches shaped and strided "
                         f"alike, [rows, capacity, {layers.kv_heads}, {layers.head_dim}] (the first: "
                         f"{tuple(first.shape)} {first.dtype})")
    if cos.dtype != h.dtype or sin.dtype != h.dtype or cos.shape != (m, layers.head_dim) or sin.shape != cos.shape:
        raise ValueError(f"decode_layers: cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} "
                         f"for {m} rows of {h.dtype} with heads of {layers.head_dim}")
    widths = layers.group_widths
    if kept is not None:
        if len(kept) != 4 * count:
            raise ValueError(f"decode_layers: {len(kept)} kept products for {count} layers of 4 groups")
        for index, out in enumerate(kept):
            if out is not None and (out.shape != (m, widths[index % 4]) or out.dtype != h.dtype
                                    or not out.is_contiguous()):
                raise ValueError(f"decode_layers: kept product {index} is {tuple(out.shape)} {out.dtype}")
    if m == 0:
        return x
    cos, sin = cos.contiguous(), sin.contiguous()
    order = starts = reload = None
    part_count = 0
    if parts is not None:
        order, starts, reload = parts
        part_count = starts.numel() - 1
    pointers = ctypes.c_void_p * count
    kept_ptrs = None if kept is None else (ctypes.c_void_p * len(kept))(*[_ptr(out) for out in kept])
    _check(load_library().decode_layers(
        _ptr(h), _ptr(x), m, e, t, count, layers._structs, pointers(*[k.data_ptr() for k in keys]),
        pointers(*[v.data_ptr() for v in values]), keys[0].stride(0), _ptr(lengths), _ptr(key_positions),
        _ptr(key_valid), window, layers.heads, layers.kv_heads, layers.head_dim, _ptr(cos), _ptr(sin), _ptr(order),
        _ptr(starts), _ptr(reload), part_count, layers.slots, (ctypes.c_int64 * len(bounds))(*bounds), kept_ptrs,
        _threads()), "decode_layers")
    return x
