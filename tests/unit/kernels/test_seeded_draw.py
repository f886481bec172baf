"""The seeded draw in one kernel (c/draw.c on CPU, its Triton twin on CUDA) is the eager draw, bit for bit.

The eager path (:func:`rlrunbook.engines.token_draw.draw_tokens`: counter-based Gumbel noise, ``argmax``, the
fixed-order ``log_softmax_at``) is the reference; the kernels must give the same tokens and the same logprob bits
for any logits, seeds, step, temperature and filters. The Triton kernel runs interpreted here (``TRITON_INTERPRET=1``)
at small shapes, against the eager path with the Triton log-sum-exp that ``log_softmax_at`` uses on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlrunbook.engines import noise
from rlrunbook.engines.filters import SamplingFilters, apply_filters
from rlrunbook.engines.token_draw import draw_tokens, draw_tokens_fused
from rlrunbook.kernels import ops

FILTERS = [SamplingFilters(1.0), SamplingFilters(0.7), SamplingFilters(1.3), SamplingFilters(0.0),
           SamplingFilters(1.0, top_k=5), SamplingFilters(0.8, top_p=0.9), SamplingFilters(1.0, min_p=0.05),
           SamplingFilters(0.6, top_k=40, top_p=0.95, min_p=0.01)]


@st.composite
def draws(draw, max_rows: int, max_vocab: int):
    rows = draw(st.integers(1, max_rows))
    vocab = draw(st.integers(1, max_vocab))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, vocab, generator=generator) * draw(st.sampled_from([0.0, 0.1, 3.0, 30.0]))
    if draw(st.booleans()):  # tokens an earlier mask removed, and ties at the top
        logits[torch.rand(rows, vocab, generator=generator) < 0.3] = -float("inf")
        logits[:, 0] = logits.max()
    seeds = torch.tensor([noise.mix_seed(draw(st.integers(-2**63, 2**64 - 1)), r) for r in range(rows)])
    return logits, seeds, draw(st.integers(0, 100_000)), draw(st.sampled_from(FILTERS))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a tensor, every NaN alike (a row of -inf logits has NaN logprobs on both paths)."""
    return t if not t.is_floating_point() else torch.where(t.isnan(), torch.nan, t).view(torch.int32)


def _same(draw_a, draw_b) -> bool:
    return all(torch.equal(_bits(a), _bits(b)) for a, b in zip(draw_a, draw_b, strict=True))


def _as_tuple(draw):
    return draw.token, draw.sampled_logprob, draw.policy_logprob


@given(draws(max_rows=6, max_vocab=3000))
def test_the_c_kernel_draws_the_eager_tokens_and_logprobs_bit_for_bit(case):
    logits, seeds, step, filters = case
    eager = draw_tokens(logits, filters, seeds, step, ops.log_softmax_at)
    assert _same(_as_tuple(draw_tokens_fused(logits, filters, seeds, step)), _as_tuple(eager))


def test_at_smollm2_s_vocabulary_the_c_kernel_is_the_eager_draw_step_after_step():
    generator = torch.Generator().manual_seed(7)
    seeds = torch.tensor([noise.mix_seed(1, r) for r in range(16)])
    for step in range(0, 64, 9):
        logits = torch.randn(16, 49152, generator=generator) * 2.5
        for filters in (SamplingFilters(1.0), SamplingFilters(0.7)):
            eager = draw_tokens(logits, filters, seeds, step, ops.log_softmax_at)
            assert _same(_as_tuple(draw_tokens_fused(logits, filters, seeds, step)), _as_tuple(eager))


def test_the_kernel_writes_a_column_of_step_buffers_and_the_next_input():
    generator = torch.Generator().manual_seed(3)
    logits, seeds = torch.randn(3, 500, generator=generator), torch.tensor([5, 6, 7])
    eager = draw_tokens(logits, SamplingFilters(0.9), seeds, 11, ops.log_softmax_at)
    out = (torch.zeros(4, 8, dtype=torch.int64), torch.zeros(4, 8), torch.zeros(4, 8))
    feed, feed_index = torch.full((6,), -1, dtype=torch.int64), torch.tensor([4, 0, 2])
    assert ops.seeded_draw(logits, seeds, 11, temperature=0.9, out=out, column=5, feed=feed,
                           feed_index=feed_index) is None
    assert _same((out[0][:3, 5], out[1][:3, 5], out[2][:3, 5]), _as_tuple(eager))
    assert torch.equal(feed, torch.tensor([eager.token[1], -1, eager.token[2], -1, eager.token[0], -1]))
    assert out[0][:, [0, 1, 2, 3, 4, 6, 7]].eq(0).all() and out[0][3].eq(0).all(), "only column 5 of 3 rows is set"


def test_the_kernel_refuses_what_it_cannot_read():
    logits, seeds = torch.zeros(2, 10), torch.tensor([1, 2])
    with pytest.raises(TypeError, match="float32"):
        ops.seeded_draw(logits.double(), seeds, 0)
    with pytest.raises(ValueError, match="row_seeds"):
        ops.seeded_draw(logits, seeds[:1], 0)
    with pytest.raises(ValueError, match="feed"):
        ops.seeded_draw(logits, seeds, 0, feed=torch.zeros(2, dtype=torch.int64))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="on a CUDA machine the gpu tier runs it")
# The interpreter's numpy warns where triton 3.6 turns one-element loop bounds into Python ints (numpy 2.2), and where
# a row of -inf logits sums to 0 and subtracts -inf from -inf (its logprob is NaN on both paths, as checked): nothing
# of the kernel.
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
@given(draws(max_rows=3, max_vocab=2100))
def test_the_triton_kernel_draws_the_eager_tokens_and_logprobs_bit_for_bit(case):
    pytest.importorskip("triton", reason="triton is not installed (scripts/setup.sh installs it on Linux)")
    from rlrunbook.kernels import gpu

    logits, seeds, step, filters = case

    def triton_log_softmax_at(x, targets):  # ops.log_softmax_at as it runs on CUDA
        return x.gather(-1, targets[:, None]).squeeze(-1) - gpu.row_logsumexp(x)

    eager = draw_tokens(logits, filters, seeds, step, triton_log_softmax_at)
    filtered = apply_filters(logits, filters) if filters.filters_tokens else None
    mode = ("greedy" if filters.greedy else "filtered" if filtered is not None
            else "temperature" if filters.temperature != 1.0 else "logits")
    rows = logits.shape[0]
    out = (torch.empty(rows, 2, dtype=torch.int64), torch.empty(rows, 2), torch.empty(rows, 2))
    gpu.seeded_draw(logits, seeds, step, mode, filters.temperature, filtered, *out, 1)
    assert _same((out[0][:, 1], out[1][:, 1], out[2][:, 1]), _as_tuple(eager))


@pytest.mark.parametrize("top", [0.0, 25.0, -3000.0, 1e4])
def test_scores_too_low_to_win_are_skipped_without_changing_the_draw(top):
    """The kernel skips the logs of keys whose hash bits say they stay below the best key so far (c/draw.c,
    pruned_draw). One score at the top and 4,095 others 12 or 16 below it: the low ones' largest key, about 8 above
    their score, beats the top's now and then, and the tokens and logprobs stay the eager draw's on every step. A
    bound that lets the noise reach 0.3 past its integer, or the bound of the next integer, fails here."""
    generator = torch.Generator().manual_seed(11)
    seeds = torch.tensor([noise.mix_seed(3, r) for r in range(8)])
    logits = torch.full((8, 4096), top - 12.0)
    logits[4:] = top - 16.0
    logits += 0.01 * torch.rand(8, 4096, generator=generator)  # ties apart
    logits[:, 100] = top + 0.5
    logits[1, 200:300] = -float("inf")
    won_below = 0
    for step in range(40):
        eager = draw_tokens(logits, SamplingFilters(1.0), seeds, step, ops.log_softmax_at)
        assert _same(_as_tuple(draw_tokens_fused(logits, SamplingFilters(1.0), seeds, step)), _as_tuple(eager))
        won_below += int((eager.token != 100).sum())
    assert won_below > 0  # scores far below the top won some draws: the bound was exercised
