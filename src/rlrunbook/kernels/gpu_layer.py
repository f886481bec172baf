"""A decoder layer's elementwise steps on CUDA, in Triton: RMSNorm, the rotary rotation and the gated activation.

On CUDA the trainer's pass and the decode step both run these kernels (through :mod:`rlrunbook.kernels.ops`, with
autograd), so a row gets the same bits in both by construction: a row's values are computed by one program (the
norm) or element by element (rotation, activation), never from other rows, and in an order fixed by the code. Each
replaces a chain of PyTorch operations (about 8 kernels for a norm, 10 for a rotation, 3 for the activation) by one
kernel each way, which is what a captured decode step of a small model pays for (docs/performance.md).

Each step rounds where the PyTorch chain it replaces rounds (to the tensors' dtype), so the values are that chain's
up to how the compiler evaluates each float32 expression (it may fuse a multiply and an add) and how ``exp``,
``sqrt`` and division are computed. Interpreted on CPU (``TRITON_INTERPRET=1``) the float32 rotation is the chain's,
bit for bit; the norm's sum of squares, the activation's ``exp`` and the interpreter's rounding to bfloat16 (it
truncates) differ from the chain's, so the tests hold those to tolerances. Nothing needs these kernels to match the
chain: both passes run them. Gradients are computed by kernels of the same kind: one program per row for the norm,
whose sum over the row is in a fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlrunbook.kernels.profiling import profiled

ROW_BLOCK = 1024  # a norm's row in blocks of this many, each block's lanes added by the compiler's fixed tree
ELEMENT_BLOCK = 1024  # elements per program of the activation
NUM_WARPS = 4


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to ``DTYPE`` and read back as float32: where the chain stores a tensor of ``DTYPE``."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["E"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rstd_ptr, E, sx, so, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK):
        cols = e0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < E, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / E + eps)
    tl.store(rstd_ptr + row, rstd)
    for e0 in range(0, E, BLOCK):
        cols = e0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < E, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * so + cols, (w * _rounded(x * rstd, dtype)).to(dtype), mask=cols < E)


@triton.jit(do_not_specialize=["E"])
def _rms_norm_backward_kernel(x_ptr, w_ptr, rstd_ptr, g_ptr, dx_ptr, E, sx, sg, sdx, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    dtype = dx_ptr.dtype.element_ty
    rstd = tl.load(rstd_ptr + row)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for e0 in range(0, E, BLOCK):
        cols = e0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < E, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * sg + cols, mask=cols < E, other=0.0).to(tl.float32)
        acc += _rounded(g * w, dtype) * x
    coefficient = tl.sum(acc, axis=0) * rstd * rstd * rstd / E
    for e0 in range(0, E, BLOCK):
        cols = e0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < E, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * sg + cols, mask=cols < E, other=0.0).to(tl.float32)
        dx = _rounded(g * w, dtype) * rstd - x * coefficient
        tl.store(dx_ptr + row * sdx + cols, dx.to(dtype), mask=cols < E)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@profiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RMSNorm of ``[M, E]`` ``x`` (``weight`` of ``x``'s dtype): ``(out, rstd)``, ``out`` =
    ``weight * (x * rstd)`` with ``x * rstd`` in float32 rounded to ``x``'s dtype, and ``rstd`` (float32 ``[M]``)
    ``1 / sqrt(mean of squares + eps)``, the row's squares added in blocks of ``ROW_BLOCK`` in increasing order."""
    x = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, weight.contiguous(), out, rstd, x.shape[1], x.stride(0), out.stride(0),
                                        eps, BLOCK=ROW_BLOCK, num_warps=NUM_WARPS)
    return out, rstd


@profiled
def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`rms_norm`'s ``out`` for ``x``: ``dn * rstd - x * rstd^3 / E * sum(dn * x)`` per row,
    ``dn = grad * weight`` rounded to ``x``'s dtype (as autograd rounds it), the sum in ``ROW_BLOCK`` blocks."""
    x, grad = _rows(x), _rows(grad)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _rms_norm_backward_kernel[(x.shape[0],)](x, weight.contiguous(), rstd, grad, dx, x.shape[1], x.stride(0),
                                                 grad.stride(0), dx.stride(0), BLOCK=ROW_BLOCK, num_warps=NUM_WARPS)
    return dx


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, sxr, sxh, sc, sor, soh, HALF: tl.constexpr,
                   HP: tl.constexpr, BACKWARD: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    dtype = out_ptr.dtype.element_ty
    i = tl.arange(0, HP)
    m = i < HALF
    x1 = tl.load(x_ptr + r * sxr + h * sxh + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + r * sxr + h * sxh + HALF + i, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + r * sc + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + r * sc + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + r * sc + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + r * sc + HALF + i, mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the adjoint: x*cos's gradient plus rotate_half's transpose of (grad * sin)
        y1 = _rounded(x1 * c1, dtype) + _rounded(x2 * s2, dtype)
        y2 = _rounded(x2 * c2, dtype) - _rounded(x1 * s1, dtype)
    else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y1 = _rounded(x1 * c1, dtype) - _rounded(x2 * s1, dtype)
        y2 = _rounded(x2 * c2, dtype) + _rounded(x1 * s2, dtype)
    tl.store(out_ptr + r * sor + h * soh + i, y1.to(dtype), mask=m)
    tl.store(out_ptr + r * sor + h * soh + HALF + i, y2.to(dtype), mask=m)


@profiled
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """transformers' rotation ``x * cos + rotate_half(x) * sin`` of ``[N, H, D]`` ``x`` (``cos``, ``sin``: ``[N, D]``
    of ``x``'s dtype, shared by the heads), each product and the sum rounded to ``x``'s dtype: a new contiguous
    tensor. ``backward``: the gradient of that rotation for an output gradient ``x``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    rows, heads, dim = x.shape
    if dim % 2 or cos.shape != (rows, dim) or sin.shape != cos.shape:
        raise ValueError(f"rotary: x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _rotary_kernel[(rows, heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                                      out.stride(1), HALF=dim // 2, HP=triton.next_power_of_2(dim // 2),
                                      BACKWARD=backward, num_warps=1)
    return out


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["I"])
def _silu_mul_kernel(gate_ptr, up_ptr, g_ptr, out_ptr, d_up_ptr, I, sg_r, su_r, sgr_r, so_r, BLOCK: tl.constexpr,
                     BACKWARD: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    dtype = out_ptr.dtype.element_ty
    x = tl.load(gate_ptr + r * sg_r + cols, mask=m, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + r * su_r + cols, mask=m, other=0.0).to(tl.float32)
    s = _sigmoid(x)
    silu = _rounded(x * s, dtype)
    if BACKWARD:  # autograd through silu(gate) * up: d silu = g * up, d up = g * silu, then x * sigmoid(x)'s
        g = tl.load(g_ptr + r * sgr_r + cols, mask=m, other=0.0).to(tl.float32)
        d_silu = _rounded(g * up, dtype)
        d_gate = d_silu * s + d_silu * x * s * (1.0 - s)
        tl.store(out_ptr + r * so_r + cols, d_gate.to(dtype), mask=m)
        tl.store(d_up_ptr + r * so_r + cols, (g * silu).to(dtype), mask=m)
    else:
        tl.store(out_ptr + r * so_r + cols, (silu * up).to(dtype), mask=m)


def _activation(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    gate, up = _rows(gate), _rows(up)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    rows, width = gate.shape
    outs = [torch.empty(rows, width, dtype=gate.dtype, device=gate.device) for _ in range(1 if grad is None else 2)]
    if grad is not None:
        grad = _rows(grad)
    if gate.numel():
        d_up = outs[-1]
        _silu_mul_kernel[(rows, triton.cdiv(width, ELEMENT_BLOCK))](
            gate, up, grad if grad is not None else gate, outs[0], d_up, width, gate.stride(0), up.stride(0),
            grad.stride(0) if grad is not None else 0, width, BLOCK=ELEMENT_BLOCK, BACKWARD=grad is not None,
            num_warps=NUM_WARPS)
    return tuple(outs)


@profiled
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two ``[N, I]`` tensors of one dtype: the sigmoid in float32, ``gate * sigmoid(gate)``
    rounded to the dtype, times ``up`` rounded again (the chain's steps): a new contiguous tensor."""
    return _activation(gate, up, None)[0]


@profiled
def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`silu_mul` for the output's gradient ``grad``: ``(d gate, d up)``, the sigmoid
    recomputed from ``gate``."""
    d_gate, d_up = _activation(gate, up, grad)
    return d_gate, d_up
