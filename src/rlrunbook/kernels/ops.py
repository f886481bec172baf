"""The fixed-order operations with autograd, dispatched by device: C kernels on CPU, Triton kernels on CUDA.

Forward values follow the orders stated in :mod:`rlrunbook.kernels`; gradients are computed by
kernels of the same family (every sum in an order fixed by the code, no atomics), so a backward pass
is also the same from run to run and at any thread count, though a gradient summed over rows naturally
depends on which rows the batch holds. On the meta device (memory plans) each operation only
allocates what it returns and keeps for backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from rlrunbook.kernels.cpu import SMALL_K  # as c/fused.c: products over at most this many terms are sequential


def _backend(device: torch.device):
    if device.type == "cpu":
        from rlrunbook.kernels import cpu

        return cpu
    if device.type == "cuda":
        from rlrunbook.kernels import gpu

        return gpu
    raise TypeError(f"the fixed-order kernels run on CPU and CUDA, not on {device}")


def _meta(*tensors: torch.Tensor) -> bool:
    return any(t is not None and t.device.type == "meta" for t in tensors)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[M, K]``, ``weight`` ``[N, K]``) without autograd, in the forward order:
    sequential over k for ``K <= SMALL_K``, else lanes16 (float32) or pairs16 (two bfloat16 inputs)."""
    backend = _backend(x.device)
    if weight.shape[1] <= SMALL_K:  # the transposed view: the C kernels copy it, the Triton ones read its strides
        return backend.gemm_seq(x, weight.t(), bias, out_dtype)
    return backend.gemm_nt(x, weight, bias, out_dtype)


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad.T @ x`` (``[N, K]``), sequential over the rows, oriented so the smaller side is gathered."""
    backend = _backend(x.device)
    n, k = grad.shape[1], x.shape[1]
    if n <= k:
        return backend.gemm_seq(grad, x, None, dtype, a_transposed=True)
    return backend.gemm_seq(x, grad, None, dtype, a_transposed=True).t().contiguous()


class _Linear(torch.autograd.Function):
    """``x @ weight.T + bias`` in fixed order; ``known`` (not ``None``): that value, computed before bit for bit
    (:func:`linear_known`), returned instead of computed, with the same backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, known):
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.has_bias, ctx.x_dtype = bias is not None, x.dtype
        if known is not None:
            return known
        if _meta(x, weight):
            return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        return product(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx = dw = dbias = None
        meta = _meta(grad, weight)
        if grad.dtype != weight.dtype and weight.dtype != torch.float32:
            # A half-precision product whose result was kept in float32 (the output layer): its gradient in the
            # weight's dtype, as autograd would round it through a half-precision result converted to float32.
            grad = grad.to(weight.dtype)
        if ctx.needs_input_grad[0]:  # in the weight's dtype, rounded to the input's (as a cast's backward rounds it)
            shape = (grad.shape[0], weight.shape[1])
            dx = (grad.new_empty(shape, dtype=ctx.x_dtype) if meta
                  else _backend(grad.device).gemm_seq(grad.contiguous(), weight, None, weight.dtype).to(ctx.x_dtype))
        if ctx.needs_input_grad[1]:
            dw = weight.new_empty(weight.shape) if meta else _weight_gradient(grad.contiguous(), x, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = grad.float().sum(0)
        return dx, dw, dbias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``[..., K]`` in fixed order; the result in ``out_dtype``
    (default: ``x``'s dtype). Inputs of two different dtypes are computed in float32."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.dtype != weight.dtype:
        flat, weight = flat.float(), weight.float()
    out = _Linear.apply(flat, weight, bias, out_dtype or x.dtype, None)
    return out.view(*lead, weight.shape[0])


def linear_known(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, known: torch.Tensor) -> torch.Tensor:
    """``linear(x, weight, bias, known.dtype)`` (``x`` ``[M, K]`` and ``weight`` of one dtype; ``known`` of it, or
    float32: the output layer's) whose value ``known`` (``[M, N]``) was computed before, bit for bit
    (:mod:`rlrunbook.engines.kept_products`): nothing is computed forward, and the backward is :func:`linear`'s."""
    if (x.dtype != weight.dtype or known.dtype not in (x.dtype, torch.float32)
            or known.shape != (x.shape[0], weight.shape[0])):
        raise ValueError(f"linear_known: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"known {tuple(known.shape)} {known.dtype}")
    return _Linear.apply(x, weight, bias, known.dtype, known)


def linear_float32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``linear(x.float(), weight)`` for a float32 ``weight`` (LoRA's first factor beside a half-precision model), the
    kernel reading ``x`` as float32: no float32 copy of ``x`` is made or kept for the backward, and the values and
    gradients are those of the cast followed by the product. For the kernels :func:`layer_kernels` names (and meta)."""
    if weight.dtype != torch.float32:
        raise TypeError(f"linear_float32: the weight is {weight.dtype}, not float32")
    flat = x.reshape(-1, x.shape[-1])
    return _Linear.apply(flat, weight, None, torch.float32, None).view(*x.shape[:-1], weight.shape[0])


def _scaled(x: torch.Tensor, scaling: float) -> torch.Tensor:
    """``x * scaling``, read only: ``x`` itself at a scaling of 1 (the product's every value, -0 and NaN included,
    is ``x``'s), not a copy of it (a LoRA update's gradient at the default alpha = rank: the size of its
    projection's output, 67 MB per chunk of the output layer's)."""
    return x if scaling == 1.0 else x * scaling


class _AddScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, result, delta, scaling):
        # a CPU pass only (add_scaled below): its one-pass loop is the C library's
        from rlrunbook.kernels import cpu

        ctx.scaling = scaling
        return cpu.add_scaled(result, delta, scaling)

    @staticmethod
    def backward(ctx, grad):
        return grad, _scaled(grad, ctx.scaling) if ctx.needs_input_grad[1] else None, None


def add_scaled(result: torch.Tensor, delta: torch.Tensor, scaling: float) -> torch.Tensor:
    """``result + delta * scaling`` (a LoRA update added to its base result) with the same bits and gradients, in one
    pass on CPU for 2-D float32 or bfloat16 tensors of one dtype and shape; elsewhere that expression itself."""
    if (result.device.type != "cpu" or result.dtype != delta.dtype or result.dtype not in (torch.float32, torch.bfloat16)
            or result.shape != delta.shape or result.dim() != 2 or _meta(result, delta)):
        return result + delta * scaling
    return _AddScaled.apply(result, delta, scaling)


class _RowSumSq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        if _meta(x):
            return x.new_empty(x.shape[0], dtype=torch.float32)
        return _backend(x.device).row_sumsq(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (2.0 * grad[:, None] * x.float()).to(x.dtype)


def row_sumsq(x: torch.Tensor) -> torch.Tensor:
    """``(x.float() ** 2).sum(-1)`` of ``[..., E]`` ``x`` in lanes16 order: float32 ``[...]``."""
    flat = x.reshape(-1, x.shape[-1])
    return _RowSumSq.apply(flat).view(x.shape[:-1])


class _RowLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if _meta(x):
            out = x.new_empty(x.shape[0])
        else:
            out = _backend(x.device).row_logsumexp(x)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        if _meta(x):
            return torch.empty_like(x)
        return grad[:, None] * _backend(x.device).exp(x - lse[:, None])


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(x, -1)`` of float32 ``[..., V]`` ``x``: the max, then ``exp(x - max)`` summed in lanes64
    order (a row of ``-inf`` gives ``-inf``)."""
    flat = x.float().reshape(-1, x.shape[-1])
    return _RowLogSumExp.apply(flat).view(x.shape[:-1])


class _LogSoftmaxAt(torch.autograd.Function):
    """``log_softmax(logits)[m, targets[m]]`` of CPU ``[M, V]`` float32 logits: the composed chain's values
    (the picked logit less :func:`row_logsumexp`), its gradient in one pass (``cpu.log_softmax_at_grad``: the same
    bits as the chain's backward, which made five ``[M, V]`` tensors)."""

    @staticmethod
    def forward(ctx, logits, targets):
        from rlrunbook.kernels import cpu

        lse = cpu.row_logsumexp(logits)
        ctx.save_for_backward(logits, targets, lse)
        return logits.gather(-1, targets[:, None]).squeeze(-1) - lse

    @staticmethod
    def backward(ctx, grad):
        from rlrunbook.kernels import cpu

        logits, targets, lse = ctx.saved_tensors
        return cpu.log_softmax_at_grad(logits, lse, targets, grad), None


def log_softmax_at(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1)`` at ``targets`` (``[...]`` indices of ``[..., V]`` float32 logits)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype == torch.float32
            and torch.is_grad_enabled() and logits.requires_grad):
        return _LogSoftmaxAt.apply(logits, targets)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - row_logsumexp(logits)


class _FrozenHeadLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[target]`` per row, for an output layer whose weight is not trained.

    The logprob of row ``i`` depends on ``hidden[i]`` alone, and its gradient there is
    ``g_i * ((1 - p_it) W[t_i] - sum over v != t_i of p_iv W[v])`` (``p`` the row's softmax, ``g`` the loss's
    gradient of the logprob). Both parts are known in the forward pass except ``g``: the forward keeps
    ``1 - p_it`` and the sum (``[M]`` and ``[M, E]``), and the backward only multiplies. Neither the ``[M, V]``
    logits nor a recomputation of them is needed for the backward; the softmax's target term is kept out of the
    sum so that a confident row (``p_it`` near 1) loses nothing to cancellation."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, logits=None):
        ctx.hidden_dtype = hidden.dtype
        rows, vocab = hidden.shape[0], weight.shape[0]
        if _meta(hidden, weight):  # what the pass allocates: logits, then the probabilities, then the sum
            logits = hidden.new_empty(rows, vocab, dtype=torch.float32)
            probs = torch.empty_like(logits)
            del logits
            if weight.dtype != torch.float32:
                probs = probs.to(weight.dtype)
            rest = hidden.new_empty(rows, weight.shape[1], dtype=torch.float32)
            ctx.save_for_backward(weight, targets, hidden.new_empty(rows, dtype=torch.float32), rest)
            return hidden.new_empty(rows, dtype=torch.float32)
        backend = _backend(hidden.device)
        logits = product(hidden, weight, None, torch.float32) if logits is None else logits  # given: changed here
        lse = backend.row_logsumexp(logits)
        logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # the bits of log_softmax_at
        probs = backend.exp(logits.sub_(lse[:, None]))
        del logits
        complement = 1.0 - probs.gather(-1, targets[:, None]).squeeze(-1)
        probs.scatter_(-1, targets[:, None], 0.0)
        rest = backend.gemm_seq(probs.to(weight.dtype), weight, None, torch.float32)  # sum over v != t of p_v W[v]
        ctx.save_for_backward(weight, targets, complement, rest)
        return logprobs

    @staticmethod
    def backward(ctx, grad):
        weight, targets, complement, rest = ctx.saved_tensors
        if _meta(grad, weight):
            return rest.new_empty(rest.shape, dtype=ctx.hidden_dtype), None, None, None
        picked = weight.index_select(0, targets).float()
        return (grad[:, None] * (complement[:, None] * picked - rest)).to(ctx.hidden_dtype), None, None, None


def frozen_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         logits: torch.Tensor | None = None) -> torch.Tensor:
    """``log_softmax_at(linear(hidden, weight, out_dtype=float32), targets)`` (``hidden`` ``[M, E]``, ``weight``
    ``[V, E]`` not trained, ``targets`` ``[M]``): the same logprobs, bit for bit, with a gradient for ``hidden`` that
    keeps ``[M, E]`` floats for the backward instead of ``[M, V]`` logits (see :class:`_FrozenHeadLogprobs`).
    Its gradient is the chain's up to the order of float32 additions. ``logits`` (``[M, V]`` float32, consumed): the
    product's value computed before, bit for bit (:mod:`rlrunbook.engines.kept_products`), used instead of computing
    it."""
    if logits is not None and (logits.shape != (hidden.shape[0], weight.shape[0]) or logits.dtype != torch.float32):
        raise ValueError(f"frozen_head_logprobs: logits {tuple(logits.shape)} {logits.dtype} for {hidden.shape[0]} "
                         f"rows of a {weight.shape[0]}-token vocabulary (float32)")
    if weight.requires_grad:
        raise ValueError("frozen_head_logprobs: the output layer's weight is trained; its gradient needs the logits")
    if hidden.dtype != weight.dtype:
        hidden, weight = hidden.float(), weight.float()
    return _FrozenHeadLogprobs.apply(hidden, weight, targets, logits)


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.empty_like(x) if _meta(x) else _backend(x.device).sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y * (1.0 - y)


class _ColumnSplit(torch.autograd.Function):
    """``x.split(sizes, dim=-1)`` whose backward hands on the pieces' gradients without a copy where they already
    are one tensor's column blocks in order (a gate/up group's, from :func:`silu_mul`'s backward), else joins them as
    ``split``'s backward does (``cat``; a piece without a gradient contributes zeros)."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes, ctx.shape, ctx.dtype, ctx.device = sizes, x.shape, x.dtype, x.device
        return tuple(x.split(sizes, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        whole = _joined_columns(grads, ctx.sizes)
        if whole is None:
            whole = torch.cat([torch.zeros(*ctx.shape[:-1], size, dtype=ctx.dtype, device=ctx.device) if g is None
                               else g for g, size in zip(grads, ctx.sizes, strict=True)], dim=-1)
        return whole, None


def _joined_columns(pieces: Sequence[torch.Tensor | None], sizes: Sequence[int]) -> torch.Tensor | None:
    """The ``[M, sum(sizes)]`` tensor whose consecutive column blocks ``pieces`` are (a view of their storage), or
    ``None`` where they are not that."""
    first = pieces[0]
    if first is None or first.dim() != 2 or first.device.type == "meta":
        return None
    rows, width = first.shape[0], sum(sizes)
    step, at = first.element_size(), first.data_ptr()
    for piece, size in zip(pieces, sizes, strict=True):
        if (piece is None or piece.shape != (rows, size) or piece.dtype != first.dtype
                or piece.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or piece.data_ptr() != at or (rows > 1 and piece.stride() != (width, 1))
                or (rows == 1 and piece.stride(-1) != 1)):
            return None
        at += size * step
    return first.as_strided((rows, width), (width, 1))


def split_columns(x: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """``x.split(sizes, dim=-1)`` for a ``[M, N]`` projection group's outputs, the same views and gradient values;
    where the pieces' gradients are already side by side in one tensor (a gate/up pair's, written so by
    :func:`silu_mul`'s backward on CPU) the group's gradient is that tensor, not a concatenated copy."""
    if x.dim() != 2 or not (torch.is_grad_enabled() and x.requires_grad):
        return tuple(x.split(sizes, dim=-1))
    return _ColumnSplit.apply(x, tuple(sizes))


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` computed in float32 (sigmoid from the kernels' exp), rounded once to ``x``'s dtype."""
    x32 = x.float()
    return (x32 * _Sigmoid.apply(x32.contiguous())).to(x.dtype)


class _SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` as one kernel each way, keeping only ``gate`` and ``up`` for the backward (the sigmoid is
    recomputed there), each step rounded where the chain's autograd rounds it. On meta (memory plans), what it
    allocates and keeps."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.empty_like(gate) if _meta(gate, up) else _backend(gate.device).silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = ((torch.empty_like(gate), torch.empty_like(up)) if _meta(grad, gate)
                        else _backend(gate.device).silu_mul_backward(gate, up, grad))
        return d_gate if ctx.needs_input_grad[0] else None, d_up if ctx.needs_input_grad[1] else None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (the gated MLP's activation) for float32 and bfloat16 matrices of one shape: one kernel
    each way, keeping only ``gate`` and ``up`` for the backward. On CPU (C) values and gradients are the bits of
    that expression computed by the chain; on CUDA (Triton) the trainer and the sampler both run this kernel. Other
    dtypes and shapes: that expression itself."""
    if (gate.device == up.device and gate.dtype == up.dtype and gate.dtype in (torch.float32, torch.bfloat16)
            and gate.shape == up.shape and gate.dim() == 2):
        return _SiluMul.apply(gate, up)
    return silu(gate) * up


def layer_kernels(device: torch.device) -> bool:
    """Whether the kernels for ``device`` compute a layer's norm, rotation and LoRA additions as single kernels
    (:func:`rms_norm`, :func:`rotary`, :func:`lora_added`): the Triton ones on CUDA. The C kernels compute them as a
    chain, and fuse that chain where no gradient is recorded (:mod:`rlrunbook.kernels.fused`)."""
    return device.type != "meta" and hasattr(_backend(device), "rotary")


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if _meta(x, weight):
            out, rstd = torch.empty_like(x), x.new_empty(x.shape[0], dtype=torch.float32)
        else:
            out, rstd = _backend(x.device).rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        meta = _meta(grad, x)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x) if meta else _backend(x.device).rms_norm_backward(x, weight, rstd, grad)
        if ctx.needs_input_grad[1]:  # as autograd differentiates weight * normed
            dw = (grad * (x.float() * rstd[:, None]).to(x.dtype)).sum(0)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm of ``[..., E]`` ``x`` (``weight`` ``[E]`` of ``x``'s dtype) as one kernel each way, where
    :func:`layer_kernels` says so: ``weight * (x * rsqrt(mean of squares + eps))``, the statistics in float32 and
    ``x * rsqrt(...)`` rounded to ``x``'s dtype. Keeps ``x`` and one float32 per row for the backward."""
    flat = x.reshape(-1, x.shape[-1])
    return _RmsNorm.apply(flat, weight, eps).view(x.shape)


def _rotation_kernel(device: torch.device):
    """The backend's rotation, ``(x, cos, sin, backward=False)``: the Triton layer kernel on CUDA, the C pass on CPU
    (``cpu.rotation``, named apart because :func:`layer_kernels` reads the presence of ``rotary``)."""
    backend = _backend(device)
    return backend.rotary if hasattr(backend, "rotary") else backend.rotation


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if _meta(x) else _rotation_kernel(x.device)(x, cos,
                                                                                                                  sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        dx = torch.empty_like(grad) if _meta(grad) else _rotation_kernel(grad.device)(grad, cos, sin, backward=True)
        return dx, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotation ``x * cos + rotate_half(x) * sin`` of ``[N, H, D]`` ``x`` (``cos``, ``sin`` ``[N, D]``
    of ``x``'s dtype, shared by the heads) as one kernel each way, where :func:`layer_kernels` or
    :func:`rotation_applies` says so; each product and the sum rounded to ``x``'s dtype, as the chain rounds them, and
    the gradient as autograd gives it through the chain (the tables get none)."""
    return _Rotary.apply(x, cos, sin)


def rotation_applies(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`rotary` rotates ``x`` with ``cos`` on CPU, where the layer kernels do not apply: float32 or
    bfloat16 ``[N, H, D]`` ``x`` (D even) and ``[N, D]`` tables of its dtype (one C pass each way instead of the chain's
    six operations); tables that the chain would broadcast are left to it."""
    return (x.device.type == "cpu" and x.dim() == 3 and x.dtype in (torch.float32, torch.bfloat16)
            and cos.dtype == x.dtype and tuple(cos.shape) == (x.shape[0], x.shape[2]) and x.shape[2] % 2 == 0)


class _LoraAdded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, xa, b, scaling, known):
        ctx.save_for_backward(xa if b.requires_grad else None, b)
        ctx.scaling, ctx.dtypes = scaling, (base.dtype, xa.dtype)
        if known is not None:
            return known
        if _meta(base, xa, b):
            return torch.empty_like(base)
        return _backend(base.device).lora_added(base, xa, b, scaling)

    @staticmethod
    def backward(ctx, grad):
        xa, b = ctx.saved_tensors
        base_dtype, delta_dtype = ctx.dtypes
        # as autograd through (base + linear(xa, b) * scaling).to(base's dtype), the sum in the promoted dtype
        summed = torch.promote_types(base_dtype, delta_dtype)
        d_delta = _scaled(grad.to(summed).to(delta_dtype), ctx.scaling)
        d_xa = d_b = None
        meta = _meta(grad, b)
        if ctx.needs_input_grad[1]:
            d_xa = (d_delta.new_empty(d_delta.shape[0], b.shape[1]) if meta
                    else _backend(grad.device).gemm_seq(d_delta.contiguous(), b, None, b.dtype))
        if ctx.needs_input_grad[2]:
            d_b = b.new_empty(b.shape) if meta else _weight_gradient(d_delta.contiguous(), xa, b.dtype)
        return grad if ctx.needs_input_grad[0] else None, d_xa, d_b, None, None


def lora_added(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
               known: torch.Tensor | None = None) -> torch.Tensor:
    """A LoRA update added to its base product as peft adds it: ``(base + linear(xa, b) * scaling)`` in ``base``'s
    dtype (``base`` ``[M, N]``, ``xa`` ``[M, r]`` the input times the first factor, ``b`` ``[N, r]`` of ``xa``'s dtype)
    in one kernel where :func:`lora_added_applies` says so: the product in the fixed order of :func:`linear`, the
    scaled update and the sum rounded where the chain ``add_scaled(base, linear(xa, b), scaling)`` rounds them. The
    ``[M, N]`` update is never stored; the backward keeps ``xa`` and ``b``, as the chain's product does.

    ``known`` (``[M, N]`` of ``base``'s dtype): the sum's value computed before, bit for bit
    (:mod:`rlrunbook.engines.kept_products`), returned instead of computed, with the same backward (which reads
    neither the sum nor ``base``'s value)."""
    if known is not None and (known.shape != base.shape or known.dtype != base.dtype):
        raise ValueError(f"lora_added: known {tuple(known.shape)} {known.dtype} for a sum {tuple(base.shape)} "
                         f"{base.dtype}")
    return _LoraAdded.apply(base, xa, b, scaling, known)


def lora_added_applies(device: torch.device, rank: int) -> bool:
    """Whether :func:`lora_added` computes a rank-``rank`` update on ``device`` in one kernel: on CUDA (Triton, any
    rank) and on CPU for ranks up to ``SMALL_K`` (the C kernel: the chain's sequential sum with the addition in its
    epilogue). The float32 and bfloat16 tensors of a decoder's pass."""
    return device.type != "meta" and (layer_kernels(device) or (device.type == "cpu" and rank <= SMALL_K))


def exp(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a float32 tensor, no autograd: the same bits for an element wherever it sits."""
    return torch.empty_like(x) if _meta(x) else _backend(x.device).exp(x)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, query_positions, key_positions, key_valid, scale):
        if _meta(q, k, v):
            out = q.new_empty(q.shape)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        else:
            out, lse = _backend(q.device).attention_forward(q, k, v, query_positions, key_positions, key_valid, scale)
        ctx.save_for_backward(q, k, v, query_positions, key_positions, key_valid, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, query_positions, key_positions, key_valid, out, lse = ctx.saved_tensors
        if _meta(q, k, v):
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None
        dq, dk, dv = _backend(q.device).attention_backward(q, k, v, query_positions, key_positions, key_valid, out,
                                                            grad, lse, ctx.scale)
        return dq, dk, dv, None, None, None, None


class _GatheredAttention(torch.autograd.Function):
    """:class:`_Attention` over keys and values gathered from flat ``[N, Hkv, D]`` tensors by ``key_index``
    ``[R, S]``, keeping the flat tensors and the index for backward and gathering them again there.

    Rows of a shared-prefix pass read overlapping keys (every row of one sequence reads the keys before its
    queries), so their gathered copies add up to about ``T^2 / (2 x queries per row)`` keys for ``T`` tokens:
    kept for backward they made a training pass's memory grow with the square of its tokens. The flat tensors are
    kept by the layer anyway. The gradients are :class:`_Attention`'s, added into the flat tensors by
    ``index_add_`` as ``index_select``'s backward adds them (the same calls: the same bits)."""

    @staticmethod
    def forward(ctx, q, keys, values, key_index, query_positions, key_positions, key_valid, scale):
        flat_index = key_index.reshape(-1)
        k = keys.index_select(0, flat_index).view(*key_index.shape, *keys.shape[1:])
        v = values.index_select(0, flat_index).view(*key_index.shape, *values.shape[1:])
        if _meta(q, k, v):
            out = q.new_empty(q.shape)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        else:
            out, lse = _backend(q.device).attention_forward(q, k, v, query_positions, key_positions, key_valid, scale)
        ctx.save_for_backward(q, keys, values, key_index, query_positions, key_positions, key_valid, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, key_index, query_positions, key_positions, key_valid, out, lse = ctx.saved_tensors
        if _meta(q, keys, values):
            return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values), *(None,) * 5
        flat_index = key_index.reshape(-1)
        k = keys.index_select(0, flat_index).view(*key_index.shape, *keys.shape[1:])
        v = values.index_select(0, flat_index).view(*key_index.shape, *values.shape[1:])
        dq, dk, dv = _backend(q.device).attention_backward(q, k, v, query_positions, key_positions, key_valid, out,
                                                            grad, lse, ctx.scale)
        del k, v
        dkeys = torch.zeros_like(keys).index_add_(0, flat_index, dk.reshape(-1, *keys.shape[1:]))
        dvalues = torch.zeros_like(values).index_add_(0, flat_index, dv.reshape(-1, *values.shape[1:]))
        return dq, dkeys, dvalues, *(None,) * 5


def gathered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_index: torch.Tensor,
                       query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """:func:`attention` of ``q`` ``[R, T, H, D]`` over the rows ``key_index`` ``[R, S]`` of ``keys`` and
    ``values`` ``[N, Hkv, D]`` (``attention(q, keys[key_index], values[key_index], ...)``, the same values and
    gradients), keeping for backward the flat tensors, not the gathered ``[R, S]`` copies: a pass's memory
    stays linear in its tokens however many rows read a key."""
    return _GatheredAttention.apply(q, keys, values, key_index, query_positions, key_positions, key_valid, scale)


class PassRows(NamedTuple):
    """One batch of attention rows of a pass, as :func:`pass_attention` reads it: ``[R, T]`` query indices into the
    pass's flat tokens and positions (``-1``: padding), ``[R, S]`` key indices, positions and validity, the flat
    index of each real query and where it sits in the batch's ``[R * T]`` queries (row-major), and the distinct
    key indices with each key entry's place among them (``torch.unique``'s ``inverse`` of ``key_index``)."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    key_valid: torch.Tensor
    query_flat: torch.Tensor
    query_rows: torch.Tensor
    key_unique: torch.Tensor
    key_local: torch.Tensor


class _PassAttention(torch.autograd.Function):
    """:func:`gathered_attention` of every batch of a pass in one node: the values and gradients of the chain
    ``take_rows(cat([take_rows(gathered_attention(take_rows(q, query_index), ...), query_rows) ...]), order)``, bit
    for bit, without its per-batch full-size tensors.

    The chain's backward made, for every batch, zero tensors as large as the pass's flat queries, keys and values,
    added the batch's gradients into them, and summed those tensors over the batches (autograd's accumulation, the
    last batch first). Here the sums are the same additions in the same order: a query belongs to one batch (its
    gradient is 0 + its value, whatever the buffer), and a key's gradient is the sum over batches, last first, of
    each batch's own sum over its entries in index order, that per-batch sum formed over the batch's distinct keys
    only (``key_unique``). The keys a batch does not touch get no addition, where the chain added 0 to them: the same
    bits, since none of those sums is -0 (each starts from +0)."""

    @staticmethod
    def forward(ctx, q, keys, values, batches, scale):
        backend = None if _meta(q, keys, values) else _backend(q.device)
        tokens, heads, dim = q.shape
        out = q.new_empty(tokens, heads * dim)
        saved, keep = [], any(ctx.needs_input_grad[:3])  # no gradient (a sampler's prefill): each batch's rows freed
        for batch in batches:
            rows, queries = batch.query_index.shape
            qb = q.index_select(0, batch.query_index.reshape(-1)).view(rows, queries, heads, dim)
            if backend is None:
                rows_out, lse = q.new_empty(qb.shape), q.new_empty(qb.shape[:-1], dtype=torch.float32)
            else:
                k, v = (x.index_select(0, batch.key_index.reshape(-1)).view(*batch.key_index.shape, *x.shape[1:])
                        for x in (keys, values))
                rows_out, lse = backend.attention_forward(qb, k, v, batch.query_positions, batch.key_positions,
                                                          batch.key_valid, scale)
                del k, v
            del qb
            out.index_copy_(0, batch.query_flat, rows_out.view(rows * queries, heads * dim).index_select(
                0, batch.query_rows))
            if keep:
                saved += [rows_out, lse]
            del rows_out, lse
        ctx.save_for_backward(q, keys, values, *saved)
        ctx.batches, ctx.scale = batches, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, *saved = ctx.saved_tensors
        if _meta(q, keys, values, grad):
            return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values), None, None
        backend = _backend(q.device)
        heads, dim = q.shape[1:]
        dq, dkeys, dvalues = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        for index in reversed(range(len(ctx.batches))):
            batch, rows_out, lse = ctx.batches[index], saved[2 * index], saved[2 * index + 1]
            rows, queries = batch.query_index.shape
            grad_rows = grad.new_zeros(rows * queries, heads * dim).index_add_(
                0, batch.query_rows, grad.index_select(0, batch.query_flat))
            qb = q.index_select(0, batch.query_index.reshape(-1)).view(rows, queries, heads, dim)
            k, v = (x.index_select(0, batch.key_index.reshape(-1)).view(*batch.key_index.shape, *x.shape[1:])
                    for x in (keys, values))
            dqb, dk, dv = backend.attention_backward(qb, k, v, batch.query_positions, batch.key_positions,
                                                     batch.key_valid, rows_out, grad_rows.view(rows_out.shape), lse,
                                                     ctx.scale)
            del qb, k, v, grad_rows
            dq.index_add_(0, batch.query_index.reshape(-1), dqb.reshape(-1, heads, dim))
            for total, part in ((dkeys, dk), (dvalues, dv)):
                own = total.new_zeros(batch.key_unique.numel(), *total.shape[1:]).index_add_(
                    0, batch.key_local.reshape(-1), part.reshape(-1, *total.shape[1:]))
                total.index_add_(0, batch.key_unique, own)
        return dq, dkeys, dvalues, None, None


def pass_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batches: Sequence[PassRows],
                   scale: float) -> torch.Tensor:
    """The attention outputs ``[N, H * D]`` of a pass's ``N`` flat queries ``q`` ``[N, H, D]`` over its flat
    ``keys`` and ``values`` ``[N', Hkv, D]``, batch by batch of rows (:class:`PassRows`; every flat query a real
    query of exactly one row): the values and gradients of :func:`gathered_attention` per batch with the outputs
    put back in flat order, in one autograd node. Keeps the flat tensors and each batch's output and normaliser
    (as :func:`gathered_attention` does, less the batches' gathered queries); the backward's buffers are the
    gradients themselves and, per batch, one row of key gradients per distinct key it reads."""
    return _PassAttention.apply(q, keys, values, tuple(batches), scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
              key_positions: torch.Tensor, key_valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention ``[R, T, H, D]`` (see :func:`rlrunbook.engines.attention.attend` for the layout);
    each query reads its allowed keys in increasing index: scores sequential over ``D``, the normaliser in
    lanes16 order, the weighted values sequential over the keys. Keeps ``q``, ``k``, ``v``, the output and
    one float32 per query and head for backward: no ``[T, S]`` tensor."""
    return _Attention.apply(q, k, v, query_positions, key_positions, key_valid, scale)


class RopeTable:
    """``cos`` and ``sin`` of every position's rotary angles, on CPU computed once per position by libm and looked
    up afterwards (PyTorch's vectorised ``cos`` rounds a position apart from its scalar tail), so a position's
    values never depend on the batch.

    ``inv_freq`` ``[D / 2]`` and ``attention_scaling`` are the model's rotary embedding's; the table grows in
    blocks of 1,024 positions as longer sequences arrive.
    """

    BLOCK = 1024

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        self.inv_freq = inv_freq.detach().float()
        self.scaling = float(attention_scaling)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._cos = self._sin = torch.empty(0, self.inv_freq.numel())

    def _grow(self, positions: int) -> None:
        have = self._cos.shape[0]
        if positions <= have:
            return
        size = (positions + self.BLOCK - 1) // self.BLOCK * self.BLOCK
        from rlrunbook.kernels import cpu

        cos, sin = cpu.rope_table(torch.arange(have, size), self.inv_freq.cpu())
        self._cos, self._sin = torch.cat([self._cos, cos]), torch.cat([self._sin, sin])
        self._tables.clear()

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype,
               bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[N, D]`` for ``[N]`` positions, as transformers' rotary embedding lays them out
        (the ``D / 2`` frequencies twice), scaled by ``attention_scaling`` and rounded to ``dtype``. ``bound``: a
        number every position is below, known to the caller (a cache's capacity), so the table grows without
        reading the positions back (a read of the largest one otherwise).

        On CUDA they are computed on the spot by PyTorch's ``cos`` and ``sin`` (every element by the same function
        wherever it sits, and no host synchronisation, so a captured CUDA graph can hold it)."""
        if positions.device.type == "meta":
            shape = (positions.shape[0], 2 * self.inv_freq.numel())
            return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)
        if positions.device.type == "cuda":
            angle = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]
            halves = [torch.cat([f, f], dim=-1) for f in (torch.cos(angle), torch.sin(angle))]
            return tuple((h * self.scaling if self.scaling != 1.0 else h).to(dtype) for h in halves)
        if bound is not None:
            self._grow(bound)
        elif positions.numel():
            self._grow(int(positions.max()) + 1)
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None:
            tables = []
            for half in (self._cos, self._sin):
                full = torch.cat([half, half], dim=-1)
                full = full * self.scaling if self.scaling != 1.0 else full
                tables.append(full.to(device=positions.device, dtype=dtype))
            table = self._tables[key] = (tables[0], tables[1])
        return table[0].index_select(0, positions), table[1].index_select(0, positions)


def seeded_draw(logits: torch.Tensor, row_seeds: torch.Tensor, step: int, *, temperature: float = 1.0,
                filtered: torch.Tensor | None = None, greedy: bool = False,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, column: int = 0,
                feed: torch.Tensor | None = None, feed_index: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The seeded draw of one decode step in one kernel (C on CPU, Triton on CUDA), bit for bit
    :func:`rlrunbook.engines.token_draw.draw_tokens` with these kernels' :func:`log_softmax_at`.

    ``logits``: float32 ``[R, V]`` (the T = 1 policy); ``row_seeds``: int64 ``[R]``. The sampled scores are the
    logits (``temperature`` 1), ``logits / temperature``, or ``filtered`` (float32 ``[R, V]``: the caller applied
    the filters); ``greedy`` takes the argmax of the logits without noise. Returns ``(token, sampled, policy)``
    ``[R]`` (int64, float32, float32); with ``out`` (three ``[R', W]`` buffers, ``R' >= R``, rows contiguous) they
    are written to column ``column`` of its first ``R`` rows instead, and nothing is returned (no view is made). With ``feed`` (int64) the kernel also sets
    ``feed[feed_index[r]]`` to row ``r``'s token. Refuses other dtypes, devices or shapes (``TypeError``,
    ``ValueError``)."""
    rows = logits.shape[0]
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
        raise TypeError(f"seeded_draw takes float32 logits with contiguous rows, got {logits.dtype} "
                        f"with strides {logits.stride()}")
    if row_seeds.dtype != torch.int64 or row_seeds.shape != (rows,):
        raise ValueError(f"seeded_draw: row_seeds must be int64 [{rows}], got {row_seeds.dtype} "
                         f"{tuple(row_seeds.shape)}")
    if filtered is not None and (filtered.shape != logits.shape or filtered.dtype != torch.float32
                                 or filtered.stride(-1) != 1):
        raise ValueError(f"seeded_draw: filtered scores must be float32 {tuple(logits.shape)} with contiguous rows")
    if (feed is None) != (feed_index is None) or (feed is not None and (
            feed.dtype != torch.int64 or feed_index.dtype != torch.int64 or feed_index.shape != (rows,)
            or not feed.is_contiguous() or not feed_index.is_contiguous())):
        raise ValueError("seeded_draw: feed and feed_index come together, contiguous int64, feed_index [R]")
    given = out is not None
    if out is None:
        out = (torch.empty(rows, 1, dtype=torch.int64, device=logits.device),
               torch.empty(rows, 1, dtype=torch.float32, device=logits.device),
               torch.empty(rows, 1, dtype=torch.float32, device=logits.device))
        column = 0
    token, sampled, policy = out
    if (token.dtype, sampled.dtype, policy.dtype) != (torch.int64, torch.float32, torch.float32) or any(
            t.shape[0] < rows or t.stride(-1) != 1 or t.stride() != token.stride() or not 0 <= column < t.shape[1]
            for t in out):
        raise ValueError("seeded_draw: out must be int64, float32, float32 [R, W] buffers of equal strides, "
                         f"rows contiguous, with column {column} inside them")
    mode = "greedy" if greedy else "filtered" if filtered is not None else (
        "temperature" if temperature != 1.0 else "logits")
    row_seeds = row_seeds if row_seeds.is_contiguous() else row_seeds.contiguous()
    _backend(logits.device).seeded_draw(logits, row_seeds, step, mode, float(temperature), filtered, token, sampled,
                                        policy, column, feed, feed_index)
    return None if given else (token[:, 0], sampled[:, 0], policy[:, 0])
