"""The attention core at a real shape: linear memory, and the same numbers however it is chunked.

The shape is Qwen2.5-1.5B's attention (12 query heads, 2 key/value heads, head size 128), one row, bf16 inputs,
forward then backward. "Held" is what the forward leaves for the backward pass: the tensors autograd saved
(counted by storage, inputs excluded) and the output; "peak" is the most tensor memory alive at once
(:class:`rlrunbook.backend.memory.LiveBytes`). Before the core went blockwise it held 1,280 MB at T = 2,048
(the float64 scores ``[heads, T, T]`` and their softmax) and peaked at 1,720 MB.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlrunbook.backend.memory import LiveBytes
from rlrunbook.engines import attention
from rlrunbook.engines.attention import attend

HEADS, KV_HEADS, DIM = 12, 2, 128
MB = 1 << 20


def _inputs(tokens: int, device: str = "cpu", dtype=torch.bfloat16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def make(*shape):
        values = torch.randn(*shape, generator=generator).to(dtype) if device == "cpu" else torch.empty(
            *shape, dtype=dtype, device=device)
        return values.requires_grad_()

    q, k, v = make(1, tokens, HEADS, DIM), make(1, tokens, KV_HEADS, DIM), make(1, tokens, KV_HEADS, DIM)
    positions = torch.arange(tokens, device=device)[None]
    return q, k, v, positions, torch.ones_like(positions, dtype=torch.bool)


def _held_after_forward(q, k, v, positions, valid, core: str = "float64") -> tuple[int, torch.Tensor]:
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = attend(q, k, v, positions, positions, valid, DIM ** -0.5, core=core)
    inputs = {t.untyped_storage()._cdata for t in (q, k, v, positions, valid)}
    held = sum(size for key, size in saved.items() if key not in inputs)
    return held + out.untyped_storage().nbytes(), out


@pytest.mark.parametrize("core", ["fixed", "float64", "sdpa"])
def test_held_memory_grows_linearly_from_512_to_4096_tokens(core):
    """Traced on the meta device (the same code, shapes only): held bytes per token never grow with T from 512 to
    4,096 (they may fall where recomputation starts), where scores kept for backward would make them grow
    eightfold (4,096 / 512)."""
    held = {}
    for tokens in (512, 1024, 2048, 4096):
        q, k, v, positions, valid = _inputs(tokens, device="meta")
        with LiveBytes():  # meta storages exist while traced: what was saved is counted by storage
            held[tokens], _ = _held_after_forward(q, k, v, positions, valid, core)
    per_token = {tokens: held[tokens] / tokens for tokens in held}
    for shorter, longer in itertools.pairwise(sorted(per_token)):
        assert per_token[longer] <= 1.1 * per_token[shorter], per_token
    assert held[4096] <= 8.5 * held[512], held


@pytest.mark.parametrize("core", ["fixed", "float64"])
def test_the_core_at_2048_tokens_holds_little_and_peaks_low(core):
    """At 2,048 tokens on this CPU: held after forward <= 64 MB (scores kept for backward would be 1,280), peak <=
    256 MB (was 1,720). The fixed core keeps its output and one float32 per query and head."""
    q, k, v, positions, valid = _inputs(2048)
    with LiveBytes() as live:
        held, out = _held_after_forward(q, k, v, positions, valid, core)
        out.float().sum().backward()
    assert held <= 64 * MB, f"held {held / MB:.1f} MB after the forward"
    assert live.peak <= 256 * MB, f"peak {live.peak / MB:.1f} MB"
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_chunks_and_key_blocks_do_not_change_a_bit(monkeypatch):
    """A query's output and every gradient are the same bits whether the core computes all queries and keys at
    once or in many query chunks and key blocks, with or without recomputation in backward (bf16)."""
    def run():
        q, k, v, positions, valid = _inputs(300, seed=1)
        out = attend(q, k, v, positions, positions, valid, DIM ** -0.5, core="float64")
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    whole = run()
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", {"cpu": 16 * HEADS * 300, "cuda": 16 * HEADS * 300})  # 16 queries
    monkeypatch.setattr(attention, "KEY_ELEMENTS", 64 * KV_HEADS * DIM)  # 64 keys per float64 block
    blocked = run()
    monkeypatch.setattr(attention, "RECOMPUTE_FROM_KEYS", {True: 1 << 30, False: 1 << 30})  # keep scores
    kept = run()
    for a, b, c in zip(whole, blocked, kept, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("core", ["fixed", "float64", "sdpa"])
def test_a_padding_query_gets_zeros_and_no_gradient_leaks_from_it(core):
    q, k, v, positions, valid = _inputs(40, dtype=torch.float32)
    query_positions = positions.clone()
    query_positions[0, -5:] = -1  # padding queries: no key at or before position -1
    out = attend(q, k, v, query_positions, positions, valid, DIM ** -0.5, core=core)
    assert torch.equal(out[0, -5:], torch.zeros_like(out[0, -5:]))
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    assert torch.equal(q.grad[0, -5:], torch.zeros_like(q.grad[0, -5:]))


def test_a_decode_step_at_length_converts_keys_a_block_at_a_time():
    """One decode step of 256 rows over 1,024 and over 4,096 cached positions (the 1.5B shape, bf16, traced on the
    meta device as on a GPU): the step never holds a float64 copy of its key/value window (2 x 256 x 4,096 x 2 x
    128 x 8 bytes = 4 GiB per layer at 4,096; the step's peak, ~0.75 GiB, is its [256, 151,936] float32 logits and
    the draw's buffers); what grows with the window is the scores, 256 x 12 heads x 8 bytes per position and a
    few copies of them."""
    from rlrunbook.backend.memory import sampling_transients
    from rlrunbook.models.shapes import model_shape

    config = model_shape("Qwen/Qwen2.5-Math-1.5B")[0]
    peaks = {window: sampling_transients(config, torch.bfloat16, "invariant", prefill_tokens=8, rows=256,
                                         window=window, device_type="cuda")[1] for window in (1024, 4096)}
    whole_window_float64 = 2 * 256 * 4096 * KV_HEADS * DIM * 8
    assert peaks[4096] < whole_window_float64 / 4, peaks
    scores_per_position = 256 * HEADS * 8
    assert peaks[4096] - peaks[1024] <= 4 * scores_per_position * (4096 - 1024), peaks
