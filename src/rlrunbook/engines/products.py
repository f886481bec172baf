"""Matrix products with frozen weights on CPU in float32: oneDNN's kernel instead of MKL's.

``F.linear`` on a float32 CPU tensor goes to MKL's GEMM. oneDNN's fp32 inner-product kernel, which
PyTorch ships for its own compiler, computes the same products faster at the sizes where a run spends
its time. Measured on the project's CPU machine (2-core AMD EPYC with AVX-512, 2 threads, SmolLM2-135M's
weights streamed from memory, 16 rows as in a decode step), per product: output layer 49152 x 576
21.5 ms (MKL) against 10.8 ms (oneDNN); MLP 1536 x 576 458 against 326 us; 576 x 576 173 against
151 us; only the small 192 x 576 key/value projections are slower (45 against 65 us). A whole
decode step's products: 73.7 against 52.6 ms. At 1,024 rows (training) oneDNN is ~1.1x faster.
Tiny products (LoRA's rank-16 factors) stay with ``F.linear``: oneDNN's fixed ~30 us per call
costs more there than it saves.

:func:`frozen_linear` is ``F.linear(x, weight, bias)`` for a weight (and bias) that is not trained,
the base weights under LoRA: oneDNN in the forward pass, and in the backward pass the input's
gradient through the same kernel on the transposed weight. The two libraries sum in different
orders, so results differ in the last bits (relative ~1e-6); sampler and trainer both use this path.
:func:`onednn_usable` says whether this torch build has the kernel and that it agrees with
``F.linear`` on a probe; the decoder falls back to ``F.linear`` where it does not, and
``TINKER_LOCAL_CPU_PRODUCTS=mkl`` turns the path off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CPU_PRODUCTS = ("onednn", "mkl")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_usable() -> bool:
    """Whether oneDNN's fp32 linear kernel exists in this torch build and matches ``F.linear`` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=generator)
    weight = torch.randn(40, 96, generator=generator)
    try:
        result = _onednn_linear(x, weight, None)
        backward = _onednn_linear(torch.randn(5, 40, generator=generator), weight.t(), None)
    except RuntimeError:
        return False
    return (result.shape == (5, 40) and backward.shape == (5, 96)
            and torch.allclose(result, F.linear(x, weight), rtol=1e-5, atol=1e-4))


def onednn_applies(numerics: str, cpu_products: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a forward pass with these settings computes its frozen-weight products through oneDNN:
    ``invariant`` numerics, ``cpu_products="onednn"``, a float32 model on CPU, and a usable kernel."""
    return (numerics == "invariant" and cpu_products == "onednn" and torch.device(device).type == "cpu"
            and dtype == torch.float32 and onednn_usable())


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return _onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return _onednn_linear(grad.contiguous(), weight.t(), None), None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN, for a 2-D float32 CPU ``x`` and an untrained ``weight``.

    Gradients flow to ``x`` only; a trained weight or bias must go through ``F.linear``.
    """
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError("frozen_linear computes no gradient for its weight or bias; use F.linear for trained ones.")
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no gradient to carry: skip autograd's bookkeeping
        return _onednn_linear(x, weight, bias)
    return _FrozenLinear.apply(x, weight, bias)
