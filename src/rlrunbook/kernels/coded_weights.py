"""Frozen float32 weights kept in a shorter exact form too, for the products that stream them (decode steps).

A decode step of a few rows reads every weight of the model once and does little arithmetic with each value, so
fewer bytes per value leave the memory and the caches to the rest of the step (docs/performance.md gives the
figures). Many float32 weights carry far fewer bits than 32: a checkpoint quantized before it was converted (the
built-in SmolLM2-135M comes from a GGUF file whose projections are Q4_1 and whose embedding is Q8_0) or one
published in bfloat16. :func:`code_weight` finds such a form where every value has
one, checking each value by decoding it with the kernel's own decoder, and :func:`gemm_nt_coded` decodes a panel of
the weight at a time into a float32 buffer that ``gemm_nt``'s tiles then read: the same values in the same order, so
the same bits as :func:`rlrunbook.kernels.cpu.gemm_nt` over the float32 weight.

The forms, per row in blocks of :data:`BLOCK` values (``c/products.c`` states them exactly):

* ``q4``: 4-bit codes with a float32 scale and offset per block, ``(scale * code) + offset`` (0.75 bytes a value);
* ``q8``: signed 8-bit codes with a float32 scale per block, ``scale * code`` (1.125 bytes a value);
* ``bf16``: the upper half of each value's bits (2 bytes a value).

The shortest form that holds every value exactly is kept; a weight none holds is not coded (``None``). The codes
are a second copy beside the float32 weight, which the training pass and every other product still read.

Which weights are coded, and for how long, is the engine's (:mod:`rlrunbook.engines.coded_forms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrunbook.kernels.build import load_library
from rlrunbook.kernels.cpu import _check, _profiled, _ptr, _threads

BLOCK = 32  # values per block along a row (the row length must be a multiple of it)
# Products of at most this many rows read a coded weight (c/fused.c's CODED_MAX_ROWS): more rows reuse each decoded
# panel of the float32 weight across their rows, so its bytes no longer bound them.
FEW_ROWS = 64
KINDS = {"q4": 1, "q8": 2, "bf16": 3}  # c/products.c's CODED_* codes, shortest first
_CODE_BYTES = {"q4": 0.5, "q8": 1.0, "bf16": 2.0}  # bytes of codes per value


@dataclass(frozen=True)
class CodedWeight:
    """A ``[N, K]`` float32 weight in form ``kind``: ``codes`` ``[N, row bytes]`` (uint8), ``scales`` and ``offsets``
    ``[N, K / BLOCK]`` float32 (empty where the form has none)."""

    kind: str
    shape: tuple[int, int]
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def c_args(self) -> tuple:
        """``(kind code, codes, scales, offsets)`` as the C functions take them."""
        return KINDS[self.kind], _ptr(self.codes), _ptr(self.scales), _ptr(self.offsets)

    def decode(self) -> torch.Tensor:
        """The float32 values, ``[N, K]`` (as every product over the codes reads them)."""
        n, k = self.shape
        out = torch.empty(n, k, dtype=torch.float32)
        code, codes, scales, offsets = self.c_args()
        load_library().decode_weight(code, codes, scales, offsets, n, k, _ptr(out))
        return out


def codable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a tensor :func:`code_weight` takes (it may still have no form)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.stride(-1) == 1 and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[1] % BLOCK == 0)


def code_weight(weight: torch.Tensor) -> CodedWeight | None:
    """``weight`` (float32 ``[N, K]`` on CPU, rows contiguous, ``K`` a multiple of :data:`BLOCK`) in the shortest
    form that gives back every value bit for bit, or ``None`` where no form does (or the weight is not such a
    tensor). Time: one pass over the weight per form tried (a form fails at its first value without a code)."""
    if not codable(weight):
        return None
    weight = weight.detach()
    n, k = weight.shape
    blocks = k // BLOCK
    for kind, code in KINDS.items():
        codes = torch.empty(n, int(k * _CODE_BYTES[kind]), dtype=torch.uint8)
        scales = torch.empty(n, blocks if kind != "bf16" else 0, dtype=torch.float32)
        offsets = torch.empty(n, blocks if kind == "q4" else 0, dtype=torch.float32)
        status = load_library().code_weight(_ptr(weight), weight.stride(0), n, k, code, _ptr(codes), _ptr(scales),
                                            _ptr(offsets), _threads())
        if status == 0:
            return CodedWeight(kind, (n, k), codes, scales, offsets)
    return None


@_profiled
def gemm_nt_coded(a: torch.Tensor, weight: CodedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ W.T (+ bias)`` in float32 for float32 ``a`` ``[M, K]`` and a coded ``W`` ``[N, K]``: the bits of
    :func:`rlrunbook.kernels.cpu.gemm_nt` over ``weight.decode()``."""
    n, k = weight.shape
    if a.dtype != torch.float32 or a.device.type != "cpu" or a.dim() != 2 or a.shape[1] != k or a.stride(-1) != 1:
        raise ValueError(f"gemm_nt_coded: a is {tuple(a.shape)} {a.dtype} on {a.device} (strides {a.stride()}), "
                         f"the weight [{n}, {k}]")
    m = a.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        bias32 = None if bias is None else bias.detach().float().contiguous()
        _check(load_library().gemm_nt_coded(_ptr(a), a.stride(0), *weight.c_args(), _ptr(bias32), _ptr(out), 0, n,
                                            m, n, k, _threads()), "gemm_nt_coded")
    return out

