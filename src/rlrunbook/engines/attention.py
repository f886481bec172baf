"""Attention whose result for a query does not depend on how the keys were batched, in linear memory.

Three cores compute the same masked softmax attention (``core``):

- ``fixed`` (``invariant`` numerics): :func:`rlrunbook.kernels.ops.attention`, every sum in an order
  fixed by the code in float32 over the model's dtype; a query reads its allowed keys in increasing
  key index, so any layout that lists a query's keys in position order (a one-token decode step over a
  cache, a training pass over a shared prefix, padding anywhere) gives it the same bits. It keeps one
  float32 per query and head for backward and no queries x keys tensor.
- ``float64`` (``exact`` numerics): scores, softmax and the weighted sum of values in float64, rounded
  once to the model's dtype. A product of two bf16 (or fp32) numbers is exact in float64 and what is
  left is off by ~1e-16, far below a rounding step of the model's dtype, so the order of the sums stops
  mattering except within ~1e-16 of a rounding boundary: a reference that needs no fixed order.
- ``sdpa`` (``native`` numerics): PyTorch's fused kernel in the model's dtype, as transformers computes.

Memory grows linearly with the tokens. For the ``float64`` and ``sdpa`` cores nothing of size queries x
keys outlives one block:

- the mask is never stored: it is computed block by block from the positions (``[R, T]`` queries,
  ``[R, S]`` keys), a query reading every valid key at the same or an earlier position;
- keys and values are converted to float64 a block of at most ``KEY_ELEMENTS`` elements at a time;
- queries go in chunks of at most ``SCORE_ELEMENTS`` score elements (``rows x heads x chunk x keys``; per device),
  and when gradients are recorded over more than ``RECOMPUTE_FROM_KEYS`` keys each chunk is recomputed
  in the backward pass instead of keeping its scores (activation checkpointing), so what a layer keeps
  for backward is ``q``, ``k``, ``v`` and the output: O(T) per row.

Shapes: ``R`` rows, ``T`` queries per row, ``S`` keys per row, ``H`` query heads in ``Hkv`` groups of
``G`` (grouped-query attention: query head ``h`` reads key/value head ``h // G``), head size ``D``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlrunbook.kernels import ops as fixed_ops

# Score elements per query chunk, by device: 32 MB of float64 scores on a CPU, where they are computed a core at
# a time anyway; 512 MB on a GPU, where every chunk costs ~15 kernel launches and fewer, larger ones pay.
SCORE_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
# The device a pass on the meta device (a memory plan) stands for; see :func:`planning_for`.
_PLANNED_DEVICE: ContextVar[str] = ContextVar("planned_device", default="cpu")
KEY_ELEMENTS = 1 << 22  # key (or value) elements converted to float64 at a time: 32 MB
_MIN_KEY_BLOCK = 64
# With gradients over more keys than this, query chunks are recomputed in backward instead of keeping
# what the core saves for it: float64 scores and weights (16 bytes x heads x keys per query, 49 KB at 12 heads
# and 256 keys, ~7x the query's own q, k, v and output), or SDPA's mask (1 byte per key).
RECOMPUTE_FROM_KEYS = {True: 256, False: 1024}  # by ``exact``
_MASKED = -1e300  # the score of a key a query may not read (see _float64_core)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_positions: torch.Tensor,
           key_positions: torch.Tensor, key_valid: torch.Tensor, scale: float, core: str = "fixed",
           recompute: bool | None = None) -> torch.Tensor:
    """Masked softmax attention of each row's queries over that row's keys.

    ``q``: ``[R, T, H, D]``; ``k``, ``v``: ``[R, S, Hkv, D]``. ``query_positions``: ``[R, T]``, a query's
    position in its own sequence (``-1``: a padding query); ``key_positions``, ``key_valid``: ``[R, S]``
    (or ``[1, S]``, shared by every row). A query reads the valid keys at its own or an earlier position
    (the causal mask of any layout: keys gathered from a shared prefix, a per-row cache, padding).
    Returns ``[R, T, H * D]`` in ``q``'s dtype; a query with no key to read (padding) gets zeros.
    ``core``: ``fixed``, ``float64`` or ``sdpa`` (see the module docstring). ``recompute``: whether query
    chunks of the ``float64`` and ``sdpa`` cores are recomputed in backward; ``None`` decides by the key
    count (see the module docstring); ``False`` for a caller that recomputes a larger unit itself.
    """
    rows, queries, heads, dim = q.shape
    if core == "fixed":
        return fixed_ops.attention(q, k, v, query_positions, key_positions, key_valid, scale).reshape(
            rows, queries, heads * dim)
    if core not in ("float64", "sdpa"):
        raise ValueError(f"attention core {core!r} is not one of fixed, float64, sdpa")
    exact = core == "float64"
    keys = k.shape[1]
    core_fn = _float64_core if exact else _sdpa_core
    chunk = max(1, score_elements(q.device) // max(1, rows * heads * keys))
    if recompute is None:
        recompute = recompute_pays(keys, core, q, k, v)
    if chunk >= queries and not recompute:
        return core_fn(q, k, v, query_positions, key_positions, key_valid, scale)
    if exact and torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        # Converted once, so the chunks' gradients of the keys and values add up in float64 and are rounded to
        # the input's dtype once (converted per chunk, each chunk's share would be rounded before the sum).
        k, v = k.double(), v.double()
    parts = []
    for start in range(0, queries, chunk):
        args = (q[:, start:start + chunk], k, v, query_positions[:, start:start + chunk], key_positions,
                key_valid, scale)
        parts.append(checkpoint(core_fn, *args, use_reentrant=False) if recompute else core_fn(*args))
    return torch.cat(parts, dim=1)


def attend_gathered(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_index: torch.Tensor,
                    query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor, scale: float,
                    core: str = "fixed", recompute: bool | None = None) -> torch.Tensor:
    """:func:`attend` over ``keys[key_index]`` and ``values[key_index]`` (``keys``, ``values``: ``[N, Hkv, D]``
    flat; ``key_index``: ``[R, S]``), the same values and gradients. The ``fixed`` core keeps the flat tensors
    for backward instead of the rows' gathered copies (:func:`rlrunbook.kernels.ops.gathered_attention`), which
    overlap where rows share a prefix; the other cores gather, and chunk or recompute as :func:`attend` does."""
    if core == "fixed":
        rows, queries, heads, dim = q.shape
        return fixed_ops.gathered_attention(q, keys, values, key_index, query_positions, key_positions, key_valid,
                                            scale).reshape(rows, queries, heads * dim)
    flat_index = key_index.reshape(-1)
    k = keys.index_select(0, flat_index).view(*key_index.shape, *keys.shape[1:])
    v = values.index_select(0, flat_index).view(*key_index.shape, *values.shape[1:])
    return attend(q, k, v, query_positions, key_positions, key_valid, scale, core, recompute)


def device_kind(device: torch.device) -> str:
    """``device``'s type, or for the meta device (a memory plan) the type it stands for (:func:`planning_for`)."""
    return _PLANNED_DEVICE.get() if device.type == "meta" else device.type


def score_elements(device: torch.device) -> int:
    """Score elements one query chunk may hold on ``device`` (a meta tensor stands for :func:`planning_for`'s)."""
    kind = device_kind(device)
    return SCORE_ELEMENTS.get(kind, SCORE_ELEMENTS["cuda"] if kind != "cpu" else SCORE_ELEMENTS["cpu"])


@contextmanager
def planning_for(device_type: str) -> Iterator[None]:
    """Inside the block, passes on the meta device chunk their attention as on ``device_type`` would."""
    token = _PLANNED_DEVICE.set(device_type)
    try:
        yield
    finally:
        _PLANNED_DEVICE.reset(token)


def recompute_pays(keys: int, core: str, *inputs: torch.Tensor) -> bool:
    """Whether attention over ``keys`` keys through ``core``, recording gradients for ``inputs``, should be
    recomputed in backward rather than keep its scores (see ``RECOMPUTE_FROM_KEYS``; the ``fixed`` core keeps
    no scores, so never)."""
    if core == "fixed":
        return False
    return (keys > RECOMPUTE_FROM_KEYS[core == "float64"] and torch.is_grad_enabled()
            and any(x.requires_grad for x in inputs))


def _allowed(query_positions: torch.Tensor, key_positions: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """``[R, T, S]``: query ``t`` may read key ``s`` (valid, at the same or an earlier position)."""
    return key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])


def _float64_core(q, k, v, query_positions, key_positions, key_valid, scale) -> torch.Tensor:
    rows, queries, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    # [R, Hkv, G*T, D]: the G query heads of a key/value head side by side, so one product serves them all
    q64 = q.double().view(rows, queries, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(
        rows, kv_heads, groups * queries, dim)
    width = max(_MIN_KEY_BLOCK, KEY_ELEMENTS // (rows * kv_heads * dim))
    blocks = [(start, min(keys, start + width)) for start in range(0, keys, width)]

    def block64(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:  # [R, Hkv, hi - lo, D], converted on its own
        return x[:, lo:hi].double().transpose(1, 2)

    parts = [q64 @ block64(k, lo, hi).transpose(-1, -2) for lo, hi in blocks]
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [R, Hkv, G*T, S]
    del parts
    allowed = _allowed(query_positions, key_positions, key_valid)  # [R, T, S]
    # A finite fill: exp() of it is exactly 0 beside any allowed key, as -inf's is, and a query with no
    # allowed key (padding) gets finite weights (zeroed below) instead of NaNs that backward would spread.
    scores.mul_(scale).view(rows, kv_heads, groups, queries, keys).masked_fill_(~allowed[:, None, None], _MASKED)
    weights = torch.softmax(scores, dim=-1)
    if len(blocks) == 1:
        out = weights @ block64(v, 0, keys)  # [R, Hkv, G*T, D]
    else:  # the weighted sum of values, block by block in a fixed order
        out = sum(weights[..., lo:hi] @ block64(v, lo, hi) for lo, hi in blocks)
    out = out.view(rows, kv_heads, groups, queries, dim).permute(0, 3, 1, 2, 4)  # [R, T, Hkv, G, D]
    out = out.to(q.dtype).reshape(rows, queries, heads * dim)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


def _sdpa_core(q, k, v, query_positions, key_positions, key_valid, scale) -> torch.Tensor:
    rows, queries, heads, dim = q.shape
    allowed = _allowed(query_positions, key_positions, key_valid)  # [R, T, S]
    if q.device.type == "meta":  # a memory plan: what the fused kernel allocates, not meta's math decomposition
        out = _PlannedSdpa.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed[:, None])
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None], scale=scale,
            enable_gqa=heads > k.shape[2])  # [R, H, T, D]
    out = out.transpose(1, 2).reshape(rows, queries, heads * dim)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # SDPA gives NaN for a query with no key


class _PlannedSdpa(torch.autograd.Function):
    """SDPA on the meta device, as its fused kernels allocate: the output and a float32 log-sum-exp per query
    kept for backward with the inputs and the mask (on CUDA converted to an additive bias in the inputs'
    dtype), the queries laid out contiguously. Meta dispatch would otherwise decompose SDPA into the math path,
    whose ``[R, H, T, S]`` weights no fused kernel holds."""

    @staticmethod
    def forward(ctx, q, k, v, mask):  # q: [R, H, T, D]; k, v: [R, Hkv, S, D]; mask: [R, 1, T, S]
        q = q.contiguous()  # the CPU kernel keeps a contiguous copy of the queries: one more query-sized tensor
        out = torch.empty_like(q)
        log_sum_exp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        kept = mask if _PLANNED_DEVICE.get() == "cpu" else mask.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, log_sum_exp, kept)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None
