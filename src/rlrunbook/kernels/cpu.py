"""The fixed-order CPU kernels on tensors (no autograd): shapes checked, storage types mapped, threads passed.

Every function takes float32 or bfloat16 CPU tensors (2-D matrices may be row-strided views; their
last dimension must be contiguous) and computes with PyTorch's intra-op thread count. The orders are
those of ``c/fixed_order.h``: ``lanes16`` (``pairs16`` for two bfloat16 inputs) for :func:`gemm_nt` and
:func:`row_sumsq`, ``lanes64`` for :func:`row_logsumexp`, ``sequential`` for :func:`gemm_seq` (see
:mod:`rlrunbook.kernels`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rlrunbook.kernels.build import KernelBuildError, load_library
from rlrunbook.kernels.profiling import profiled

_CODES = {torch.float32: 0, torch.bfloat16: 1}
SMALL_K = 64  # products reducing over at most this many terms (LoRA's second factor) use the sequential order


def _code(t: torch.Tensor, what: str) -> int:
    code = _CODES.get(t.dtype)
    if code is None or t.device.type != "cpu":
        raise TypeError(f"{what}: a float32 or bfloat16 CPU tensor is needed, got {t.dtype} on {t.device}")
    return code


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix whose rows are contiguous (a copy only where they are not); float16, which the kernels do
    not read, as float32 (exact)."""
    t = t.float() if t.dtype == torch.float16 else t
    return t if t.stride(-1) == 1 and t.stride(0) >= t.shape[1] else t.contiguous()


def _stored(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel writes for a result wanted in ``out_dtype`` (float16 is rounded from float32 after)."""
    return torch.float32 if out_dtype == torch.float16 else out_dtype


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _threads() -> int:
    return torch.get_num_threads()


_profiled = profiled  # the name this package's C wrappers use


def _check(status: int, name: str) -> None:
    if status:
        raise MemoryError(f"the fixed-order kernel {name} could not allocate its scratch memory")


@_profiled
def gemm_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T (+ bias)``: ``a`` ``[M, K]``, ``b`` ``[N, K]`` -> ``[M, N]``; each sum over k in lanes16 order
    (pairs16 when both are bfloat16)."""
    a, b = _rows(a), _rows(b)
    (m, k), n = a.shape, b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"gemm_nt: a is {tuple(a.shape)} and b is {tuple(b.shape)}")
    if out_dtype != _stored(out_dtype):
        return gemm_nt(a, b, bias, _stored(out_dtype)).to(out_dtype)
    out = torch.empty(m, n, dtype=out_dtype)
    if m and n:
        bias32 = None if bias is None else bias.detach().float().contiguous()
        _check(load_library().gemm_nt(_ptr(a), _code(a, "a"), a.stride(0), _ptr(b), _code(b, "b"), b.stride(0),
                                      _ptr(bias32), _ptr(out), _code(out, "out"), n, m, n, k, _threads()), "gemm_nt")
    return out


@_profiled
def gemm_seq(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             a_transposed: bool = False) -> torch.Tensor:
    """``a @ b (+ bias)`` with each sum over k in increasing k: ``a`` ``[M, K]`` (or, with ``a_transposed``,
    ``[K, M]`` standing for its transpose), ``b`` ``[K, N]`` -> ``[M, N]``."""
    a, b = _rows(a), _rows(b)
    m, k = (a.shape[1], a.shape[0]) if a_transposed else a.shape
    n = b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"gemm_seq: a is {tuple(a.shape)} (transposed: {a_transposed}) and b is {tuple(b.shape)}")
    if out_dtype != _stored(out_dtype):
        return gemm_seq(a, b, bias, _stored(out_dtype), a_transposed).to(out_dtype)
    out = torch.empty(m, n, dtype=out_dtype)
    if m and n:
        if k == 0:
            return out.zero_() if bias is None else out.copy_(bias.float().expand(m, n))
        sam, sak = (1, a.stride(0)) if a_transposed else (a.stride(0), 1)
        bias32 = None if bias is None else bias.detach().float().contiguous()
        _check(load_library().gemm_seq(_ptr(a), _code(a, "a"), sam, sak, _ptr(b), _code(b, "b"), b.stride(0),
                                       _ptr(bias32), _ptr(out), _code(out, "out"), n, m, n, k, _threads()),
               "gemm_seq")
    return out


@_profiled
def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """``(x ** 2).sum(-1)`` in float32 for ``[M, E]`` ``x``, lanes16 order."""
    x = _rows(x)
    out = torch.empty(x.shape[0], dtype=torch.float32)
    if x.shape[0]:
        load_library().row_sumsq(_ptr(x), _code(x, "x"), x.stride(0), x.shape[0], x.shape[1], _ptr(out), _threads())
    return out


@_profiled
def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x, -1)`` of float32 ``[M, V]`` ``x``: the max, then a lanes64 sum of ``exp(x - max)``."""
    if x.dtype != torch.float32:
        raise TypeError(f"row_logsumexp takes float32, got {x.dtype}")
    x = _rows(x)
    out = torch.empty(x.shape[0], dtype=torch.float32)
    if x.shape[0]:
        load_library().row_logsumexp(_ptr(x), x.stride(0), x.shape[0], x.shape[1], _ptr(out), _threads())
    return out


@_profiled
def log_softmax_at_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                        grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``log_softmax(logits)[m, targets[m]]`` (``[M, V]`` float32 logits, ``[M]`` float32 ``lse``,
    their rows' log-sum-exps) for the logprobs' gradient ``grad`` ``[M]``: ``[M, V]`` float32 with the bits of
    ``ops.log_softmax_at``'s autograd chain, in one pass (c/fused.c ``log_softmax_at_grad``); a new contiguous
    tensor. A target outside ``[0, V)`` is a ``ValueError``."""
    logits = _rows(logits)
    m, v = logits.shape
    if logits.dtype != torch.float32 or lse.shape != (m,) or targets.shape != (m,) or grad.shape != (m,):
        raise ValueError(f"log_softmax_at_grad: logits {tuple(logits.shape)} {logits.dtype}, lse {tuple(lse.shape)}, "
                         f"targets {tuple(targets.shape)}, grad {tuple(grad.shape)}")
    targets = targets.to(torch.long).contiguous()
    if m and (bool((targets < 0).any()) or bool((targets >= v).any())):
        raise ValueError(f"log_softmax_at_grad: a target outside the {v} columns")
    lse, grad = lse.float().contiguous(), grad.float().contiguous()
    out = torch.empty(m, v, dtype=torch.float32)
    if out.numel():
        load_library().log_softmax_at_grad(_ptr(logits), logits.stride(0), _ptr(lse), _ptr(targets), _ptr(grad),
                                           _ptr(out), m, v, _threads())
    return out


@_profiled
def gather_rows(sources: Sequence[torch.Tensor | None], source_of: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """``[M, N]``: row ``m`` is row ``row_of[m]`` of ``sources[source_of[m]]`` (``[M]`` int64 each), copied in one pass
    (c/rows.c ``gather_rows``): rows of several CPU tensors of one dtype and width, each row contiguous, where one
    ``index_select`` and an ``index_put_`` per source would pass over the output once per source. ``None``: a source
    no row reads. A new contiguous tensor; an index out of range is a ``ValueError``, never a read outside a tensor."""
    used = [s for s in sources if s is not None]
    if not used or any(s.device.type != "cpu" or s.dim() != 2 or s.stride(1) != 1 or s.dtype != used[0].dtype
                       or s.shape[1] != used[0].shape[1] for s in used):
        raise ValueError("gather_rows: CPU matrices of one dtype and width with contiguous rows are needed, got "
                         f"{[None if s is None else (tuple(s.shape), s.stride(), s.dtype, str(s.device)) for s in sources]}")
    width, itemsize = used[0].shape[1], used[0].element_size()
    lengths = torch.tensor([0 if s is None else s.shape[0] for s in sources], dtype=torch.long)
    source_of, row_of = source_of.to(torch.long), row_of.to(torch.long)
    if source_of.numel() and (bool((source_of < 0).any()) or int(source_of.max()) >= len(sources)
                              or bool((row_of < 0).any()) or bool((row_of >= lengths[source_of]).any())):
        raise ValueError(f"gather_rows: a row outside its source (sources of {lengths.tolist()} rows)")
    bases = torch.tensor([0 if s is None else s.data_ptr() for s in sources], dtype=torch.long)
    strides = torch.tensor([0 if s is None else s.stride(0) * itemsize for s in sources], dtype=torch.long)
    addresses = (bases[source_of] + row_of * strides[source_of]).contiguous()
    out = torch.empty(source_of.numel(), width, dtype=used[0].dtype)
    if out.numel():
        load_library().gather_rows(_ptr(addresses), width * itemsize, _ptr(out), out.shape[0], _threads())
    return out


def _elementwise(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} takes float32, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        getattr(load_library(), name)(_ptr(x), _ptr(out), x.numel(), _threads())
    return out


@_profiled
def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` elementwise (float32), the same bits wherever an element sits."""
    return _elementwise("exp_f32", x)


@_profiled
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` elementwise (float32), the same bits wherever an element sits."""
    return _elementwise("sigmoid_f32", x)


@_profiled
def add_scaled(result: torch.Tensor, delta: torch.Tensor, scaling: float) -> torch.Tensor:
    """``result + round(delta * scaling)`` for two ``[M, N]`` tensors of one dtype (float32 or bfloat16) whose rows are
    contiguous: each element rounded where PyTorch's ``result + delta * scaling`` rounds it; a new contiguous tensor."""
    result, delta = _rows(result), _rows(delta)
    out = torch.empty(result.shape, dtype=result.dtype)
    if out.numel():
        _check(load_library().add_scaled(_ptr(result), result.stride(0), _ptr(delta), delta.stride(0), scaling,
                                         _ptr(out), result.shape[0], result.shape[1], _code(result, "result"),
                                         _threads()), "add_scaled")
    return out


# A LoRA second factor's transpose ([r, N], what lora_added reads), by factor: made again only when the factor changed
# in place (its version counter) or moved. A decoder's factors are the same tensors call after call (a pinned snapshot,
# a parameter between optimizer steps), and the output layer's is the largest (vocabulary x rank: 1.5 ms to copy at
# rank 16): its copy once per snapshot, not once per decode step.
_TRANSPOSES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _transposed(b: torch.Tensor) -> torch.Tensor:
    """``b.t().contiguous()``, kept per factor while ``b`` lives and holds the same values (see ``_TRANSPOSES``)."""
    if b.is_inference() or torch.is_inference_mode_enabled():  # no version counter to tell a change by: not kept
        return b.t().contiguous()
    stamp = (b._version, b.data_ptr(), b.shape, b.stride())
    held = _TRANSPOSES.get(b)
    if held is None or held[0] != stamp:
        held = (stamp, b.detach().t().contiguous())
        _TRANSPOSES[b] = held
    return held[1]


@_profiled
def lora_added(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``add_scaled(base, gemm_seq(xa, b.T), scaling)`` in one pass with the same bits (c/fused.c ``lora_added``):
    ``base`` ``[M, N]``, ``xa`` ``[M, r]`` and ``b`` ``[N, r]`` of one dtype (float32 or bfloat16; ``base`` may be
    the other one, the sum then in float32 rounded to ``base``'s dtype), ``r`` at most ``SMALL_K`` (the sequential
    sum); a new contiguous tensor. The ``[M, N]`` product is never stored."""
    m, n, r = base.shape[0], base.shape[1], xa.shape[1]
    if xa.dtype != b.dtype or base.dim() != 2 or xa.shape[0] != m or b.shape != (n, r) or r > SMALL_K:
        raise ValueError(f"lora_added: base {tuple(base.shape)} {base.dtype}, xa {tuple(xa.shape)} {xa.dtype}, "
                         f"b {tuple(b.shape)} {b.dtype} (rank at most {SMALL_K})")
    base, xa = _rows(base), _rows(xa)
    bt = _transposed(b)
    out = torch.empty(base.shape, dtype=base.dtype)
    if out.numel():
        if r == 0:
            return out.copy_(base)
        _check(load_library().lora_added(_ptr(base), base.stride(0), _ptr(xa), xa.stride(0), _ptr(bt), n, scaling,
                                         _ptr(out), n, m, n, r, _code(xa, "xa"), _code(base, "base"), _threads()),
               "lora_added")
    return out


@_profiled
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for two ``[N, I]`` tensors of one dtype (float32 or bfloat16) whose rows are contiguous:
    the bits of ``ops.silu(gate) * up`` (each step rounded where the chain rounds it); a new contiguous tensor."""
    gate, up = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    if out.numel():
        _check(load_library().silu_mul_rows(_ptr(gate), gate.stride(0), _ptr(up), up.stride(0), _ptr(out),
                                            gate.shape[0], gate.shape[1], _code(gate, "gate"), _threads()),
               "silu_mul_rows")
    return out


@_profiled
def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`silu_mul` for the output's gradient ``grad``: ``(d gate, d up)``, the bits of the
    chain's autograd through ``ops.silu(gate) * up``; the two halves of one ``[N, 2 I]`` tensor (the gradient of a
    gate/up projection group's outputs as they sit side by side: :func:`rlrunbook.kernels.ops.split_columns` passes
    it on without a copy)."""
    gate, up, grad = _rows(gate), _rows(up), _rows(grad.to(gate.dtype))
    rows, width = gate.shape
    both = torch.empty(rows, 2 * width, dtype=gate.dtype)
    d_gate, d_up = both[:, :width], both[:, width:]
    if gate.numel():
        _check(load_library().silu_mul_rows_backward(
            _ptr(gate), gate.stride(0), _ptr(up), up.stride(0), _ptr(grad), grad.stride(0), _ptr(d_gate), _ptr(d_up),
            2 * width, rows, width, _code(gate, "gate"), _threads()), "silu_mul_rows_backward")
    return d_gate, d_up


@_profiled
def rotation(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """transformers' rotation ``x * cos + rotate_half(x) * sin`` of ``[N, H, D]`` ``x`` (``cos``, ``sin`` ``[N, D]``
    of ``x``'s dtype, shared by the heads), each product and the sum rounded to ``x``'s dtype as that chain rounds
    them; with ``backward``, ``x`` is the output's gradient and the result the gradient autograd gives through the
    chain. A new contiguous tensor. (Named apart from the Triton backends' ``rotary``, whose presence
    :func:`rlrunbook.kernels.ops.layer_kernels` reads.)"""
    rows, heads, dim = x.shape
    if cos.shape != (rows, dim) or sin.shape != (rows, dim) or dim % 2:
        raise ValueError(f"rotation: x {tuple(x.shape)} with cos {tuple(cos.shape)} and sin {tuple(sin.shape)}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError(f"rotation: cos and sin must be x's dtype {x.dtype}, got {cos.dtype} and {sin.dtype}")
    t = _code(x, "x")
    out = x.clone(memory_format=torch.contiguous_format)
    cos, sin = cos.contiguous(), sin.contiguous()
    if out.numel():
        kernel = load_library().rotary_grad if backward else load_library().rotary
        _check(kernel(_ptr(out), heads * dim, rows, heads, dim, _ptr(cos), _ptr(sin), t, _threads()), "rotation")
    return out


@_profiled
def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` ``[P, F]`` (float32) of ``float32(position * inv_freq)``, each from libm in double."""
    positions = positions.to(torch.int64).contiguous()
    inv_freq = inv_freq.detach().float().contiguous()
    cos = torch.empty(positions.numel(), inv_freq.numel())
    sin = torch.empty_like(cos)
    if cos.numel():
        load_library().rope_table(_ptr(positions), positions.numel(), _ptr(inv_freq), inv_freq.numel(), _ptr(cos),
                                  _ptr(sin))
    return cos, sin


def _attention_layout(q, k, v, query_positions, key_positions, key_valid):
    rows, _, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads or v.shape != k.shape or k.shape[0] != rows or k.shape[3] != dim:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    q = q if q[0].is_contiguous() else q.contiguous()
    k = k if k[0].is_contiguous() else k.contiguous()
    v = v if v.stride() == k.stride() else v.contiguous()
    if v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    query_positions = query_positions.to(torch.int64).contiguous()
    pos_rows = key_positions.shape[0]
    key_positions = key_positions.to(torch.int64).expand(pos_rows, keys).contiguous()
    key_valid = key_valid.to(torch.uint8).expand(pos_rows, keys).contiguous()
    return q, k, v, query_positions, key_positions, key_valid, pos_rows


@_profiled
def attention_forward(q, k, v, query_positions, key_positions, key_valid, scale: float):
    """``(out, lse)``: ``out`` ``[R, T, H, D]`` in q's dtype, ``lse`` ``[R, T, H]`` float32 (see c/attention.c)."""
    if q.dtype == torch.float16:  # computed from the exact float32 values, rounded back
        out, lse = attention_forward(q.float(), k.float(), v.float(), query_positions, key_positions, key_valid, scale)
        return out.half(), lse
    q, k, v, qpos, kpos, kvalid, pos_rows = _attention_layout(q, k, v, query_positions, key_positions, key_valid)
    rows, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    out = torch.empty(rows, queries, heads, dim, dtype=q.dtype)
    lse = torch.empty(rows, queries, heads, dtype=torch.float32)
    if out.numel():
        _check(load_library().attention_fwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(qpos), _ptr(kpos), _ptr(kvalid), _ptr(out), _ptr(lse), rows, queries,
            keys, heads, kv_heads, dim, q.stride(0), k.stride(0), pos_rows, _code(q, "q"), _code(k, "k"), scale,
            _threads()), "attention_fwd")
    return out, lse


@_profiled
def attention_backward(q, k, v, query_positions, key_positions, key_valid, out, grad_out, lse, scale: float):
    """``(dq, dk, dv)`` of :func:`attention_forward`, each contiguous in its input's shape and dtype."""
    if q.dtype == torch.float16:
        grads = attention_backward(q.float(), k.float(), v.float(), query_positions, key_positions, key_valid,
                                   out.float(), grad_out.float(), lse, scale)
        return tuple(g.half() for g in grads)
    q, k, v, qpos, kpos, kvalid, pos_rows = _attention_layout(q, k, v, query_positions, key_positions, key_valid)
    rows, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    out = out.contiguous() if out.stride() != q.stride() else out
    grad_out = grad_out.to(q.dtype)
    grad_out = grad_out.contiguous() if grad_out.stride() != q.stride() else grad_out
    if out.stride() != q.stride() or grad_out.stride() != q.stride():
        q, out, grad_out = q.contiguous(), out.contiguous(), grad_out.contiguous()
    dq = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype)
    dk = torch.empty(rows, keys, kv_heads, dim, dtype=k.dtype)
    dv = torch.empty_like(dk)
    if dq.numel() and dk.numel():
        _check(load_library().attention_bwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(qpos), _ptr(kpos), _ptr(kvalid), _ptr(out), _ptr(grad_out),
            _ptr(lse.contiguous()), _ptr(dq), _ptr(dk), _ptr(dv), rows, queries, keys, heads, kv_heads, dim,
            q.stride(0), k.stride(0), pos_rows, _code(q, "q"), _code(k, "k"), scale, _threads()), "attention_bwd")
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv


__all__ = [
    "KernelBuildError",
    "add_scaled",
    "attention_backward",
    "attention_forward",
    "exp",
    "gemm_nt",
    "gemm_seq",
    "lora_added",
    "rope_table",
    "row_logsumexp",
    "row_sumsq",
    "sigmoid",
]


# -- the seeded draw (c/draw.c) -----------------------------------------------------------------------

DRAW_MODES = {"logits": 0, "temperature": 1, "filtered": 2, "greedy": 3}


@functools.cache
def _seeded_draw_function():
    """``seeded_draw`` of the compiled library, its argument types declared (here, beside its wrapper)."""
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    function = load_library().seeded_draw
    function.restype = i
    function.argtypes = [p, i64, p, i64, p, i64, i64, i64, i, f, p, p, p, i64, i64, p, p, i]
    return function


@_profiled
def seeded_draw(logits: torch.Tensor, row_seeds: torch.Tensor, step: int, mode: str, temperature: float,
                filtered: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor, policy: torch.Tensor,
                column: int, feed: torch.Tensor | None = None, feed_index: torch.Tensor | None = None) -> None:
    """One seeded draw per row of float32 ``[R, V]`` ``logits`` (c/draw.c), written in place: ``token`` (int64),
    ``sampled`` and ``policy`` (float32) are ``[R, W]`` buffers with contiguous rows, of which column ``column``
    is set; with ``feed``, ``feed[feed_index[r]]`` is set to row ``r``'s token as well. ``mode`` is a key of
    ``DRAW_MODES``; ``filtered`` holds the scores for ``"filtered"``. The caller checks shapes and dtypes
    (:func:`rlrunbook.kernels.ops.seeded_draw`)."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    status = _seeded_draw_function()(
        _ptr(logits), logits.stride(0), _ptr(filtered), 0 if filtered is None else filtered.stride(0),
        _ptr(row_seeds), step, rows, vocab, DRAW_MODES[mode], temperature, _ptr(token), _ptr(sampled),
        _ptr(policy), token.stride(0), column, _ptr(feed), _ptr(feed_index), _threads())
    _check(status, "seeded_draw")
