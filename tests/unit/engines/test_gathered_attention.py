"""Attention over keys gathered by an index: the same bits as gathering first, and memory linear in the tokens.

A training pass cuts each sequence into rows of ``ROW_QUERIES`` queries; a row reads every key of its path up to
its last query, so the rows of one sequence of ``T`` tokens read about ``T^2 / (2 x 128)`` keys between them. The
fixed core keeps the flat keys and values for backward and gathers them again there
(:func:`rlrunbook.kernels.ops.gathered_attention`); kept gathered, they made a pass's memory grow with the square
of its tokens (at 1,024 tokens of SmolLM2-135M, 1.86 MB per token traced where 1.10 MB is kept now).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlrunbook.backend.memory import LiveBytes
from rlrunbook.engines.layouts import TreeLayout, take_rows
from rlrunbook.engines.row_batches import ROW_QUERIES
from rlrunbook.kernels import ops
from rlrunbook.prefix_tree import TokenTrie, plan_forward


def _gradients(out: torch.Tensor, grad: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, grad))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), queries=st.integers(1, 5), keys=st.integers(1, 9), flat=st.integers(1, 12),
       kv_heads=st.integers(1, 2), group=st.integers(1, 3), dim=st.sampled_from([4, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gathered_attention_is_attention_over_the_gathered_rows_bit_for_bit(rows, queries, keys, flat, kv_heads,
                                                                            group, dim, dtype, threads, seed):
    """Output and the gradients of the queries, flat keys and flat values equal :func:`ops.attention` over
    ``take_rows`` copies, whose backward adds the rows' key gradients by ``index_select``'s: indices repeat
    (rows share keys), padded keys are invalid and point at row 0, a padded query has position -1."""
    generator = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(rows, queries, heads, dim, generator=generator).to(dtype).requires_grad_()
    flat_keys = torch.randn(flat, kv_heads, dim, generator=generator).to(dtype).requires_grad_()
    flat_values = torch.randn(flat, kv_heads, dim, generator=generator).to(dtype).requires_grad_()
    key_index = torch.randint(0, flat, (rows, keys), generator=generator)
    key_valid = torch.rand(rows, keys, generator=generator) < 0.8
    key_index = torch.where(key_valid, key_index, 0)
    key_positions = torch.randint(0, 6, (rows, keys), generator=generator)
    query_positions = torch.randint(-1, 6, (rows, queries), generator=generator)
    grad = torch.randn(rows, queries, heads, dim, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gathered = ops.gathered_attention(q, flat_keys, flat_values, key_index, query_positions, key_positions,
                                          key_valid, 0.25)
        mine = [gathered, *_gradients(gathered, grad, q, flat_keys, flat_values)]
        copies = ops.attention(q, take_rows(flat_keys, key_index), take_rows(flat_values, key_index), query_positions,
                               key_positions, key_valid, 0.25)
        expected = [copies, *_gradients(copies, grad, q, flat_keys, flat_values)]
    finally:
        torch.set_num_threads(previous)
    for name, got, want in zip(("out", "dq", "dkeys", "dvalues"), mine, expected, strict=True):
        assert torch.equal(got, want), name


def _held_by_a_pass(tokens: int, heads: int = 9, kv_heads: int = 3, dim: int = 64) -> int:
    """Bytes autograd keeps after a training pass's attention over one sequence of ``tokens`` (meta tensors)."""
    trie = TokenTrie()
    plan = plan_forward(trie, [list(range(tokens))], max_queries=ROW_QUERIES)
    layout = TreeLayout(plan.rows, plan.flat_of(), trie.positions, torch.device("meta"))
    q = torch.empty(tokens, heads, dim, device="meta", requires_grad=True)
    k = torch.empty(tokens, kv_heads, dim, device="meta", requires_grad=True)
    v = torch.empty(tokens, kv_heads, dim, device="meta", requires_grad=True)
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with LiveBytes(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = layout.attend(0, q, k, v, dim ** -0.5, "fixed")
        held = sum(saved.values()) + out.untyped_storage().nbytes()
    return held


def test_a_training_pass_keeps_memory_linear_in_its_tokens():
    """Held bytes per token over one sequence of 512 to 4,096 tokens (SmolLM2's attention shape) stay within 10%
    (kept gathered, the keys and values alone grew eightfold per token from 512 to 4,096), and at 4,096 tokens
    below 9 KiB per token: the rows' queries and outputs and the pass's output (2,304 bytes each), the flat keys
    and values (1,536) and the float32 normaliser (36)."""
    held = {tokens: _held_by_a_pass(tokens) for tokens in (512, 1024, 2048, 4096)}
    per_token = {tokens: held[tokens] / tokens for tokens in held}
    for shorter, longer in itertools.pairwise(sorted(per_token)):
        assert per_token[longer] <= 1.1 * per_token[shorter], per_token
    assert per_token[4096] <= 9 * 1024, per_token


def _layout(sequences: list[list[int]], max_queries: int) -> TreeLayout:
    """A training pass's layout over ``sequences`` (shared prefixes computed once), rows of ``max_queries``."""
    trie = TokenTrie()
    plan = plan_forward(trie, sequences, max_queries=max_queries)
    return TreeLayout(plan.rows, plan.flat_of(), trie.positions, torch.device("cpu"))


def _pass_inputs(tokens: int, dtype: torch.dtype, generator: torch.Generator):
    """Flat q ``[N, 4, 8]``, keys and values ``[N, 2, 8]`` recording gradients, and an output gradient."""
    q, k, v = (torch.randn(tokens, heads, 8, generator=generator).to(dtype).requires_grad_() for heads in (4, 2, 2))
    return q, k, v, torch.randn(tokens, 32, generator=generator).to(dtype)


def _batch_by_batch(layout: TreeLayout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The chain :func:`ops.pass_attention` replaces: ``gathered_attention`` per batch, outputs back in flat order."""
    parts = [take_rows(ops.gathered_attention(take_rows(q, b.query_index), k, v, b.key_index, b.query_positions,
                                              b.key_positions, b.key_valid, 0.125).flatten(2).flatten(0, 1),
                       b.query_rows) for b in layout.batches]
    return take_rows(torch.cat(parts), layout.order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_pass_through_the_layout_gives_the_gathered_copies_bits(dtype):
    """Two sequences sharing a 150-token prefix, rows of ``ROW_QUERIES`` queries: the layout's output and the
    flat gradients equal the rows' attention over gathered copies, computed row batch by row batch."""
    generator = torch.Generator().manual_seed(3)
    prefix = list(range(150))
    sequences = [prefix + [1000 + i for i in range(140)], prefix + [2000 + i for i in range(60)]]
    layout = _layout(sequences, ROW_QUERIES)
    q, k, v, grad = _pass_inputs(layout.size, dtype, generator)
    out = layout.attend(0, q, k, v, 0.125, "fixed")
    mine = [out, *_gradients(out, grad, q, k, v)]
    parts = []
    for batch in layout.batches:
        rows = ops.attention(take_rows(q, batch.query_index), take_rows(k, batch.key_index),
                             take_rows(v, batch.key_index), batch.query_positions, batch.key_positions,
                             batch.key_valid, 0.125)
        parts.append(take_rows(rows.flatten(2).flatten(0, 1), batch.query_rows))
    copies = take_rows(torch.cat(parts), layout.order)
    expected = [copies, *_gradients(copies, grad, q, k, v)]
    assert len(layout.batches) >= 1 and sum(len(b.key_index) for b in layout.batches) >= 4
    for name, got, want in zip(("out", "dq", "dk", "dv"), mine, expected, strict=True):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_of_many_batches_gives_the_batch_by_batch_chains_bits(dtype, monkeypatch):
    """Four sequences sharing prefixes, rows of 16 queries in batches of one to three rows (a small score budget):
    the keys of the shared prefixes get gradients from many batches, and within a batch from several rows. The
    layout's one-node attention (:func:`ops.pass_attention`) gives the output and flat gradients of the
    batch-by-batch chain it replaces (``gathered_attention`` per batch, outputs taken back to flat order), whose key
    gradients are each batch's own sum over its rows, the batches' sums then added last first."""
    monkeypatch.setattr("rlrunbook.engines.layouts.score_elements", lambda device: 40_000)
    generator = torch.Generator().manual_seed(5)
    prefix = list(range(40))
    sequences = [prefix + [1000 + i for i in range(30)], prefix + [2000 + i for i in range(50)],
                 prefix[:20] + [3000 + i for i in range(45)], [4000 + i for i in range(9)]]
    layout = _layout(sequences, 16)
    assert len(layout.batches) >= 8
    assert any(b.key_unique.numel() < int(b.key_valid.sum()) for b in layout.batches)  # rows sharing keys
    q, k, v, grad = _pass_inputs(layout.size, dtype, generator)
    out = layout.attend(0, q, k, v, 0.125, "fixed")
    mine = [out, *_gradients(out, grad, q, k, v)]
    chain = _batch_by_batch(layout, q, k, v)
    expected = [chain, *_gradients(chain, grad, q, k, v)]
    for name, got, want in zip(("out", "dq", "dk", "dv"), mine, expected, strict=True):
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), name


def test_a_pass_backward_allocates_no_flat_sized_tensor_per_batch(monkeypatch):
    """32 one-row batches over 1,984 flat tokens (SmolLM2's heads): the chain's backward made three zero tensors the
    size of the flat queries, keys and values per batch and added them up; the one-node backward allocates the
    three gradients once and per batch only what its rows read, under a quarter of the chain's bytes."""
    monkeypatch.setattr("rlrunbook.engines.layouts.score_elements", lambda device: 1)
    layout = _layout([[1000 * s + i for i in range(62)] for s in range(32)], 128)
    assert len(layout.batches) == 32
    q = torch.randn(layout.size, 9, 64, requires_grad=True)
    k = torch.randn(layout.size, 3, 64, requires_grad=True)
    v = torch.randn(layout.size, 3, 64, requires_grad=True)
    allocated = {}
    for name in ("pass", "chain"):
        out = layout.attend(0, q, k, v, 0.125, "fixed") if name == "pass" else _batch_by_batch(layout, q, k, v)
        with LiveBytes() as counter:
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        allocated[name] = counter.allocated
        assert all(g.abs().sum() > 0 for g in grads)
    assert 4 * allocated["pass"] <= allocated["chain"], allocated


def test_a_pass_without_gradients_keeps_no_batch_for_backward():
    """A sampler's prefill runs the layout's attention without gradients: each batch's rows are freed once their
    outputs are placed, so its peak (meta tensors, one sequence of 2,048 tokens in rows of 128 queries) stays under
    two thirds of what the same pass holds after its forward when gradients are recorded (every batch's rows and
    normaliser kept for backward)."""
    trie = TokenTrie()
    plan = plan_forward(trie, [list(range(2048))], max_queries=ROW_QUERIES)
    layout = TreeLayout(plan.rows, plan.flat_of(), trie.positions, torch.device("meta"))
    measured = {}
    for grad in (False, True):
        q = torch.empty(layout.size, 9, 64, device="meta", requires_grad=grad)
        k = torch.empty(layout.size, 3, 64, device="meta", requires_grad=grad)
        v = torch.empty(layout.size, 3, 64, device="meta", requires_grad=grad)
        with LiveBytes() as live:
            out = layout.attend(0, q, k, v, 0.125, "fixed")
            measured[grad] = live.peak if not grad else live.live
        del out
    assert len(layout.batches) >= 8
    assert 3 * measured[False] < 2 * measured[True], measured
