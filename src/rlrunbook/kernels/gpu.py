"""The fixed-order kernels on CUDA, in Triton: the interface of :mod:`rlrunbook.kernels.cpu`.

cuBLAS picks a kernel (split-K among them) by shape and PyTorch's reductions lay out their threads by the
number of rows, so on a GPU a row's sums follow the batch. Here every tile size is a constant, never chosen
by shape: a product sums its ``k`` in blocks of ``BLOCK_K`` in increasing order, each block by one tensor-core
instruction sequence (whose internal order is the hardware's, the same for every output element), into a
float32 accumulator; a row reduction runs in one program per row over blocks of ``BLOCK`` in increasing order,
its lanes added by the compiler's fixed tree; attention walks a query's keys in blocks of a size fixed per
dtype (``ATTN_BLOCKS``) from key 0 (a block the query may not read changes nothing: its weights are exactly 0
and its rescaling factor exactly 1). No atomics; the sizes that vary (rows, queries, keys) are not specialised
on. Elementwise functions (exp, sigmoid, cos) are PyTorch's: on CUDA each element is computed by the same
function wherever it sits.

fp32 products use full-precision products (``input_precision="ieee"``), not TF32. The same kernels run on CPU
under ``TRITON_INTERPRET=1`` (the tests check their arithmetic and their invariance there, at small shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rlrunbook.kernels.gpu_draw import seeded_draw  # noqa: F401  (dispatched to through this module)
from rlrunbook.kernels.gpu_layer import (  # noqa: F401  (dispatched to through this module)
    rms_norm,
    rms_norm_backward,
    rotary,
    silu_mul,
    silu_mul_backward,
)
from rlrunbook.kernels.profiling import profiled

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32
ROW_BLOCK = 1024
# Attention blocks (queries, keys) by dtype: float32 tiles are twice the bytes, and a block's shared memory must fit
# the smaller GPUs too (99 KB per block on sm_86 and sm_89) at head size 128.
ATTN_BLOCKS = {"forward": {torch.bfloat16: (32, 64), torch.float16: (32, 64), torch.float32: (32, 32)},
               "backward": {torch.bfloat16: (32, 32), torch.float16: (32, 32), torch.float32: (16, 32)}}
NUM_WARPS = 4


def _interpreted() -> bool:
    """Whether the kernels run under ``TRITON_INTERPRET=1`` (CPU tests), where ``tl.dot`` would be numpy's BLAS
    (whose order follows its own choices, and which multiplies bfloat16 tiles wrongly): a block's products are then
    summed by :func:`_block_dot`'s fixed-order stand-in for the tensor cores."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _block_dot(a, b, acc, INTERPRETED: tl.constexpr):
    """``acc + a @ b`` for one block: the tensor cores on a GPU; interpreted, float32 products summed over k by
    ``tl.sum`` (a fixed order for the block's shape)."""
    if INTERPRETED:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if a.dtype == tl.float32:  # full-precision products, not TF32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["M", "N", "K"])
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, base_ptr, c_ptr, M, N, K, sam, sak, sbk, sbn, sbase, scm, scn, scaling,
                   HAS_BIAS: tl.constexpr, HAS_BASE: tl.constexpr, DELTA: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, F32DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        a = tl.load(a_ptr + rm[:, None] * sam + ks[None, :] * sak, mask=(rm[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        b = tl.load(b_ptr + ks[:, None] * sbk + rn[None, :] * sbn, mask=(ks[:, None] < K) & (rn[None, :] < N),
                    other=0.0)
        if a_ptr.dtype.element_ty != b_ptr.dtype.element_ty:  # one of them float32: both read as float32 (exact)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = _block_dot(a, b, acc, F32DOT)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BASE:  # base + (the product, stored as DELTA) * scaling (rounded as DELTA), in float32, stored as base's
        delta = (acc.to(DELTA).to(tl.float32) * scaling).to(DELTA).to(tl.float32)
        base = tl.load(base_ptr + rm[:, None] * sbase + rn[None, :], mask=(rm[:, None] < M) & (rn[None, :] < N),
                       other=0.0)
        acc = base.to(tl.float32) + delta
    tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _matmul(a: torch.Tensor, a_strides: tuple[int, int], b: torch.Tensor, b_strides: tuple[int, int], m: int, n: int,
            k: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
            added_to: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` of ``[M, K]`` and ``[K, N]`` given by their strides. ``added_to`` ``(base, scaling)``:
    ``base + (a @ b, rounded to out_dtype) * scaling`` instead, rounded to ``base``'s dtype (``[M, N]``, rows
    contiguous), the product computed as without it."""
    base = None if added_to is None else added_to[0]
    out = torch.empty(m, n, dtype=out_dtype if base is None else base.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bias32 = None if bias is None else bias.detach().float().contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](a, b, bias32 if bias32 is not None else out, base if base is not None else out, out, m, n, k,
                         *a_strides, *b_strides, base.stride(0) if base is not None else 0, out.stride(0),
                         out.stride(1), 1.0 if added_to is None else float(added_to[1]), HAS_BIAS=bias32 is not None,
                         HAS_BASE=base is not None, DELTA=_TL_DTYPES[out_dtype], BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         F32DOT=_interpreted(), num_warps=NUM_WARPS)
    return out


def _common(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands of two dtypes: as they are where one is float32 (the kernel reads both as float32), else float32."""
    if a.dtype == b.dtype or torch.float32 in (a.dtype, b.dtype):
        return a, b
    return a.float(), b.float()


@profiled
def gemm_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T (+ bias)``: ``a`` ``[M, K]``, ``b`` ``[N, K]`` -> ``[M, N]``, ``k`` in blocks of ``BLOCK_K``."""
    a, b = _common(a, b)
    return _matmul(a, (a.stride(0), a.stride(1)), b, (b.stride(1), b.stride(0)), a.shape[0], b.shape[0], a.shape[1],
                   bias, out_dtype)


@profiled
def gemm_seq(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
             a_transposed: bool = False) -> torch.Tensor:
    """``a @ b (+ bias)`` (``a`` ``[M, K]``, or ``[K, M]`` standing for its transpose) ``b`` ``[K, N]``."""
    a, b = _common(a, b)
    m, k = (a.shape[1], a.shape[0]) if a_transposed else a.shape
    strides = (a.stride(1), a.stride(0)) if a_transposed else (a.stride(0), a.stride(1))
    return _matmul(a, strides, b, (b.stride(0), b.stride(1)), m, b.shape[1], k, bias, out_dtype)


@profiled
def lora_added(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """A LoRA update added to its base result as peft adds it, in one kernel: ``base + (xa @ b.T) * scaling``
    (``base`` ``[M, N]``, ``xa`` ``[M, r]`` and ``b`` ``[N, r]`` of one dtype), the product and its scaled value
    rounded to that dtype, the sum in float32 rounded to ``base``'s dtype."""
    if xa.dtype != b.dtype or base.shape != (xa.shape[0], b.shape[0]):
        raise ValueError(f"lora_added: base {tuple(base.shape)} {base.dtype}, xa {tuple(xa.shape)} {xa.dtype}, "
                         f"b {tuple(b.shape)} {b.dtype}")
    base = base if base.stride(-1) == 1 else base.contiguous()
    return _matmul(xa, (xa.stride(0), xa.stride(1)), b, (b.stride(1), b.stride(0)), xa.shape[0], b.shape[0],
                   xa.shape[1], None, xa.dtype, added_to=(base, scaling))


@triton.jit(do_not_specialize=["E"])
def _row_sumsq_kernel(x_ptr, out_ptr, E, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK):
        cols = e0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < E, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


def _per_row(kernel, x: torch.Tensor) -> torch.Tensor:
    """``kernel`` run as one program per row of ``[M, N]`` ``x``, each writing one float32: ``[M]``."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), BLOCK=ROW_BLOCK, num_warps=NUM_WARPS)
    return out


@profiled
def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """``(x.float() ** 2).sum(-1)`` of ``[M, E]`` ``x``: one program per row."""
    return _per_row(_row_sumsq_kernel, x)


@triton.jit(do_not_specialize=["V"])
def _row_logsumexp_kernel(x_ptr, out_ptr, V, sx, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < V, other=float("-inf"))
        top = tl.maximum(top, x)
    m = tl.max(top, axis=0)  # a NaN is lost here, but not below: exp(NaN - shift) makes the sum NaN
    shift = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < V, other=float("-inf"))
        acc += tl.exp(x - shift)
    tl.store(out_ptr + row, shift + tl.log(tl.sum(acc, axis=0)))


@profiled
def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x, -1)`` of float32 ``[M, V]`` ``x``: one program per row, the max, then the sum of exps."""
    return _per_row(_row_logsumexp_kernel, x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


@triton.jit(do_not_specialize=["T", "S"])
def _attention_fwd_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, kvalid_ptr, out_ptr, lse_ptr, T, S, H, G,
                          sq_r, sq_t, sk_r, sk_s, sp_r, scale, D: tl.constexpr, DP: tl.constexpr,
                          BT: tl.constexpr, BS: tl.constexpr, F32DOT: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    t_block = tl.program_id(2)
    kvh = h // G
    rt = t_block * BT + tl.arange(0, BT)
    rd = tl.arange(0, DP)
    qp = tl.load(qpos_ptr + r * T + rt, mask=rt < T, other=-1)
    q = tl.load(q_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], mask=(rt[:, None] < T) & (rd[None, :] < D),
                other=0.0)
    m = tl.full((BT,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BT,), dtype=tl.float32)
    acc = tl.zeros((BT, DP), dtype=tl.float32)
    for s0 in range(0, S, BS):
        rs = s0 + tl.arange(0, BS)
        kp = tl.load(kpos_ptr + r * sp_r + rs, mask=rs < S, other=0)
        kv = tl.load(kvalid_ptr + r * sp_r + rs, mask=rs < S, other=0)
        k = tl.load(k_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :],
                    mask=(rs[:, None] < S) & (rd[None, :] < D), other=0.0)
        s = _block_dot(q, tl.trans(k), tl.zeros((BT, BS), dtype=tl.float32), F32DOT) * scale
        allowed = (kv[None, :] != 0) & (kp[None, :] <= qp[:, None]) & (qp[:, None] >= 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :],
                    mask=(rs[:, None] < S) & (rd[None, :] < D), other=0.0)
        acc = _block_dot(p.to(v.dtype), v, acc * alpha[:, None], F32DOT)
        m = m_new
    out = tl.where(l[:, None] > 0, acc / tl.where(l[:, None] > 0, l[:, None], 1.0), 0.0)
    tl.store(out_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rt[:, None] < T) & (rd[None, :] < D))
    lse = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + (r * T + rt) * H + h, lse, mask=rt < T)


def _layout(q, k, v, query_positions, key_positions, key_valid):
    heads, keys, kv_heads = q.shape[2], k.shape[1], k.shape[2]
    if heads % kv_heads or v.shape != k.shape:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    q = q if q[0].is_contiguous() else q.contiguous()
    if not (k[0].is_contiguous() and v.stride() == k.stride()):
        k, v = k.contiguous(), v.contiguous()
    pos_rows = key_positions.shape[0]
    key_positions = key_positions.to(torch.int64).expand(pos_rows, keys).contiguous()
    key_valid = key_valid.to(torch.int8).expand(pos_rows, keys).contiguous()
    query_positions = query_positions.to(torch.int64).contiguous()
    return q, k, v, query_positions, key_positions, key_valid, (keys if pos_rows > 1 else 0)


@profiled
def attention_forward(q, k, v, query_positions, key_positions, key_valid, scale: float):
    """``(out, lse)`` as :func:`rlrunbook.kernels.cpu.attention_forward` lays them out."""
    q, k, v, qpos, kpos, kvalid, pos_stride = _layout(q, k, v, query_positions, key_positions, key_valid)
    rows, queries, heads, dim = q.shape
    out = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, queries, heads, dtype=torch.float32, device=q.device)
    if out.numel():
        block_t, block_s = ATTN_BLOCKS["forward"][q.dtype]
        grid = (rows, heads, triton.cdiv(queries, block_t))
        _attention_fwd_kernel[grid](q, k, v, qpos, kpos, kvalid, out, lse, queries, k.shape[1], heads,
                                    heads // k.shape[2], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    pos_stride, scale, D=dim, DP=triton.next_power_of_2(dim), BT=block_t,
                                    BS=block_s, F32DOT=_interpreted(), num_warps=NUM_WARPS)
    return out, lse


@triton.jit(do_not_specialize=["T", "S"])
def _attention_dkdv_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, kvalid_ptr, do_ptr, delta_ptr, lse_ptr, dk_ptr,
                           dv_ptr, T, S, H, G, sq_r, sq_t, sk_r, sk_s, sp_r, sdk_r, sdk_s, scale, D: tl.constexpr,
                           DP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, F32DOT: tl.constexpr):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    s_block = tl.program_id(2)
    rs = s_block * BS + tl.arange(0, BS)
    rd = tl.arange(0, DP)
    kmask = (rs[:, None] < S) & (rd[None, :] < D)
    kp = tl.load(kpos_ptr + r * sp_r + rs, mask=rs < S, other=0)
    kv = tl.load(kvalid_ptr + r * sp_r + rs, mask=rs < S, other=0)
    k = tl.load(k_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :], mask=kmask, other=0.0)
    v = tl.load(v_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :], mask=kmask, other=0.0)
    dk = tl.zeros((BS, DP), dtype=tl.float32)
    dv = tl.zeros((BS, DP), dtype=tl.float32)
    for g in range(G):
        h = kvh * G + g
        for t0 in range(0, T, BT):
            rt = t0 + tl.arange(0, BT)
            qmask = (rt[:, None] < T) & (rd[None, :] < D)
            qp = tl.load(qpos_ptr + r * T + rt, mask=rt < T, other=-1)
            q = tl.load(q_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], mask=qmask, other=0.0)
            do = tl.load(do_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], mask=qmask, other=0.0)
            lse = tl.load(lse_ptr + (r * T + rt) * H + h, mask=rt < T, other=0.0)
            delta = tl.load(delta_ptr + (r * T + rt) * H + h, mask=rt < T, other=0.0)
            s = _block_dot(q, tl.trans(k), tl.zeros((BT, BS), dtype=tl.float32), F32DOT) * scale
            allowed = (kv[None, :] != 0) & (kp[None, :] <= qp[:, None]) & (qp[:, None] >= 0)
            p = tl.where(allowed, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]), 0.0)
            dv = _block_dot(tl.trans(p.to(do.dtype)), do, dv, F32DOT)
            dp = _block_dot(do, tl.trans(v), tl.zeros((BT, BS), dtype=tl.float32), F32DOT)
            ds = p * (dp - delta[:, None]) * scale
            dk = _block_dot(tl.trans(ds.to(q.dtype)), q, dk, F32DOT)
    out = r * sdk_r + rs[:, None] * sdk_s + kvh * D + rd[None, :]
    tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kmask)


@triton.jit(do_not_specialize=["T", "S"])
def _attention_dq_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, kvalid_ptr, do_ptr, delta_ptr, lse_ptr, dq_ptr,
                         T, S, H, G, sq_r, sq_t, sk_r, sk_s, sp_r, scale, D: tl.constexpr, DP: tl.constexpr,
                         BT: tl.constexpr, BS: tl.constexpr, F32DOT: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    t_block = tl.program_id(2)
    kvh = h // G
    rt = t_block * BT + tl.arange(0, BT)
    rd = tl.arange(0, DP)
    qmask = (rt[:, None] < T) & (rd[None, :] < D)
    qp = tl.load(qpos_ptr + r * T + rt, mask=rt < T, other=-1)
    q = tl.load(q_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], mask=qmask, other=0.0)
    do = tl.load(do_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], mask=qmask, other=0.0)
    lse = tl.load(lse_ptr + (r * T + rt) * H + h, mask=rt < T, other=0.0)
    delta = tl.load(delta_ptr + (r * T + rt) * H + h, mask=rt < T, other=0.0)
    dq = tl.zeros((BT, DP), dtype=tl.float32)
    for s0 in range(0, S, BS):
        rs = s0 + tl.arange(0, BS)
        kmask = (rs[:, None] < S) & (rd[None, :] < D)
        kp = tl.load(kpos_ptr + r * sp_r + rs, mask=rs < S, other=0)
        kv = tl.load(kvalid_ptr + r * sp_r + rs, mask=rs < S, other=0)
        k = tl.load(k_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :], mask=kmask, other=0.0)
        v = tl.load(v_ptr + r * sk_r + rs[:, None] * sk_s + kvh * D + rd[None, :], mask=kmask, other=0.0)
        s = _block_dot(q, tl.trans(k), tl.zeros((BT, BS), dtype=tl.float32), F32DOT) * scale
        allowed = (kv[None, :] != 0) & (kp[None, :] <= qp[:, None]) & (qp[:, None] >= 0)
        p = tl.where(allowed, tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None]), 0.0)
        dp = _block_dot(do, tl.trans(v), tl.zeros((BT, BS), dtype=tl.float32), F32DOT)
        ds = p * (dp - delta[:, None]) * scale
        dq = _block_dot(ds.to(k.dtype), k, dq, F32DOT)
    tl.store(dq_ptr + r * sq_r + rt[:, None] * sq_t + h * D + rd[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=qmask)


@profiled
def attention_backward(q, k, v, query_positions, key_positions, key_valid, out, grad_out, lse, scale: float):
    """``(dq, dk, dv)`` of :func:`attention_forward`: ``dk``, ``dv`` per key block (looping over the heads and
    query blocks in order), ``dq`` per query block (looping over the key blocks in order); no atomics."""
    q, k, v, qpos, kpos, kvalid, pos_stride = _layout(q, k, v, query_positions, key_positions, key_valid)
    rows, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    grad_out = grad_out.to(q.dtype)
    if grad_out.stride() != q.stride() or out.stride() != q.stride():
        q, out, grad_out = q.contiguous(), out.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # [R, T, H]: per row, one program-free reduction
    dq = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
    dk = torch.empty(rows, keys, kv_heads, dim, dtype=k.dtype, device=k.device)
    dv = torch.empty_like(dk)
    if dq.numel() and dk.numel():
        block_t, block_s = ATTN_BLOCKS["backward"][q.dtype]
        common = {"D": dim, "DP": triton.next_power_of_2(dim), "BT": block_t, "BS": block_s,
                  "F32DOT": _interpreted(), "num_warps": NUM_WARPS}
        _attention_dkdv_kernel[(rows, kv_heads, triton.cdiv(keys, block_s))](
            q, k, v, qpos, kpos, kvalid, grad_out, delta, lse, dk, dv, queries, keys, heads, heads // kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), pos_stride, dk.stride(0), dk.stride(1), scale,
            **common)
        _attention_dq_kernel[(rows, heads, triton.cdiv(queries, block_t))](
            q, k, v, qpos, kpos, kvalid, grad_out, delta, lse, dq, queries, keys, heads, heads // kv_heads,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), pos_stride, scale, **common)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    return dq, dk, dv
