"""Attention whose result for a query does not depend on how the keys were batched.

Why this exists: in bf16 a one-token cached decode step and a full-sequence pass run different
attention kernels (one query row against the cache, or blocks of queries against blocks of keys).
Their fp32 partial sums are added in different orders, a handful of outputs round to a different
bf16 value, and every later layer amplifies those one-ulp differences: on SmolLM2-135M the sampler
and the trainer then disagree by 0.034 nats per token on average (measured on this project's CPU,
the same size as on an H100), as much as bf16 itself is away from fp32.

The remedy here is to make the attention core exact enough that the order no longer matters:
scores, softmax and the weighted sum of values are computed in float64 and rounded once to the
model's dtype. A product of two bf16 (or fp32) numbers is exact in float64, the sum of a head's
``D`` products nearly always is, and what is left (the exp and the normalising sum) is off by
~1e-16, far below the 2^-9 rounding step of bf16: a query gets the same bf16 output whether it
attends from a 1-row decode step or from a 512-row training pass, whatever the padding and however
its keys are laid out. ``native`` numerics skip this and use PyTorch's SDPA in the model's dtype (what
transformers does); it is there to measure what the float64 core buys.

Shapes: ``R`` rows, ``T`` queries per row, ``S`` keys per row, ``H`` query heads in ``Hkv`` groups of
``G`` (grouped-query attention: query head ``h`` reads key/value head ``h // G``), head size ``D``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           exact: bool = True) -> torch.Tensor:
    """Masked softmax attention of each row's queries over that row's keys.

    ``q``: ``[R, T, H, D]``; ``k``, ``v``: ``[R, S, Hkv, D]``; ``allowed``: ``[R, T, S]`` bool, whether
    query ``t`` may read key ``s``. Returns ``[R, T, H * D]`` in ``q``'s dtype. A query with no allowed
    key (padding) gets zeros. ``exact`` selects the float64 core (see the module docstring); otherwise
    SDPA in the input dtype.
    """
    rows, queries, heads, dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    if not exact:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None],
            scale=scale, enable_gqa=groups > 1)  # [R, H, T, D]
        out = out.transpose(1, 2)
    else:
        q64 = q.double().view(rows, queries, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)  # [R, Hkv, G, T, D]
        k64 = k.double().permute(0, 2, 1, 3).unsqueeze(2)  # [R, Hkv, 1, S, D]
        v64 = v.double().permute(0, 2, 1, 3).unsqueeze(2)  # [R, Hkv, 1, S, D]
        scores = (q64 @ k64.transpose(-1, -2)) * scale  # [R, Hkv, G, T, S]
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: NaN -> 0
        out = (weights @ v64).permute(0, 3, 1, 2, 4).to(q.dtype)  # [R, T, Hkv, G, D]
    out = out.reshape(rows, queries, heads * dim)
    if not exact:  # SDPA gives NaN for a query with no allowed key
        out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return out


def causal_allowed(query_positions: torch.Tensor, key_positions: torch.Tensor,
                   key_valid: torch.Tensor) -> torch.Tensor:
    """``[R, T, S]``: a query may read a valid key at the same or an earlier position.

    Positions are those of the tokens in their own sequence, so this is the causal mask whatever
    the layout: keys gathered from a shared prefix, a per-row cache, or padding.
    ``query_positions``: ``[R, T]``; ``key_positions``, ``key_valid``: ``[R, S]``.
    """
    return key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])
