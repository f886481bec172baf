"""Float32 weights holding the values of a quantized checkpoint, as a GGUF file's Q4_1 and Q8_0 blocks decode to.

A model converted from such a file (the built-in SmolLM2-135M) carries them; tests build small models with them to
exercise what reads their short exact form (:mod:`rlrunbook.kernels.coded_weights`). Each block of 32 values along a
row is quantized as the formats define it: Q4_1 stores ``d = (max - min) / 15`` and ``m = min`` in half precision and
4-bit ``q = round((x - min) / d)``, and decodes ``d * q + m``; Q8_0 stores ``d = max |x| / 127`` in half precision
and ``q = round(x / d)`` in 8 bits, and decodes ``q * d``. Both decode in float32 with a rounding after each
operation.
"""

from __future__ import annotations

import torch

BLOCK = 32


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise ValueError(f"a [rows, columns] weight with columns a multiple of {BLOCK} is needed, got "
                         f"{tuple(weight.shape)}")
    return weight.detach().float().reshape(weight.shape[0], -1, BLOCK)


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s values through Q4_1: quantized per block of 32, decoded to float32 (its shape)."""
    x = _blocks(weight)
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (high - low) / 15
    q = torch.where(d > 0, torch.round((x - low) / d.clamp_min(torch.finfo(torch.float32).tiny)), 0.0).clamp(0, 15)
    scale, offset = d.half().float(), low.half().float()
    return (scale * q + offset).reshape(weight.shape)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight``'s values through Q8_0: quantized per block of 32, decoded to float32 (its shape)."""
    x = _blocks(weight)
    d = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(x / d.clamp_min(torch.finfo(torch.float32).tiny)), 0.0) + 0.0  # no -0 code
    return (q * d.half().float()).reshape(weight.shape)
