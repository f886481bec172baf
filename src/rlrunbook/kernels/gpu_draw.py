"""The seeded draw in Triton for CUDA: the twin of ``c/draw.c`` (the counter-based noise, the argmax and both
logprobs of a row in one pass over its logits); :func:`rlrunbook.kernels.ops.seeded_draw` dispatches to it through
:mod:`rlrunbook.kernels.gpu`."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rlrunbook.kernels.profiling import profiled

NUM_WARPS = 4  # as rlrunbook.kernels.gpu


def _interpreted() -> bool:
    """Whether the kernel runs under ``TRITON_INTERPRET=1`` (CPU tests), where division is numpy's."""
    return os.environ.get("TRITON_INTERPRET") == "1"

DRAW_BLOCK = 1024  # vocabulary entries per loop iteration: gpu.ROW_BLOCK, so the log-sum-exps add as row_logsumexp's
_GOLDEN, _MIX1, _MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685  # the int64 bits of noise.py's
_DRAW_MODES = {"logits": 0, "temperature": 1, "filtered": 2, "greedy": 3}


@triton.jit
def _shr(x, K: tl.constexpr):
    """Logical right shift of int64 (``>>`` is arithmetic), as noise.py writes it."""
    return (x >> K) & ((1 << (64 - K)) - 1)


@triton.jit
def _splitmix64(x, GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr):
    z = x + GOLDEN
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    return z ^ _shr(z, 31)


@triton.jit(do_not_specialize=["V", "sl", "sf", "so", "column", "step_mix"])
def _seeded_draw_kernel(logits_ptr, filtered_ptr, seeds_ptr, token_ptr, sampled_ptr, policy_ptr, feed_ptr,
                        feed_index_ptr, V, sl, sf, so, column, step_mix, scale, MODE: tl.constexpr,
                        RECIPROCAL: tl.constexpr, HAS_FEED: tl.constexpr, BLOCK: tl.constexpr,
                        GOLDEN: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    base = _splitmix64(seed ^ step_mix, GOLDEN, MIX1, MIX2)
    big = V + 0  # an index past the row: "none yet"
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_at = tl.full((BLOCK,), 0, dtype=tl.int64) + big
    nan_at = tl.full((BLOCK,), 0, dtype=tl.int64) + big
    top_x = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    top_s = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):  # pass 1: the argmax of score + noise, the maxima
        cols = v0 + tl.arange(0, BLOCK).to(tl.int64)
        valid = cols < V
        x = tl.load(logits_ptr + row * sl + cols, mask=valid, other=float("-inf"))
        if MODE == 1:
            s = x * scale if RECIPROCAL else x / scale
        elif MODE == 2:
            s = tl.load(filtered_ptr + row * sf + cols, mask=valid, other=float("-inf"))
        else:
            s = x
        if MODE == 3:
            key = s
        else:
            bits = _shr(_splitmix64(base + cols * GOLDEN, GOLDEN, MIX1, MIX2), 11)
            u = (bits.to(tl.float64) + 0.5) / 9007199254740992.0
            key = s + (-tl.log(-tl.log(u))).to(tl.float32)
        nan_at = tl.minimum(nan_at, tl.where(valid & (key != key), cols, big))  # noqa: PLR0124 (NaN)
        better = valid & ((key > best) | (best_at == big))
        best = tl.where(better, key, best)
        best_at = tl.where(better, cols, best_at)
        top_x = tl.maximum(top_x, x)
        top_s = tl.maximum(top_s, s)
    first_nan = tl.min(nan_at, axis=0)
    winner = tl.max(best, axis=0)
    token = tl.min(tl.where((best == winner) & (best_at < big), best_at, big), axis=0)
    token = tl.where(first_nan < big, first_nan, token)
    m_x = tl.max(top_x, axis=0)
    m_s = tl.max(top_s, axis=0)
    shift_x = tl.where(m_x == float("-inf"), 0.0, m_x)
    shift_s = tl.where(m_s == float("-inf"), 0.0, m_s)
    acc_x = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_s = tl.zeros((BLOCK,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):  # pass 2: the sums of exps, as _row_logsumexp_kernel adds them
        cols = v0 + tl.arange(0, BLOCK).to(tl.int64)
        valid = cols < V
        x = tl.load(logits_ptr + row * sl + cols, mask=valid, other=float("-inf"))
        acc_x += tl.exp(x - shift_x)
        if MODE == 1:
            s = x * scale if RECIPROCAL else x / scale
            acc_s += tl.exp(s - shift_s)
        elif MODE == 2:
            s = tl.load(filtered_ptr + row * sf + cols, mask=valid, other=float("-inf"))
            acc_s += tl.exp(s - shift_s)
    x_token = tl.load(logits_ptr + row * sl + token)
    policy = x_token - (shift_x + tl.log(tl.sum(acc_x, axis=0)))
    sampled = policy
    if MODE == 1:
        s_token = x_token * scale if RECIPROCAL else x_token / scale
        sampled = s_token - (shift_s + tl.log(tl.sum(acc_s, axis=0)))
    elif MODE == 2:
        s_token = tl.load(filtered_ptr + row * sf + token)
        sampled = s_token - (shift_s + tl.log(tl.sum(acc_s, axis=0)))
    tl.store(token_ptr + row * so + column, token)
    tl.store(sampled_ptr + row * so + column, sampled)
    tl.store(policy_ptr + row * so + column, policy)
    if HAS_FEED:
        tl.store(feed_ptr + tl.load(feed_index_ptr + row), token)


def _mix(value: int) -> int:
    """``noise.splitmix64`` of one int64, in Python integers (the step's part of every row's base)."""
    mask = (1 << 64) - 1
    z = (value + _GOLDEN) & mask
    z = ((z ^ (z >> 30)) * (_MIX1 & mask)) & mask
    z = ((z ^ (z >> 27)) * (_MIX2 & mask)) & mask
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


@profiled
def seeded_draw(logits: torch.Tensor, row_seeds: torch.Tensor, step: int, mode: str, temperature: float,
                filtered: torch.Tensor | None, token: torch.Tensor, sampled: torch.Tensor, policy: torch.Tensor,
                column: int, feed: torch.Tensor | None = None, feed_index: torch.Tensor | None = None) -> None:
    """:func:`rlrunbook.kernels.cpu.seeded_draw` on CUDA: one program per row, two passes over its vocabulary.

    ``logits / T`` is computed as PyTorch's CUDA division by a Python number computes it, ``logits * (1 / T)``
    with the reciprocal rounded to float32 (interpreted on CPU, as PyTorch's CPU division: ``logits / T``); no
    multiply-add is fused (``enable_fp_fusion=False``), so every rounding is the eager path's."""
    rows, vocab = logits.shape
    if rows == 0:
        return
    reciprocal = not _interpreted()
    scale = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)) \
        if reciprocal else float(temperature)
    _seeded_draw_kernel[(rows,)](
        logits, filtered if filtered is not None else logits, row_seeds, token, sampled, policy,
        feed if feed is not None else token, feed_index if feed_index is not None else row_seeds, vocab,
        logits.stride(0), filtered.stride(0) if filtered is not None else 0, token.stride(0), column, _mix(step),
        scale, MODE=_DRAW_MODES[mode], RECIPROCAL=reciprocal, HAS_FEED=feed is not None, BLOCK=DRAW_BLOCK,
        GOLDEN=_GOLDEN, MIX1=_MIX1, MIX2=_MIX2, num_warps=NUM_WARPS, enable_fp_fusion=False)
